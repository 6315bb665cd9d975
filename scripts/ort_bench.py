"""ONNX Runtime as the peer of `tessera run --bench`, shared by the export
scripts beside this file: on the CPU (intra-op threads = the machine's
cores) or, with ORT_DEVICE=cuda, on its CUDA execution provider (the GPU
machine has it), inputs and outputs bound in GPU memory as tessera's
`--device cuda` keeps them, so neither side's time has host copies."""

import os
import time

import numpy as np


def device():
    """`cpu` or `cuda` (ORT_DEVICE)."""
    d = os.environ.get("ORT_DEVICE", "cpu")
    if d not in ("cpu", "cuda"):
        raise SystemExit(f"ORT_DEVICE={d}: expected cpu or cuda")
    return d


def session(path):
    """An ONNX Runtime session on `device()`; on CUDA, an error (not a
    silent CPU fallback) when the CUDA provider is missing."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if device() == "cpu":
        opts.intra_op_num_threads = os.cpu_count()
        return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    sess = ort.InferenceSession(path, opts, providers=["CUDAExecutionProvider"])
    if sess.get_providers()[0] != "CUDAExecutionProvider":
        raise SystemExit(f"ONNX Runtime's CUDA provider did not load (providers: {sess.get_providers()})")
    return sess


def timed(sess, feed, warmup, runs):
    """The first output (as numpy) and the median latency in ms of `runs`
    runs after `warmup`."""
    if device() == "cuda":
        return _timed_cuda(sess, feed, warmup, runs)
    for _ in range(warmup):
        out = sess.run(None, feed)[0]
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = sess.run(None, feed)[0]
        times.append((time.perf_counter() - t0) * 1e3)
    return out, float(np.median(times))


def _timed_cuda(sess, feed, warmup, runs):
    import onnxruntime as ort

    binding = sess.io_binding()
    for name, value in feed.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, "cuda", 0))
    for out in sess.get_outputs():
        binding.bind_output(out.name, "cuda", 0)
    times = []
    for i in range(warmup + runs):
        binding.synchronize_inputs()
        t0 = time.perf_counter()
        sess.run_with_iobinding(binding)
        binding.synchronize_outputs()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return binding.copy_outputs_to_cpu()[0], float(np.median(times))
