# Replays the seed experiment (Enhancing PyTorch Backend Programmability with
# User-Defined Context Hints) on a CUDA GPU with PyTorch, as the anchor for
# this project's own numbers.  Shapes (8, 32, 2048, 128); time = forward +
# backward; peak = max allocated during the run minus what was allocated
# before it (inputs), as in the seed.
#
# Copied from ../shared/anchors (which does not travel to the GPU machine).
# Two switches, for runs on a tight device budget (say so beside figures):
#   ANCHOR_DTYPES=bf16            only bf16 (default: bf16 then fp32)
#   ANCHOR_SKIP_SLICED_COMPILE=1  skip torch.compile of the 256-slice graph
#                                 (its compile alone takes ~200 s)
import os
import math, sys, json, time
import torch
import torch.nn.functional as F

torch.backends.cuda.matmul.allow_tf32 = False
dev = "cuda"
B, H, N, D = [int(x) for x in (sys.argv[1:5] if len(sys.argv) > 4 else (8, 32, 2048, 128))]
results = []


def sdpa_sliced(q, k, v, with_slice):
    bh = q.shape[0] * q.shape[1] if with_slice else 1
    scale = 1 / math.sqrt(q.size(-1))
    Q, K, V = (torch.flatten(t, end_dim=1) for t in (q, k, v))
    outs = []
    for Qi, Ki, Vi in zip(torch.tensor_split(Q, bh), torch.tensor_split(K, bh), torch.tensor_split(V, bh)):
        S = torch.matmul(Qi, Ki.transpose(-2, -1)) * scale
        P = F.softmax(S, dim=-1)
        outs.append(torch.matmul(P, Vi))
    return torch.cat(outs).reshape(q.shape[0], q.shape[1], v.shape[2], v.shape[3])


def measure(name, fn, dtype, reps=10):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, N, D, device=dev, dtype=dtype)

    def step():
        out = fn(q, k, v)
        out.backward(g)
        q.grad = k.grad = v.grad = None
    try:
        t0 = time.perf_counter()
        step()  # warm-up / compile
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        ts = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); step(); e.record(); torch.cuda.synchronize()
            ts.append(s.elapsed_time(e))
        ts.sort()
        io = 4 * q.numel() * q.element_size()  # output + three gradients
        r = dict(scenario=name, dtype=str(dtype).split('.')[-1], peak_mb=round(peak / 2**20, 1),
                 working_mb=round((peak - io) / 2**20, 1),
                 ms_median=round(ts[len(ts) // 2], 3), first_call_s=round(first, 2))
    except Exception as ex:  # OOM etc.
        r = dict(scenario=name, dtype=str(dtype).split('.')[-1], error=repr(ex)[:200])
    torch.cuda.empty_cache()
    results.append(r)
    print(json.dumps(r), flush=True)


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
for dtype in [DTYPES[d] for d in os.environ.get("ANCHOR_DTYPES", "bf16,fp32").split(",")]:
    measure("naive eager", lambda q, k, v: sdpa_sliced(q, k, v, False), dtype)
    measure("sliced eager", lambda q, k, v: sdpa_sliced(q, k, v, True), dtype, reps=3)
    torch._dynamo.reset()
    if os.environ.get("ANCHOR_SKIP_SLICED_COMPILE") != "1":
        comp = torch.compile(lambda q, k, v: sdpa_sliced(q, k, v, True))
        measure("sliced graph (torch.compile)", comp, dtype, reps=5)
    torch._dynamo.reset()
    compn = torch.compile(lambda q, k, v: sdpa_sliced(q, k, v, False))
    measure("naive graph (torch.compile)", compn, dtype)
    measure("F.scaled_dot_product_attention", lambda q, k, v: F.scaled_dot_product_attention(q, k, v), dtype)
    torch._dynamo.reset()

flops_fwd = 4 * B * H * N * N * D
print("attention fwd GFLOP", flops_fwd / 1e9, "fwd+bwd GFLOP (3.5x)", 3.5 * flops_fwd / 1e9)
print(json.dumps(results))
