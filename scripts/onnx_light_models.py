#!/usr/bin/env python3
"""The `onnx` package's `light/` models with random weights, run through
`tessera run` (compiled and --interpret) and compared with ONNX Runtime.

The shipped light models build every weight with ConstantOfShape (one
constant value per tensor), which hides most errors: a transposed kernel or
a wrong padding still gives the same number. Here each ConstantOfShape
becomes an initializer of random values, scaled by its role (He-scaled
conv and Gemm weights, batch-norm statistics near 1, small biases) so that
activations stay of order one through the network, and the input of the
final Softmax (the logits) is added as a second output, so that the
comparison sees values a saturated softmax would flatten.

For each model: the random model and input are written to OUT/<model>/,
ONNX Runtime (CPU, one thread per core) computes the reference, `tessera
run` computes the outputs compiled and interpreted, and each output must
satisfy |tessera − ort| <= RTOL·|ort| + ATOL·max|ort|. With --bench N both
are timed (median of N runs after a warm-up). Prints one line per model
and a Markdown table; exits non-zero when a model fails.

usage: onnx_light_models.py --tessera BIN [--models a,b,…] [--out DIR]
                            [--bench N] [--no-interpret] [--seed S]
"""

import argparse
import os
import re
import subprocess
import sys
import time

import numpy as np
import onnx
from onnx import helper, numpy_helper

RTOL = 1e-3
ATOL = 1e-4  # relative to the output's largest magnitude

MODELS = [
    "squeezenet",
    "shufflenet",
    "bvlc_alexnet",
    "zfnet512",
    "inception_v1",
    "inception_v2",
    "densenet121",
    "resnet50",
    "vgg19",
]


def light_dir():
    return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")


def consumers(graph):
    uses = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            uses.setdefault(name, []).append((node, i))
    return uses


def role_values(rng, shape, uses, graph_consumers):
    """Random values for a weight of `shape` read by `uses` [(node, input)]."""
    node, idx = uses[0] if uses else (None, -1)
    op = node.op_type if node is not None else ""
    n = int(np.prod(shape)) if len(shape) else 1
    if op == "Conv" and idx == 1:
        fan_in = int(np.prod(shape[1:]))
        return rng.normal(0.0, np.sqrt(2.0 / fan_in), shape)
    if op == "Gemm" and idx == 1:
        trans_b = any(a.name == "transB" and a.i == 1 for a in node.attribute)
        fan_in = shape[1] if trans_b else shape[0]
        return rng.normal(0.0, np.sqrt(1.0 / fan_in), shape)
    if op == "BatchNormalization":
        if idx in (1, 4):  # scale, variance
            return rng.uniform(0.5, 1.5, shape)
        return rng.normal(0.0, 0.1, shape)  # bias, mean
    if op in ("Mul",):  # the per-channel scale after a batch norm
        return rng.uniform(0.5, 1.5, shape)
    if op == "Unsqueeze":  # scale or bias reshaped for a Mul/Add
        out = node.output[0]
        nxt = graph_consumers.get(out, [])
        if nxt and nxt[0][0].op_type == "Mul":
            return rng.uniform(0.5, 1.5, shape)
        return rng.normal(0.0, 0.1, shape)
    del n
    return rng.normal(0.0, 0.1, shape)


def randomise(src, dst_model, rng):
    """The light model at `src` with random weights and the logits as an
    extra output; returns the model's data input (name, shape)."""
    model = onnx.load(src)
    g = model.graph
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    uses = consumers(g)
    keep = []
    new_inits = []
    for node in g.node:
        if node.op_type != "ConstantOfShape":
            keep.append(node)
            continue
        shape = [int(v) for v in inits[node.input[0]]]
        out = node.output[0]
        values = role_values(rng, shape, uses.get(out, []), uses).astype(np.float32)
        new_inits.append(numpy_helper.from_array(values, out))
    del g.node[:]
    g.node.extend(keep)
    g.initializer.extend(new_inits)
    # The shapes the ConstantOfShape nodes read are now unused.
    used = {name for n in g.node for name in n.input}
    dead = [t for t in g.initializer if t.name not in used]
    for t in dead:
        g.initializer.remove(t)
    dead_names = {t.name for t in dead}
    for i in [i for i in g.input if i.name in dead_names]:
        g.input.remove(i)
    # Graph inputs that only name initializers stay; the data input is the
    # one without an initializer.
    init_names = {t.name for t in g.initializer}
    data = [i for i in g.input if i.name not in init_names]
    # Declare the new initializers as inputs too when the model lists its
    # initializers among its inputs (IR version < 4).
    if model.ir_version < 4:
        for t in new_inits:
            g.input.append(helper.make_tensor_value_info(t.name, onnx.TensorProto.FLOAT, list(t.dims)))
    softmax = [n for n in g.node if n.op_type == "Softmax"]
    if softmax:
        logits = softmax[-1].input[0]
        if logits not in {o.name for o in g.output}:
            g.output.append(helper.make_empty_tensor_value_info(logits))
    # Outputs under file-safe names (`tessera run` writes DIR/<name>.npy):
    # an Identity to each.
    for o in g.output:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", o.name)
        if safe != o.name:
            g.node.append(helper.make_node("Identity", [o.name], [safe]))
            o.name = safe
    onnx.save(model, dst_model)
    (inp,) = data
    shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
    return inp.name, shape, [o.name for o in g.output]


