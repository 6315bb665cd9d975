#!/usr/bin/env python3
"""Checks and times tessera's CUDA flash attention kernels on a GPU machine.

Compiles crates/tessera-cuda/kernels/flash_attention.cu with NVRTC (through CuPy),
launches the kernels on torch tensors and compares them with
  * an f64 reference (torch on the GPU in float64, math written out) on small shapes:
    bf16/f16/f32, head dims 64 and 128 (f32 also 32..256), causal and not, odd lengths,
    q_len != kv_len, every kernel configuration the .cu instantiates;
  * torch's own SDPA at (8, 32, 2048, 128) bf16 (and f64 on one batch of it);
and times forward+backward at (8, 32, 2048, 128) bf16 next to
torch.nn.functional.scaled_dot_product_attention forward+backward in the same run
(CUDA events, warm-up, median of --reps), then one (1, 1, 2048, 128) slice with the
split kernels (key tiles of the forward spread over blockIdx.z, query tiles of the
backward over several blocks) at several split counts. The wgmma backward's
configurations (BWD_CFGS) include the Rust launcher's own plan ("plan": groups of batch x
heads and the split of each launch's last-wave items, scripts/flash_bwd_plan.py).

Tolerances (relative Frobenius error against f64):
  f32: 1e-4 for out, lse and gradients (CUDA-core f32; lands near 1e-6)
  f16: 5e-3  bf16: 2e-2 (P and dS are rounded to the input type before the
  tensor-core products, as in FlashAttention-2; torch's SDPA errors are printed beside)
Every output is poisoned with NaN before each launch; a NaN left behind fails.

Usage: python3 scripts/flash_cuda_check.py [--cu PATH] [--out DIR] [--sanitize] [--quick]
"""
import argparse
import json
import math
import os
import sys
import time

import cupy as cp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flash_bwd_plan  # noqa: E402  (the Rust launcher's backward plan)
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CU = os.path.join(HERE, "..", "crates", "tessera-cuda", "kernels", "flash_attention.cu")

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
TN = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
# Configurations the .cu instantiates: fwd (warps, key tile), bwd (warps, query tile) for
# the mma.sync kernels; ("g4", 64) and ("wg", 64) for the sm_90a wgmma kernels
# (4 warpgroups of 64 query rows; the wgmma backward has 2 warpgroups x 64 keys).
# "ring"/"ringt": the forward whose K/V tiles go through a 4-stage mbarrier ring (ringt:
# its warpgroups also take turns issuing their products, see turn_wait in the .cu).
# (The "turns" variants of g4 and of the backward, 1.76 / 4.48 ms, were dropped: docs/perf/cuda-flash.md.)
FWD_CFGS = {64: [(4, 64)], 128: [("g4", 64), ("ring", 64), ("ringt", 64), (4, 64), ("split", 3)]}
# (The backward's ring variants of session 4 -- with S and dP waited separately, with
# the dQ product deferred to the next iteration -- were dropped: docs/perf/cuda-flash.md.)
# wgmma backward: ("wg", s) every item split s ways (s = 1: none); ("wg", s, t) the last
# t items split s ways; ("plan",) the Rust launcher's groups and splits for this GPU's SM
# count (scripts/flash_bwd_plan.py); ("grp", g) groups of g, nothing split (the launcher
# before session 6).
BWD_CFGS = {64: [(8, 64)], 128: [("plan",), ("wg", 1), ("wg", 3), ("wg", 3, 2), ("wg", 16, 5),
                                 (8, 32)]}
SMS = None  # set in main()
F32_DIMS = [32, 64, 96, 128, 160, 192, 224, 256]
LOG2E = 1.4426950408889634
PRE_ROWS = 64  # query rows per block of the bf16/f16 pre-kernel (PRE_ROWS in the .cu)


def log(*a):
    print(*a, flush=True)


