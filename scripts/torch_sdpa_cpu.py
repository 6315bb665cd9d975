"""Times PyTorch's F.scaled_dot_product_attention forward+backward on the CPU
at the shape of tessera's flash attention bench (issue 6), for BENCHMARKS.md.

    python3 scripts/torch_sdpa_cpu.py [B H N D] [--causal]

Two threads (the dev machine's cores, as tessera's rayon pool uses), f32,
median of 10 timed runs after 3 warm-up runs. One run = forward, then
backward of (out * d_out).sum(), the same work as the criterion bench
`cargo bench -p tessera --bench flash_attention`.
"""
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
args = [a for a in sys.argv[1:] if not a.startswith("--")]
B, H, N, D = (int(a) for a in args) if args else (4, 16, 512, 64)
causal = "--causal" in sys.argv

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(B, H, N, D, generator=g).requires_grad_() for _ in range(3))
d_out = torch.randn(B, H, N, D, generator=g)


def step():
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(d_out)
    q.grad = k.grad = v.grad = None


for _ in range(3):
    step()
times = []
for _ in range(10):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
med = statistics.median(times)
flop = 3.5 * 4 * B * H * N * N * D * (0.5 if causal else 1.0)
print(json.dumps(dict(
    torch=torch.__version__, shape=[B, H, N, D], causal=causal, threads=2,
    fwd_bwd_ms_median=round(med * 1e3, 2), fwd_bwd_ms_min=round(min(times) * 1e3, 2),
    gflops=round(flop / med / 1e9, 1),
)))