def ort_session(path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = os.cpu_count() or 1
    opts.log_severity_level = 3
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def run_tessera(binary, model, name, npy, outdir, interpret, bench):
    cmd = [binary, "run", model, "--input", f"{name}={npy}", "--output-dir", outdir]
    if interpret:
        cmd.append("--interpret")
    if bench:
        cmd += ["--bench", str(bench)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    median = None
    m = re.search(r"median\s+([0-9.]+)\s*(ms|s|us|µs)", p.stdout + p.stderr)
    if m:
        scale = {"s": 1e3, "ms": 1.0, "us": 1e-3, "µs": 1e-3}[m.group(2)]
        median = float(m.group(1)) * scale
    return wall, median, p.stdout + p.stderr


def compare(got, want):
    if got.shape != want.shape:
        return f"shape {got.shape}, expected {want.shape}"
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    bound = RTOL * np.abs(want.astype(np.float64)) + ATOL * scale
    if not np.all(err <= bound):
        i = int(np.argmax(err - bound))
        return (
            f"element {i}: {got.flat[i]!r} vs {want.flat[i]!r} "
            f"(max abs error {err.max():.3g}, output scale {scale:.3g})"
        )
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tessera", required=True, help="the tessera binary")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tessera-onnx-light"))
    ap.add_argument("--bench", type=int, default=0, help="time N runs of each (tessera --bench N, ORT median of N)")
    ap.add_argument("--no-interpret", action="store_true", help="skip the interpreted run")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rows = []
    failed = []
    for short in [m for m in args.models.split(",") if m]:
        src = os.path.join(light_dir(), f"light_{short}.onnx")
        if not os.path.exists(src):
            print(f"{short}: not shipped by onnx {onnx.__version__} ({src})")
            failed.append(short)
            continue
        rng = np.random.default_rng(args.seed)
        work = os.path.join(args.out, short)
        os.makedirs(work, exist_ok=True)
        model_path = os.path.join(work, "model.onnx")
        name, shape, outputs = randomise(src, model_path, rng)
        x = rng.normal(0.0, 1.0, shape).astype(np.float32)
        npy = os.path.join(work, "input.npy")
        np.save(npy, x)
        sess = ort_session(model_path)
        ref = sess.run(outputs, {name: x})
        ort_ms = None
        if args.bench:
            times = []
            for _ in range(args.bench):
                t0 = time.perf_counter()
                sess.run(outputs, {name: x})
                times.append((time.perf_counter() - t0) * 1e3)
            ort_ms = float(np.median(times))
        modes = [("compiled", False)] + ([] if args.no_interpret else [("interpreted", True)])
        verdict = {}
        tessera_ms = None
        for mode, interpret in modes:
            outdir = os.path.join(work, mode)
            try:
                wall, median, _log = run_tessera(
                    args.tessera, model_path, name, npy, outdir, interpret, args.bench if not interpret else 0
                )
            except RuntimeError as e:
                verdict[mode] = f"error: {e}"
                continue
            if not interpret:
                tessera_ms = median
            problems = []
            for oname, want in zip(outputs, ref):
                fname = os.path.join(outdir, oname + ".npy")
                if not os.path.exists(fname):
                    cands = [f for f in os.listdir(outdir) if f.endswith(".npy")]
                    problems.append(f"no output file for {oname} (have {cands})")
                    continue
                msg = compare(np.load(fname), want)
                if msg:
                    problems.append(f"{oname}: {msg}")
            verdict[mode] = "; ".join(problems) if problems else "pass"
            verdict[mode + "_wall"] = wall
        ok = all(verdict.get(m) == "pass" for m, _ in modes)
        if not ok:
            failed.append(short)
        scales = ", ".join(f"{o} max|·| {float(np.max(np.abs(r))):.3g}" for o, r in zip(outputs, ref))
        line = f"{short}: {'PASS' if ok else 'FAIL'} ({scales})"
        for mode, _ in modes:
            line += f" | {mode}: {verdict.get(mode)} ({verdict.get(mode + '_wall', 0):.1f} s)"
        if args.bench:
            line += f" | tessera {tessera_ms} ms, ort {ort_ms:.2f} ms"
        print(line, flush=True)
        rows.append((short, ok, tessera_ms, ort_ms))
    if args.bench:
        print("\n| model | result | tessera compiled (ms) | ONNX Runtime (ms) | ratio |")
        print("|---|---|---|---|---|")
        for short, ok, t, o in rows:
            ratio = f"{t / o:.2f}" if t and o else "–"
            ts = f"{t:.2f}" if t else "–"
            print(f"| {short} | {'pass' if ok else 'FAIL'} | {ts} | {o:.2f} | {ratio} |")
    if failed:
        print(f"failed: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
