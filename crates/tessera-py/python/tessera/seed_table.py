"""``python -m tessera.seed_table``: the seed experiment from PyTorch code.

Runs the seed's own ``PySDPA``/``PySDPAHinted`` (:mod:`tessera.seed`) —
naive, sliced, sliced under ``torch.compile(backend="tessera")``, hinted —
and prints the table of ``tessera seed-table`` (working MB, ms, compile ms,
max |err| against an f64 reference, forward + backward), with the same
compiled scenarios under Inductor next to them.

Working MB is the peak of the step's allocations beyond its inputs, output
and gradients. PyTorch's allocations are read from its profiler's
allocation records on the CPU and from its CUDA allocator's peak on the
GPU; tessera's from its own allocator's peak (``tessera.memory_stats``, or
``cuda_memory_stats`` when tessera's CUDA backend runs the graphs). For
tessera rows the two are added: an upper bound, since the two peaks need
not coincide. Compile ms is the first
call's time less the median.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time

import torch
import torch.nn.functional as F

from . import _tessera
from . import torch as tessera_torch
from .seed import PySDPA, PySDPAHinted


def peak_torch_mb(step):
    """The peak of PyTorch's CPU allocations during `step`, from the
    profiler's raw allocation records in time order (each op's summed
    memory, which the anchor script walks, books the frees of a Python
    autograd Function at its start, which hides the peak)."""
    from torch.profiler import ProfilerActivity, profile

    saved = os.dup(2)
    try:
        # The profiler's own log lines would interleave with the table.
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                step()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    cur = peak = 0
    for e in sorted(records, key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak / 2**20


def peak_mb(step, device):
    """PyTorch's peak working memory during `step` plus tessera's (host
    memory on the CPU, tessera's GPU allocator on CUDA when its CUDA
    backend runs the graphs)."""
    on_gpu = device != "cpu" and _tessera.cuda_is_available()
    stats = _tessera.cuda_memory_stats if on_gpu else _tessera.memory_stats
    (_tessera.cuda_reset_peak_memory if on_gpu else _tessera.reset_peak_memory)()
    live0, _ = stats()
    if device == "cpu":
        peak = peak_torch_mb(step)
    else:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    _, tpeak = stats()
    return peak + max(tpeak - live0, 0) / 2**20


def reference(q, k, v, g):
    """Output and gradients in f64 by the naive formula."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    out = F.softmax(s, dim=-1) @ v
    out.backward(g.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def scenarios(with_inductor):
    naive = lambda q, k, v: PySDPA.apply(q, k, v, False, False)  # noqa: E731
    sliced = lambda q, k, v: PySDPA.apply(q, k, v, False, True)  # noqa: E731
    hinted = lambda q, k, v: PySDPAHinted.apply(q, k, v, False, True)  # noqa: E731
    plain = {"fuse_attention": False}
    rows = [
        ("naive eager", naive, None, None),
        ("sliced eager", sliced, None, None),
        ("sliced graph (tessera)", sliced, "tessera", plain),
        ("hinted sliced graph (tessera)", hinted, "tessera", plain),
        ("naive graph (tessera)", naive, "tessera", plain),
        ("fused attention (naive code, tessera)", naive, "tessera", None),
        ("hinted sliced graph + fused attention (tessera)", hinted, "tessera", None),
    ]
    if with_inductor:
        rows += [
            ("sliced graph (inductor)", sliced, "inductor", None),
            ("hinted sliced graph (inductor)", hinted, "inductor", None),
            ("naive graph (inductor)", naive, "inductor", None),
        ]
    rows.append(("F.scaled_dot_product_attention (eager)", F.scaled_dot_product_attention, None, None))
    return rows


def measure(name, fn, backend, options, shape, device, dtype, reps):
    torch.manual_seed(0)
    q, k, v = (torch.randn(*shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    g = torch.randn(*shape, device=device, dtype=dtype)
    ref = reference(q, k, v, g)
    if backend is not None:
        torch._dynamo.reset()
        tessera_torch.reset()
        kwargs = {"options": options} if options else {}
        fn = torch.compile(fn, backend=backend, **kwargs)
    result = {}

    def step():
        out = fn(q, k, v)
        out.backward(g)
        result["values"] = [out.detach(), q.grad, k.grad, v.grad]
        q.grad = k.grad = v.grad = None

    def timed():
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    try:
        first = timed()
        err = max((a.double() - b).abs().max().item() for a, b in zip(result["values"], ref))
        times = sorted(timed() for _ in range(reps))
    except Exception as e:  # a backend that cannot run the scenario
        return dict(scenario=name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:100]}")
    median = times[len(times) // 2]
    io = 4 * q.numel() * q.element_size() / 2**20
    peak = peak_mb(step, device)
    return dict(
        scenario=name,
        working_mb=round(peak - io, 1),
        ms_median=round(1e3 * median, 2),
        compile_ms=round(1e3 * max(first - median, 0), 1) if backend else 0.0,
        max_abs_err=err,
    )


def print_table(shape, dtype, reps, device, rows):
    b, h, n, d = shape
    print(
        f"seed experiment (PyTorch code): q, k, v = ({b}, {h}, {n}, {d}) {dtype}, {device}, "
        f"forward + backward, median of {reps} reps"
    )
    print(f"| {'scenario':<48} | {'working MB':>12} | {'ms':>10} | {'compile ms':>11} | {'max |err|':>11} |")
    print(f"|{'-' * 50}|{'-' * 14}|{'-' * 12}|{'-' * 13}|{'-' * 13}|")
    for r in rows:
        if "error" in r:
            print(f"| {r['scenario']:<48} | {'n/a: ' + r['error']}")
            continue
        print(
            f"| {r['scenario']:<48} | {r['working_mb']:>12.1f} | {r['ms_median']:>10.2f} | "
            f"{r['compile_ms']:>11.1f} | {r['max_abs_err']:>11.2e} |"
        )


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tessera.seed_table", description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="2,4,256,32", help="B,H,N,D of q, k and v (default 2,4,256,32)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="f32", choices=["f32", "f64"])
    p.add_argument("--no-inductor", action="store_true", help="skip the Inductor rows")
    p.add_argument("--only", help="only the scenarios whose name contains this text")
    p.add_argument("--json", action="store_true", help="one JSON object per scenario")
    args = p.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    if len(shape) != 4 or min(shape) < 1:
        p.error(f"--shape: expected four positive sizes B,H,N,D, got {args.shape!r}")
    dtype = {"f32": torch.float32, "f64": torch.float64}[args.dtype]
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for name, fn, backend, options in scenarios(not args.no_inductor):
        if args.only and args.only not in name:
            continue
        row = measure(name, fn, backend, options, shape, args.device, dtype, max(args.reps, 1))
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
    if not args.json:
        print_table(shape, args.dtype, args.reps, args.device, rows)


if __name__ == "__main__":
    main()
