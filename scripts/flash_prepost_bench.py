#!/usr/bin/env python3
"""Times the flash backward's two memory-bound launches -- the pre-kernel (Delta =
rowsum(dO * O), zeroing the f32 dQ workspace) and the post-kernel (fragment-tiled f32
workspace -> bf16 dQ) -- of two versions of kernels/flash_attention.cu side by side in
one process, at (8, 32, 2048, 128) bf16: the whole batch x heads in one launch (as the
harness's "bwd parts"), and as the Rust launcher runs it (8 groups of 32 batch x heads
reusing one 32 MB workspace). Also the zeroing alone through cudaMemsetAsync (torch's
zero_) and the pre-kernel without zeroing, as bandwidth references, and the grouped
sequence with each group's zeroing by cudaMemsetAsync before a Delta-only pre-kernel. Checks that both
versions give the same Delta and dQ (bitwise).

usage: python3 scripts/flash_prepost_bench.py OLD.cu NEW.cu [--reps 50]
"""
import argparse

import cupy as cp
import numpy as np
import torch

B, H, N, D = 8, 32, 2048, 128
GROUP = 32  # batch x heads per launch group of the Rust launcher up to session 5 (now 33 at the seed: flash_bwd_plan.group)


def median_ms(fn, reps, warmup=3):
    for _ in range(warmup):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return float(np.median([a.elapsed_time(b) for a, b in ev]))


def module(path):
    src = open(path).read()
    m = cp.RawModule(code=src, options=("-arch=sm_90a", "-std=c++17", "-I/usr/local/cuda/include",
                                        "-DTF_SKIP_F16", "-DTF_SKIP_F32"))
    m.compile()
    return m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    p = lambda t: np.uint64(t.data_ptr())
    torch.manual_seed(0)
    o, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rows, n4 = B * H * N, B * H * (N // 64) * 2048
    ws = torch.randn(n4 * 4, device="cuda", dtype=torch.float32)
    ws_keep = ws.clone()
    scale = np.float32(D ** -0.5)
    res = {}
    outs = {}
    for tag, path in (("old", a.old), ("new", a.new)):
        m = module(path)
        pre, post = m.get_function("flash_bwd_pre_bf16_d128"), m.get_function("flash_bwd_post_wg_bf16")
        per = 8 if tag == "old" else 64  # rows per block of the pre-kernel

        def pre_launch(r, o_, do_, delta_, ws_, zn4):
            pre(((r + per - 1) // per,), (256,), (o_, do_, delta_, ws_, np.int64(zn4), np.int64(r)))

        def post_launch(bh, ws_, dq_):
            t4 = bh * (N // 64) * 2048
            if tag == "old":
                post(((t4 + 255) // 256,), (256,), (ws_, dq_, np.int64(t4), np.int32(N), scale))
            else:
                post((t4 // 2048,), (256,), (ws_, dq_, np.int32(N), scale))

        delta = torch.full((rows,), float("nan"), device="cuda")
        dq = torch.full_like(o, float("nan"))
        ws.copy_(ws_keep)
        post_launch(B * H, p(ws), p(dq))
        pre_launch(rows, p(o), p(do), p(delta), p(ws), n4)
        torch.cuda.synchronize()
        assert float(ws.abs().max()) == 0.0, f"{tag}: workspace not zeroed"
        outs[tag] = (delta.clone(), dq.clone())
        res[tag, "pre"] = median_ms(lambda: pre_launch(rows, p(o), p(do), p(delta), p(ws), n4), a.reps)
        res[tag, "pre_nozero"] = median_ms(lambda: pre_launch(rows, p(o), p(do), p(delta), p(ws), 0), a.reps)
        res[tag, "post"] = median_ms(lambda: post_launch(B * H, p(ws), p(dq)), a.reps)
        g_rows, g_n4 = GROUP * N, GROUP * (N // 64) * 2048
        es = N * D * 2

        def groups(kind):
            for g in range(0, B * H, GROUP):
                if kind == "pre":
                    pre_launch(g_rows, p(o) + np.uint64(g * es), p(do) + np.uint64(g * es),
                               p(delta) + np.uint64(g * N * 4), p(ws), g_n4)
                else:
                    post_launch(GROUP, p(ws), p(dq) + np.uint64(g * es))
        def groups_memset():  # the zeroing by cudaMemsetAsync, then a Delta-only pre-kernel
            for g in range(0, B * H, GROUP):
                ws[:g_n4 * 4].zero_()
                pre_launch(g_rows, p(o) + np.uint64(g * es), p(do) + np.uint64(g * es),
                           p(delta) + np.uint64(g * N * 4), p(ws), 0)
        res[tag, "pre_groups"] = median_ms(lambda: groups("pre"), a.reps)
        res[tag, "memset_pre_groups"] = median_ms(groups_memset, a.reps)
        res[tag, "post_groups"] = median_ms(lambda: groups("post"), a.reps)
    res["memset", "zero_"] = median_ms(lambda: ws.zero_(), a.reps)
    same_delta = torch.equal(outs["old"][0], outs["new"][0])
    same_dq = torch.equal(outs["old"][1], outs["new"][1])
    close_delta = float((outs["old"][0] - outs["new"][0]).abs().max())
    print(f"Delta bitwise equal: {same_delta} (max diff {close_delta:.3g}); dQ bitwise equal: {same_dq}")
    gb = {"pre": (2 * rows * D * 2 + n4 * 16 + rows * 4), "pre_nozero": 2 * rows * D * 2 + rows * 4,
          "post": n4 * 16 + rows * D * 2, "zero_": n4 * 16}
    print("| kernel | old ms | new ms | new TB/s |")
    for k in ("pre", "pre_nozero", "post", "pre_groups", "memset_pre_groups", "post_groups"):
        base = k.replace("_groups", "").replace("memset_", "")
        tb = gb[base] / res["new", k] / 1e9
        print(f"| {k} | {res['old', k]:.4f} | {res['new', k]:.4f} | {tb:.2f} |")
    print(f"| zero_ (cudaMemsetAsync, {n4 * 16 / 1e6:.0f} MB) | {res['memset', 'zero_']:.4f} | | "
          f"{gb['zero_'] / res['memset', 'zero_'] / 1e9:.2f} |")
    return 0 if same_dq and close_delta < 1e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