class Flash:
    """Launches the kernels of one compiled module on torch tensors."""

    def __init__(self, src):
        t0 = time.perf_counter()
        self.mod = cp.RawModule(code=src, options=("-arch=sm_90a", "-std=c++17",
                                                   "-I/usr/local/cuda/include"))
        self.mod.compile()
        self.compile_s = time.perf_counter() - t0
        self.fns = {}

    def fn(self, name, smem):
        f = self.fns.get(name)
        if f is None:
            f = self.mod.get_function(name)
            self.fns[name] = f
        if smem > 48 * 1024 and f.max_dynamic_shared_size_bytes < smem:
            f.max_dynamic_shared_size_bytes = smem
        return f

    @staticmethod
    def p(t):
        return np.uint64(t.data_ptr())

    def fwd(self, q, k, v, causal, scale, cfg=None, out=None, lse=None, part=None):
        B, H, nq, D = q.shape
        nk = k.shape[2]
        tn = TN[q.dtype]
        if out is None:
            out = torch.full_like(q, float("nan"))
            lse = torch.full((B, H, nq), float("nan"), device=q.device, dtype=torch.float32)
        sl = np.float32(scale * LOG2E)
        if tn == "f32":
            smem = (2 * 32 * (D + 1) + 8 * D) * 4
            grid = ((nq + 7) // 8, B * H)
            self.fn(f"flash_fwd_f32_d{D}", smem)(
                grid, (256,), (self.p(q), self.p(k), self.p(v), self.p(out), self.p(lse),
                               np.int32(nq), np.int32(nk), sl, np.int32(causal)), shared_mem=smem)
        else:
            w, bc = cfg or FWD_CFGS[D][0]
            if w == "split":  # wgmma g4 with the key tiles split over bc z blocks
                qt = (nq + 63) // 64
                if part is None:
                    part = (torch.full((bc * B * H * qt * 64 * D,), float("nan"), device=q.device),
                            torch.full((bc * B * H * nq * 2,), float("nan"), device=q.device))
                o_part, ml = part
                smem = (256 * D + 4 * 64 * D) * 2
                self.fn(f"flash_fwd_wg_split_{tn}_d{D}", smem)(
                    ((nq + 255) // 256, B * H, bc), (512,),
                    (self.p(q), self.p(k), self.p(v), self.p(o_part), self.p(ml),
                     np.int32(nq), np.int32(nk), sl, np.int32(causal)), shared_mem=smem)
                n4 = B * H * qt * 2048
                self.fn(f"flash_fwd_combine_{tn}_d{D}", 0)(
                    ((n4 + 255) // 256,), (256,),
                    (self.p(o_part), self.p(ml), self.p(out), self.p(lse), np.int32(bc),
                     np.int32(B * H), np.int32(nq)))
                return out, lse
            if w in ("ring", "ringt"):
                br, threads = 256, 512
                smem = (br * D + 8 * 64 * D) * 2 + 64
                name = f"flash_fwd_wg_{tn}_d{D}_ring" + ("_t" if w == "ringt" else "")
            elif isinstance(w, str):  # wgmma: w = "gN", N warpgroups of 64 rows
                br, threads = 64 * int(w[1:]), 128 * int(w[1:])
                smem = (br * D + 4 * bc * D) * 2
                name = f"flash_fwd_wg_{tn}_d{D}_{w}_c{bc}"
            else:
                br, threads = 16 * w, 32 * w
                smem = (16 * w * (D + 8) + 4 * bc * (D + 8)) * 2
                name = f"flash_fwd_{tn}_d{D}_w{w}_c{bc}"
            grid = ((nq + br - 1) // br, B * H)
            self.fn(name, smem)(
                grid, (threads,), (self.p(q), self.p(k), self.p(v), self.p(out), self.p(lse),
                                  np.int32(nq), np.int32(nk), sl, np.int32(causal)),
                shared_mem=smem)
        return out, lse

    def bwd(self, q, k, v, out, dout, lse, causal, scale, cfg=None, bufs=None):
        """cfg: a wgmma backward configuration (BWD_CFGS: ("plan",), ("wg", s[, t]),
        ("grp", g)) or (warps, query tile) for mma.sync."""
        B, H, nq, D = q.shape
        nk = k.shape[2]
        tn = TN[q.dtype]
        rows = B * H * nq
        cfg = cfg or (BWD_CFGS[D][0] if tn != "f32" else (None, 1))
        w, br = cfg[0], (cfg[1] if len(cfg) > 1 else None)
        wg = isinstance(w, str)
        qt = (nq + 63) // 64
        if wg:
            groups = self.bwd_groups(cfg, B * H, nq, nk, causal)
            acc_n = max(n * qt * 64 * D + (n * kb - whole) * (4 * 64 * D + 1) + 4
                        for _, n, kb, whole, _ in groups)
        else:
            acc_n = rows * D
        if bufs is None:
            dq = torch.full_like(q, float("nan"))
            dk = torch.full_like(k, float("nan"))
            dv = torch.full_like(v, float("nan"))
            delta = torch.full((B, H, nq), float("nan"), device=q.device, dtype=torch.float32)
            ws = None if tn == "f32" else torch.full((acc_n,), float("nan"), device=q.device,
                                                     dtype=torch.float32)
        else:
            dq, dk, dv, delta, ws = bufs
            assert tn == "f32" or ws.numel() >= acc_n
        s, sl = np.float32(scale), np.float32(scale * LOG2E)
        if tn == "f32":
            self.fn(f"flash_bwd_pre_f32_d{D}", 0)(
                ((rows + 7) // 8,), (256,), (self.p(out), self.p(dout), self.p(delta),
                                             np.int64(rows)))
            smem = (2 * 32 * (D + 1) + 16 * D) * 4
            self.fn(f"flash_bwd_dq_f32_d{D}", smem)(
                ((nq + 7) // 8, B * H), (256,),
                (self.p(q), self.p(k), self.p(v), self.p(dout), self.p(lse), self.p(delta),
                 self.p(dq), np.int32(nq), np.int32(nk), s, sl, np.int32(causal)), shared_mem=smem)
            smem = (2 * 32 * (D + 1) + 16 * D + 64) * 4
            self.fn(f"flash_bwd_dkv_f32_d{D}", smem)(
                ((nk + 7) // 8, B * H), (256,),
                (self.p(q), self.p(k), self.p(v), self.p(dout), self.p(lse), self.p(delta),
                 self.p(dk), self.p(dv), np.int32(nq), np.int32(nk), s, sl, np.int32(causal)),
                shared_mem=smem)
            return dq, dk, dv
        if wg:
            for g in groups:
                self.bwd_wg_group(q, k, v, out, dout, lse, delta, dq, dk, dv, ws, causal, s, sl, g)
            return dq, dk, dv
        self.fn(f"flash_bwd_pre_{tn}_d{D}", 0)(
            ((rows + PRE_ROWS - 1) // PRE_ROWS,), (256,), (self.p(out), self.p(dout), self.p(delta),
                                         self.p(ws), np.int64(acc_n // 4), np.int64(rows)))
        bc, threads = 16 * w, 32 * w
        smem = (2 * bc * (D + 8) + 4 * br * (D + 8) + bc * (br + 8)) * 2 + 16 * br
        name = f"flash_bwd_{tn}_d{D}_w{w}_r{br}"
        nblk = (nk + bc - 1) // bc
        if nk > 0:
            self.fn(name, smem)(
                (nblk, B * H), (threads,),
                (self.p(q), self.p(k), self.p(v), self.p(dout), self.p(lse), self.p(delta),
                 self.p(ws), self.p(dk), self.p(dv), np.int32(nq), np.int32(nk), s, sl,
                 np.int32(causal)), shared_mem=smem)
        n = rows * D
        self.fn(f"flash_bwd_post_{tn}", 0)(
            ((n // 4 + 255) // 256,), (256,), (self.p(ws), self.p(dq), np.int64(n), s))
        return dq, dk, dv


def bwd_groups(cfg, bh, nq, nk, causal):
    """The wgmma backward's launch groups for cfg: (first bh, bh count, key blocks per bh,
    whole items, splits)."""
    kb = (nk + 127) // 128
    if cfg[0] == "plan":  # ("plan", mb): with mb MB of accumulator budget instead of 32
        # The launcher's groups and splits, here on one stream and workspace (the
        # launcher alternates them over flash_bwd_plan.LANES streams: not mirrored).
        acc = (cfg[1] if len(cfg) > 1 else 32) << 20
        _, groups = flash_bwd_plan.plan(bh, nq, nk, SMS, causal, acc)
        return [(f, n, kb, whole, s) for f, n, (_, whole, s) in groups]
    if cfg[0] in ("grp", "grps"):  # ("grps", g, t, s): the last t items of each split s ways
        g = cfg[1]
    else:
        s = cfg[1]
        items = kb * bh
        t = items if s > 1 and len(cfg) < 3 else (min(cfg[2], items) if s > 1 else 0)
        return [(0, bh, kb, items - t, s)]
    out = []
    for first in range(0, bh, g):
        n = min(g, bh - first)
        if cfg[0] == "grps":
            whole, s = n * kb - min(cfg[2], n * kb), cfg[3]
        else:
            whole, s = n * kb, 1
        out.append((first, n, kb, whole, s))
    return out


Flash.bwd_groups = staticmethod(bwd_groups)


def bwd_wg_group(self, q, k, v, out, dout, lse, delta, dq, dk, dv, ws, causal, s, sl, group):
    """Pre, main and post kernel of the wgmma backward for one launch group, as the Rust
    launcher's enqueue_backward queues them."""
    first, n, kb, whole, splits = group
    _, _, nq, D = q.shape
    nk = k.shape[2]
    tn = TN[q.dtype]
    qt = (nq + 63) // 64
    es = q.element_size()
    at = lambda t, per: np.uint64(t.data_ptr() + first * per)
    qr, kr = nq * D * es, nk * D * es
    rows = n * nq
    split_items = n * kb - whole
    dq_n, kv_n = n * qt * 64 * D, split_items * 4 * 64 * D
    zero_n4 = (dq_n + kv_n + (split_items * 4 + 15) // 16 * 4) // 4
    base = ws.data_ptr()
    dq_acc, kv_acc = np.uint64(base), np.uint64(base + 4 * dq_n)
    counters = np.uint64(base + 4 * (dq_n + kv_n))
    self.fn(f"flash_bwd_pre_{tn}_d{D}", 0)(
        ((rows + PRE_ROWS - 1) // PRE_ROWS,), (256,),
        (at(out, qr), at(dout, qr), at(delta, nq * 4), dq_acc, np.int64(zero_n4), np.int64(rows)))
    smem = (2 * 128 * D + 6 * 64 * D + 2 * 128 * 64) * 2 + 6 * 64 * 4 + 5 * 8
    if nk > 0:
        self.fn(f"flash_bwd_wg_{tn}_d{D}", smem)(
            (whole + split_items * splits,), (256,),
            (at(q, qr), at(k, kr), at(v, kr), at(dout, qr), at(lse, nq * 4), at(delta, nq * 4),
             dq_acc, at(dk, kr), at(dv, kr), kv_acc, counters, np.int32(nq), np.int32(nk), s, sl,
             np.int32(causal), np.int32(whole), np.int32(splits)), shared_mem=smem)
    self.fn(f"flash_bwd_post_wg_{tn}", 0)(
        (n * qt,), (256,), (dq_acc, at(dq, qr), np.int32(nq), s))


Flash.bwd_wg_group = bwd_wg_group


def reference(q, k, v, dout, causal, scale):
    """f64 attention written out (top-left causal like PyTorch), with gradients."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = (q64 @ k64.transpose(-1, -2)) * scale
    if causal:
        nq, nk = s.shape[-2:]
        keep = torch.ones(nq, nk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ v64
    o.backward(dout.double())
    return o.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def rel(x, ref):
    x = x.double()
    if not torch.isfinite(x).all():
        return float("nan")
    den = ref.norm().item()
    return (x - ref).norm().item() / (den if den > 0 else 1.0)


def check_case(fl, dtype, shape, causal, scale, fcfg=None, bcfg=None, failures=None):
    B, H, nq, nk, D = shape
    g = torch.Generator(device="cuda").manual_seed(hash((shape, causal, str(dtype))) % 2**31)
    mk = lambda n: torch.randn(B, H, n, D, device="cuda", dtype=torch.float32, generator=g).to(dtype)
    q, k, v, dout = mk(nq), mk(nk), mk(nk), mk(nq)
    out, lse = fl.fwd(q, k, v, causal, scale, fcfg)
    dq, dk, dv = fl.bwd(q, k, v, out, dout, lse, causal, scale, bcfg)
    torch.cuda.synchronize()
    ro, rl, rq, rk, rv = reference(q, k, v, dout, causal, scale)
    errs = dict(out=rel(out, ro), lse=rel(lse, rl), dq=rel(dq, rq), dk=rel(dk, rk), dv=rel(dv, rv))
    tol = TOL[dtype]
    ok = all(e == e and e <= tol for e in errs.values())
    tag = f"{TN[dtype]:4s} B{B} H{H} nq{nq} nk{nk} D{D} causal={int(causal)} scale={scale:.4f} fwd{fcfg} bwd{bcfg}"
    log(("ok  " if ok else "FAIL") + " " + tag + " " +
        " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    if not ok and failures is not None:
        failures.append(tag)
    return errs


def small_checks(fl, quick=False):
    failures = []
    # Cross-check the reference's causal convention against torch's own SDPA (f64).
    q = torch.randn(1, 2, 37, 16, device="cuda", dtype=torch.float64)
    k = torch.randn(1, 2, 53, 16, device="cuda", dtype=torch.float64)
    v = torch.randn(1, 2, 53, 16, device="cuda", dtype=torch.float64)
    for c in (False, True):
        for (a, b) in ((q, k), (k, q)):
            vv = v if b is k else torch.randn(1, 2, 37, 16, device="cuda", dtype=torch.float64)
            t = F.scaled_dot_product_attention(a, b, vv, is_causal=c)
            r = reference(a, b, vv, torch.zeros_like(t), c, 1 / 4)[0]
            e = rel(t, r)
            log(f"reference vs torch SDPA f64 causal={c} nq={a.shape[2]} nk={b.shape[2]}: {e:.1e}")
            if not e < 1e-12:
                failures.append("reference convention")
    shapes = [(2, 3, 128, 128), (1, 2, 77, 77), (2, 2, 130, 61), (1, 3, 45, 200),
              (1, 1, 1, 1), (1, 2, 200, 333), (1, 1, 64, 1), (1, 2, 300, 129)]
    if quick:
        shapes = shapes[:3]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for D in (64, 128):
            for (B, H, nq, nk) in shapes:
                for causal in (False, True):
                    check_case(fl, dtype, (B, H, nq, nk, D), causal, 1 / math.sqrt(D),
                               failures=failures)
            if dtype != torch.float32:
                # Every configuration, on shapes with ragged tails both ways.
                for fc in FWD_CFGS[D]:
                    for bc in BWD_CFGS[D]:
                        for causal in (False, True):
                            for shp in ((1, 2, 200, 333, D), (2, 1, 333, 150, D)):
                                check_case(fl, dtype, shp, causal, 0.3, fc, bc, failures)
    for D in F32_DIMS:
        if D in (64, 128):
            continue
        for causal in (False, True):
            check_case(fl, torch.float32, (1, 2, 70, 45, D), causal, 1 / math.sqrt(D),
                       failures=failures)
    return failures


def large_checks(fl, failures):
    """(8, 32, 2048, 128) bf16 against torch SDPA bf16, and one batch of it against f64."""
    B, H, N, D = 8, 32, 2048, 128
    scale = 1 / math.sqrt(D)
    torch.manual_seed(1)
    q, k, v, dout = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for causal in (False, True):
        out, lse = fl.fwd(q, k, v, causal, scale)
        dq, dk, dv = fl.bwd(q, k, v, out, dout, lse, causal, scale)
        qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))
        ot = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        ot.backward(dout)
        torch.cuda.synchronize()
        e = dict(out=rel(out, ot.double()), dq=rel(dq, qt.grad.double()),
                 dk=rel(dk, kt.grad.double()), dv=rel(dv, vt.grad.double()))
        ok = all(x == x and x <= 2e-2 for x in e.values())
        log(("ok  " if ok else "FAIL") + f" large bf16 vs torch SDPA bf16 causal={causal} " +
            " ".join(f"{n}={x:.2e}" for n, x in e.items()))
        if not ok:
            failures.append(f"large causal={causal}")
        # f64 on batch 0 (32 heads): tessera's error next to torch's.
        ro, rl, rq, rk, rv = reference(q[:1], k[:1], v[:1], dout[:1], causal, scale)
        ours = dict(out=rel(out[:1], ro), lse=rel(lse[:1], rl), dq=rel(dq[:1], rq),
                    dk=rel(dk[:1], rk), dv=rel(dv[:1], rv))
        theirs = dict(out=rel(ot[:1].detach(), ro), dq=rel(qt.grad[:1], rq),
                      dk=rel(kt.grad[:1], rk), dv=rel(vt.grad[:1], rv))
        ok = all(x == x and x <= 2e-2 for x in ours.values())
        log(("ok  " if ok else "FAIL") + f" large batch0 vs f64 causal={causal} tessera: " +
            " ".join(f"{n}={x:.2e}" for n, x in ours.items()) + " | torch: " +
            " ".join(f"{n}={x:.2e}" for n, x in theirs.items()))
        if not ok:
            failures.append(f"large f64 causal={causal}")
        del ro, rl, rq, rk, rv
        torch.cuda.empty_cache()


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


def timings(fl, reps, results):
    B, H, N, D = 8, 32, 2048, 128
    scale = 1 / math.sqrt(D)
    flops = 3.5 * 4 * B * H * N * N * D
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out = torch.empty_like(q)
    lse = torch.empty(B, H, N, device="cuda", dtype=torch.float32)
    bufs = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty(B, H, N, device="cuda", dtype=torch.float32),
            torch.empty(3 * B * H * N * D, device="cuda", dtype=torch.float32))

    qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))

    def torch_step(causal):
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        o.backward(dout)
        qt.grad = kt.grad = vt.grad = None

    for causal in (False, True):
        fdiv = 2 if causal else 1
        t_torch = [median_ms(lambda: torch_step(causal), reps) for _ in range(2)]
        log(f"torch SDPA fwd+bwd causal={causal}: {t_torch[0]:.3f} / {t_torch[1]:.3f} ms "
            f"({flops / fdiv / t_torch[0] / 1e9:.0f} TFLOP/s)")
        results.append(dict(what="torch_sdpa", causal=causal, ms=t_torch))
        # torch's forward (autograd on, so it keeps its logsumexp like tessera's) and its
        # backward alone, to say which half of tessera's step is behind.
        t_tf = median_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), reps)
        o_keep = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        t_tb = median_ms(lambda: torch.autograd.grad(o_keep, (qt, kt, vt), dout, retain_graph=True),
                         reps)
        del o_keep
        log(f"torch SDPA fwd alone causal={causal}: {t_tf:.3f} ms, bwd alone: {t_tb:.3f} ms")
        results.append(dict(what="torch_sdpa_parts", causal=causal, fwd_ms=t_tf, bwd_ms=t_tb))
        # Each forward and each backward configuration alone, then the best pair together.
        # (The split configurations are for small batch x heads: timed in small_bh_timings.)
        t_fwd = {}
        for fc in (c for c in FWD_CFGS[D] if c[0] != "split"):
            t_fwd[fc] = median_ms(lambda: fl.fwd(q, k, v, causal, scale, fc, out, lse), reps)
            log(f"tessera fwd{fc} causal={causal}: {t_fwd[fc]:.3f} ms "
                f"({flops / 3.5 / fdiv / t_fwd[fc] / 1e9:.0f} TFLOP/s)")
        fl.fwd(q, k, v, causal, scale, None, out, lse)
        t_bwd = {}
        # One launch of 4096 items; the launcher's groups of 32 before session 6; its plan.
        for bc in (("wg", 1), ("wg", 16, 4), ("grp", 32), ("grp", 33), ("plan",),
                   ("grps", 33, 132, 2), ("grps", 33, 132, 4), ("grps", 33, 66, 2),
                   ("plan", 48), ("plan", 64), ("wg", 1), ("grp", 32), ("plan",)):
            t_bwd[bc] = median_ms(lambda: fl.bwd(q, k, v, out, dout, lse, causal, scale, bc, bufs), reps)
            log(f"tessera bwd{bc} causal={causal}: {t_bwd[bc]:.3f} ms "
                f"({flops * 2.5 / 3.5 / fdiv / t_bwd[bc] / 1e9:.0f} TFLOP/s)")
        if not causal:
            # The wgmma backward's two memory-bound launches alone (Delta + zeroing the dQ
            # workspace; workspace -> dQ), to say how much of its time is outside the
            # main kernel.
            rows, n4 = B * H * N, B * H * (N // 64) * 2048
            dq_, _, _, delta_, ws_ = bufs
            p = Flash.p
            pre = fl.fn(f"flash_bwd_pre_bf16_d{D}", 0)
            post = fl.fn("flash_bwd_post_wg_bf16", 0)
            t_pre = median_ms(lambda: pre(((rows + PRE_ROWS - 1) // PRE_ROWS,), (256,), (
                p(out), p(dout), p(delta_), p(ws_), np.int64(n4), np.int64(rows))), reps)
            t_post = median_ms(lambda: post((n4 // 2048,), (256,), (
                p(ws_), p(dq_), np.int32(N), np.float32(scale))), reps)
            log(f"tessera bwd parts: pre (Delta + zero) {t_pre:.3f} ms, post (dQ) {t_post:.3f} ms")
            results.append(dict(what="bwd_parts", pre_ms=t_pre, post_ms=t_post))
        fc = min(t_fwd, key=t_fwd.get)
        bc = min(t_bwd, key=t_bwd.get)
        # Before / after / before / after, so that drift between them shows.
        pairs = [(("ring", 64), ("grp", 32)), (("ring", 64), ("plan",))] * 2
        for pair in pairs:
            def step():
                fl.fwd(q, k, v, causal, scale, pair[0], out, lse)
                fl.bwd(q, k, v, out, dout, lse, causal, scale, pair[1], bufs)
            t_all = [median_ms(step, reps) for _ in range(2)]
            log(f"tessera fwd{pair[0]} bwd{pair[1]} causal={causal}: fwd+bwd {t_all[0]:.3f} / "
                f"{t_all[1]:.3f} ms ({flops / fdiv / t_all[0] / 1e9:.0f} TFLOP/s) "
                f"ratio to torch {t_all[0] / t_torch[0]:.2f}")
            results.append(dict(what="tessera", causal=causal, fwd_cfg=pair[0], bwd_cfg=pair[1],
                                ms=t_all, torch_ms=t_torch[0]))
        # Which backend torch's default is: each one timed on its own.
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                   SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel(be):
                    t_be = median_ms(lambda: torch_step(causal), reps)
                log(f"torch SDPA backend {be.name} fwd+bwd causal={causal}: {t_be:.3f} ms")
                results.append(dict(what=f"torch_{be.name}", causal=causal, ms=t_be))
            except Exception as ex:  # backend unavailable for this input
                log(f"torch SDPA backend {be.name}: {repr(ex)[:120]}")
        t_torch2 = median_ms(lambda: torch_step(causal), reps)
        log(f"torch SDPA fwd+bwd causal={causal} again: {t_torch2:.3f} ms")
        results.append(dict(what="torch_sdpa_again", causal=causal, ms=t_torch2))


def small_bh_timings(fl, reps, results):
    """One (1, 1, 2048, 128) bf16 slice, the shape of the hinted sliced graph's per-slice
    flash calls: each backward configuration (query splits fill more SMs) next to torch's
    SDPA at the same shape."""
    B, H, N, D = 1, 1, 2048, 128
    scale = 1 / math.sqrt(D)
    torch.manual_seed(2)
    q, k, v, dout = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out = torch.empty_like(q)
    lse = torch.empty(B, H, N, device="cuda", dtype=torch.float32)
    bufs = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty(B, H, N, device="cuda", dtype=torch.float32),
            torch.empty(5 * B * H * N * D, device="cuda", dtype=torch.float32))
    qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))

    def torch_step(causal):
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        o.backward(dout)
        qt.grad = kt.grad = vt.grad = None

    for causal in (False, True):
        t_torch = median_ms(lambda: torch_step(causal), reps)
        t_fwd = median_ms(lambda: fl.fwd(q, k, v, causal, scale, None, out, lse), reps)
        line = f"slice (1,1,2048,128) causal={causal}: torch SDPA fwd+bwd {t_torch:.4f} ms, tessera fwd {t_fwd:.4f}"
        part = (torch.empty(16 * N * D, device="cuda"), torch.empty(16 * N * 2, device="cuda"))
        for fc in [("split", 4), ("split", 8), ("split", 16)]:
            t = median_ms(lambda: fl.fwd(q, k, v, causal, scale, fc, out, lse, part), reps)
            line += f", fwd{fc} {t:.4f}"
            results.append(dict(what="slice_fwd", causal=causal, cfg=fc, ms=t))
        for bc in [("wg", 1), ("wg", 4), ("wg", 8), ("wg", 16), ("plan",)]:
            t = median_ms(lambda: fl.bwd(q, k, v, out, dout, lse, causal, scale, bc, bufs), reps)
            line += f", bwd{bc} {t:.4f}"
            results.append(dict(what="slice_bwd", causal=causal, cfg=bc, ms=t))
        results.append(dict(what="slice", causal=causal, torch_ms=t_torch, fwd_ms=t_fwd))
        log(line)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cu", default=DEFAULT_CU)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sanitize", action="store_true", help="tiny shapes only (for compute-sanitizer)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sanitize-dtypes", default="bf16,f16,f32",
                    help="dtypes the --sanitize run covers (racecheck is slow)")
    ap.add_argument("--profile", action="store_true", help="one fwd+bwd at (8, 32, 2048, 128)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-time", action="store_true")
    args = ap.parse_args()
    src = open(args.cu).read()
    log("device:", torch.cuda.get_device_name(), "torch", torch.__version__, "cupy", cp.__version__)
    fl = Flash(src)
    global SMS
    SMS = torch.cuda.get_device_properties(0).multi_processor_count
    log(f"SMs: {SMS}; backward plan at (8, 32, 2048, 128): groups of "
        f"{flash_bwd_plan.group(256, 2048, 2048, SMS)}")
    log(f"NVRTC compile of the module: {fl.compile_s:.1f} s")
    if args.profile:  # one forward and one backward at the benchmark shape, for ncu
        q, k, v, dout = (torch.randn(8, 32, 2048, 128, device="cuda", dtype=torch.bfloat16)
                         for _ in range(4))
        out, lse = fl.fwd(q, k, v, False, 128 ** -0.5)
        fl.bwd(q, k, v, out, dout, lse, False, 128 ** -0.5)
        torch.cuda.synchronize()
        return 0
    if args.sanitize:
        failures = []
        want = args.sanitize_dtypes.split(",")
        for dtype in (t for t in (torch.bfloat16, torch.float16, torch.float32) if TN[t] in want):
            for D in (64, 128):
                for causal in (False, True):
                    cfgs = BWD_CFGS[D] if dtype != torch.float32 else [None]
                    fcs = FWD_CFGS[D] if dtype != torch.float32 else [None]
                    for n, bc in enumerate(cfgs):
                        fc = fcs[n % len(fcs)]
                        check_case(fl, dtype, (1, 2, 70, 45, D), causal, 0.2, fc, bc, failures)
                        check_case(fl, dtype, (1, 1, 33, 150, D), causal, 0.2, fc, bc, failures)
        log("SANITIZE-RUN", "FAILURES: " + ", ".join(failures) if failures else "all ok")
        return 1 if failures else 0
    failures = small_checks(fl, args.quick)
    large_checks(fl, failures)
    results = []
    if not args.no_time:
        timings(fl, args.reps, results)
        small_bh_timings(fl, args.reps, results)
    if args.out:
        with open(os.path.join(args.out, "flash_results.json"), "w") as f:
            json.dump(dict(failures=failures, timings=results, device=torch.cuda.get_device_name()), f)
    log("SUMMARY:", "FAILURES: " + "; ".join(failures) if failures else "all checks ok")
    for r in results:
        log("  ", json.dumps(r))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
