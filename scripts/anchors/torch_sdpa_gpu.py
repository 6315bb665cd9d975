#!/usr/bin/env python3
"""PyTorch's F.scaled_dot_product_attention on the GPU at one shape: forward +
backward as the seed table's "F.scaled_dot_product_attention" row measures it
(torch_seed_table_gpu.py's step: forward, backward with a random gradient,
grads cleared), and the forward alone and the backward alone, so that a
tessera figure from the same call can be set next to each half.

CUDA events around each step, 3 warm-ups, median of --reps; the fwd+bwd
median is taken twice (first and last) to show the drift within one call.

usage: python3 scripts/anchors/torch_sdpa_gpu.py [B H N D] [--dtype bf16] [--causal] [--reps 20]
"""
import argparse
import json

import torch
import torch.nn.functional as F


def median_ms(fn, reps, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="*", type=int, default=[8, 32, 2048, 128])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    B, H, N, D = a.shape
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    g = torch.randn(B, H, N, D, device="cuda", dtype=dtype)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=a.causal)
        out.backward(g)
        q.grad = k.grad = v.grad = None

    first = median_ms(step, a.reps)
    fwd = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=a.causal), a.reps)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=a.causal)
    bwd = median_ms(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True), a.reps)
    last = median_ms(step, a.reps)
    print(json.dumps(dict(scenario="torch sdpa", device=torch.cuda.get_device_name(),
                          shape=[B, H, N, D], dtype=a.dtype, causal=a.causal,
                          fwd_bwd_ms=[round(first, 3), round(last, 3)],
                          fwd_ms=round(fwd, 3), bwd_ms=round(bwd, 3))), flush=True)


if __name__ == "__main__":
    main()
