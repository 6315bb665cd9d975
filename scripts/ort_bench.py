"""ONNX Runtime on the CPU as the peer of `tessera run --bench`: one session
(intra-op threads = the machine's cores) and a timed run, shared by the
export scripts beside this file."""

import os
import time

import numpy as np


def cpu_session(path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = os.cpu_count()
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def timed(sess, feed, warmup, runs):
    """The first output and the median latency in ms of `runs` runs after
    `warmup`."""
    for _ in range(warmup):
        out = sess.run(None, feed)[0]
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = sess.run(None, feed)[0]
        times.append((time.perf_counter() - t0) * 1e3)
    return out, float(np.median(times))
