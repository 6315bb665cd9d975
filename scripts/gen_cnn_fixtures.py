"""Generates crates/tessera/tests/fixtures/cnn.json: values and gradients of
the convolutional-network ops (conv, pooling, normalisation, pad,
interpolate), computed by PyTorch in float64 on small fixed random inputs
with odd shapes, strides, groups and dilation. `crates/tessera/tests/cnn_ops.rs`
runs the same calls through tessera's Tensor API and compares.

Each case stores its op and parameters, the inputs, a random cotangent
`cot` of the output's shape, the output, and the gradients of
`sum(f(inputs) * cot)` with respect to the inputs listed in `wrt`; batch
norm in training also stores the updated running statistics.

Run once; the output is committed. Re-run only when adding cases:
    python3 scripts/gen_cnn_fixtures.py
"""
import json
import os

import torch
import torch.nn.functional as F

torch.manual_seed(20261127)
torch.set_default_dtype(torch.float64)


def enc(t):
    """12 significant digits: the tests compare to 1e-9, and the file stays small."""
    t = t.detach()
    return {"shape": list(t.shape), "data": [float(f"{v:.12g}") for v in t.reshape(-1).tolist()]}


def randn(*shape):
    """Inputs with 3 decimals, which the JSON holds exactly as printed."""
    return torch.round(torch.randn(*shape), decimals=3)


def conv2d(p):
    def f(x, w, b=None):
        return F.conv2d(x, w, b, stride=p["stride"], padding=p["padding"], dilation=p["dilation"], groups=p["groups"])
    return f


def conv1d(p):
    def f(x, w, b=None):
        return F.conv1d(x, w, b, stride=p["stride"], padding=p["padding"], dilation=p["dilation"], groups=p["groups"])
    return f


def conv_transpose2d(p):
    def f(x, w, b=None):
        return F.conv_transpose2d(
            x, w, b, stride=p["stride"], padding=p["padding"], output_padding=p["output_padding"],
            groups=p["groups"], dilation=p["dilation"])
    return f


def max_pool2d(p):
    return lambda x: F.max_pool2d(x, p["kernel"], p["stride"], p["padding"], p["dilation"], p["ceil_mode"])


def avg_pool2d(p):
    return lambda x: F.avg_pool2d(x, p["kernel"], p["stride"], p["padding"], p["ceil_mode"],
                                  p["count_include_pad"], p["divisor_override"])


def adaptive_avg_pool2d(p):
    return lambda x: F.adaptive_avg_pool2d(x, p["size"])


def group_norm(p):
    return lambda x, w, b: F.group_norm(x, p["groups"], w, b, p["eps"])


def pad(p):
    return lambda x: F.pad(x, p["pad"], mode=p["mode"], value=p.get("value", 0.0)) if p["mode"] == "constant" \
        else F.pad(x, p["pad"], mode=p["mode"])


def interpolate(p):
    if p["mode"] == "nearest":
        return lambda x: F.interpolate(x, size=p["size"], mode="nearest")
    return lambda x: F.interpolate(x, size=p["size"], mode="bilinear", align_corners=p["align_corners"])


def lrn(p):
    return lambda x: F.local_response_norm(x, p["size"], p["alpha"], p["beta"], p["k"])


cases = {}


def case(name, op, params, make, inputs, wrt, extra=None):
    tensors = {k: v.clone().requires_grad_(k in wrt) for k, v in inputs.items()}
    out = make(params)(*tensors.values())
    cot = randn(*out.shape)
    (out * cot).sum().backward()
    entry = {
        "op": op,
        "params": params,
        "inputs": [dict(name=k, **enc(v)) for k, v in inputs.items()],
        "wrt": wrt,
        "cotangent": enc(cot),
        "output": enc(out),
        "grads": {k: enc(tensors[k].grad) for k in wrt},
    }
    if extra:
        entry.update(extra)
    cases[name] = entry


def conv_params(stride=1, padding=0, dilation=1, groups=1, **kw):
    pair = lambda v: list(v) if isinstance(v, (tuple, list)) else ([v, v] if not isinstance(v, str) else v)
    d = {"stride": pair(stride), "padding": pair(padding), "dilation": pair(dilation), "groups": groups}
    d.update(kw)
    return d


case("conv2d_basic", "conv2d", conv_params(padding=1), conv2d,
     {"x": randn(2, 3, 7, 6), "w": randn(4, 3, 3, 3), "b": randn(4)}, ["x", "w", "b"])
case("conv2d_strided_dilated_groups", "conv2d", conv_params((2, 1), (1, 2), (2, 1), 2), conv2d,
     {"x": randn(2, 4, 9, 8), "w": randn(6, 2, 3, 2), "b": randn(6)}, ["x", "w", "b"])
case("conv2d_depthwise", "conv2d", conv_params(2, 1, 1, 4), conv2d,
     {"x": randn(3, 4, 6, 5), "w": randn(4, 1, 3, 3)}, ["x", "w"])
case("conv2d_same_even_kernel", "conv2d", conv_params(1, "same", (1, 2)), conv2d,
     {"x": randn(1, 2, 5, 6), "w": randn(3, 2, 4, 2), "b": randn(3)}, ["x", "w", "b"])
case("conv2d_1x1", "conv2d", conv_params(), conv2d,
     {"x": randn(2, 5, 4, 3), "w": randn(3, 5, 1, 1), "b": randn(3)}, ["x", "w", "b"])
case("conv2d_1x1_strided", "conv2d", conv_params(2), conv2d,
     {"x": randn(2, 4, 5, 5), "w": randn(6, 4, 1, 1)}, ["x", "w"])
case("conv1d", "conv1d", {"stride": 2, "padding": 1, "dilation": 2, "groups": 1}, conv1d,
     {"x": randn(2, 3, 11), "w": randn(4, 3, 3), "b": randn(4)}, ["x", "w", "b"])
case("conv1d_same_groups", "conv1d", {"stride": 1, "padding": "same", "dilation": 1, "groups": 3}, conv1d,
     {"x": randn(2, 6, 7), "w": randn(3, 2, 4)}, ["x", "w"])
case("conv_transpose2d", "conv_transpose2d", conv_params(2, 1, output_padding=[1, 1]), conv_transpose2d,
     {"x": randn(2, 4, 3, 4), "w": randn(4, 3, 3, 3), "b": randn(3)}, ["x", "w", "b"])
case("conv_transpose2d_groups_dilated", "conv_transpose2d", conv_params(1, 0, 2, 2, output_padding=[0, 0]),
     conv_transpose2d, {"x": randn(1, 4, 3, 3), "w": randn(4, 1, 2, 2)}, ["x", "w"])


def pool_params(kernel, stride=None, padding=0, dilation=1, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    pair = lambda v: list(v) if isinstance(v, (tuple, list)) else [v, v]
    return {"kernel": pair(kernel), "stride": pair(stride if stride is not None else kernel),
            "padding": pair(padding), "dilation": pair(dilation), "ceil_mode": ceil_mode,
            "count_include_pad": count_include_pad, "divisor_override": divisor_override}


case("max_pool2d", "max_pool2d", pool_params(3, 2, 1), max_pool2d, {"x": randn(2, 3, 7, 6)}, ["x"])
case("max_pool2d_ceil_dilated", "max_pool2d", pool_params((2, 3), 2, (1, 1), 2, True), max_pool2d,
     {"x": randn(1, 2, 8, 7)}, ["x"])
case("avg_pool2d_pad", "avg_pool2d", pool_params(3, 2, 1), avg_pool2d, {"x": randn(2, 3, 7, 6)}, ["x"])
case("avg_pool2d_ceil_exclude_pad", "avg_pool2d", pool_params(3, 2, 1, ceil_mode=True, count_include_pad=False),
     avg_pool2d, {"x": randn(1, 2, 7, 5)}, ["x"])
case("avg_pool2d_divisor", "avg_pool2d", pool_params((2, 3), (1, 2), divisor_override=4), avg_pool2d,
     {"x": randn(1, 2, 5, 7)}, ["x"])
case("adaptive_avg_pool2d_uneven", "adaptive_avg_pool2d", {"size": [3, 2]}, adaptive_avg_pool2d,
     {"x": randn(2, 3, 7, 5)}, ["x"])
case("adaptive_avg_pool2d_global", "adaptive_avg_pool2d", {"size": [1, 1]}, adaptive_avg_pool2d,
     {"x": randn(2, 3, 4, 5)}, ["x"])
case("adaptive_avg_pool2d_divisible", "adaptive_avg_pool2d", {"size": [3, 2]}, adaptive_avg_pool2d,
     {"x": randn(1, 2, 6, 4)}, ["x"])

# Batch norm in training: the output, its gradients, and the running update.
x, w, b = randn(4, 3, 5, 4), randn(3), randn(3)
rm, rv = randn(3), torch.round(torch.rand(3), decimals=3) + 0.5
rm2, rv2 = rm.clone(), rv.clone()
case("batch_norm_train", "batch_norm", {"training": True, "momentum": 0.1, "eps": 1e-5},
     lambda p: (lambda x, w, b, rm_, rv_: F.batch_norm(x, rm2, rv2, w, b, True, p["momentum"], p["eps"])),
     {"x": x, "w": w, "b": b, "running_mean": rm, "running_var": rv}, ["x", "w", "b"])
# The backward ran once, the forward once: rm2/rv2 hold one update.
cases["batch_norm_train"]["new_running_mean"] = enc(rm2)
cases["batch_norm_train"]["new_running_var"] = enc(rv2)
case("batch_norm_eval", "batch_norm", {"training": False, "momentum": 0.1, "eps": 1e-3},
     lambda p: (lambda x, w, b, rm_, rv_: F.batch_norm(x, rm_, rv_, w, b, False, p["momentum"], p["eps"])),
     {"x": randn(2, 3, 4, 4), "w": randn(3), "b": randn(3), "running_mean": randn(3),
      "running_var": torch.round(torch.rand(3), decimals=3) + 0.5}, ["x", "w", "b"])
case("batch_norm_1d_train", "batch_norm", {"training": True, "momentum": 0.1, "eps": 1e-5},
     lambda p: (lambda x, w, b: F.batch_norm(x, None, None, w, b, True, p["momentum"], p["eps"])),
     {"x": randn(5, 3), "w": randn(3), "b": randn(3)}, ["x", "w", "b"])
case("group_norm", "group_norm", {"groups": 3, "eps": 1e-5}, group_norm,
     {"x": randn(2, 6, 3, 4), "w": randn(6), "b": randn(6)}, ["x", "w", "b"])
case("pad_constant", "pad", {"pad": [2, 1, 0, 3], "mode": "constant", "value": 0.5}, pad,
     {"x": randn(2, 3, 4, 5)}, ["x"])
case("pad_reflect", "pad", {"pad": [2, 1, 1, 2], "mode": "reflect"}, pad, {"x": randn(2, 3, 4, 5)}, ["x"])
case("pad_replicate", "pad", {"pad": [3, 0, 1, 2], "mode": "replicate"}, pad, {"x": randn(1, 2, 4, 5)}, ["x"])
case("interpolate_nearest_up", "interpolate", {"size": [7, 9], "mode": "nearest"}, interpolate,
     {"x": randn(2, 3, 5, 4)}, ["x"])
case("interpolate_nearest_down", "interpolate", {"size": [3, 2], "mode": "nearest"}, interpolate,
     {"x": randn(1, 2, 5, 7)}, ["x"])
case("interpolate_bilinear", "interpolate", {"size": [7, 6], "mode": "bilinear", "align_corners": False},
     interpolate, {"x": randn(2, 3, 5, 4)}, ["x"])
case("interpolate_bilinear_down", "interpolate", {"size": [3, 3], "mode": "bilinear", "align_corners": False},
     interpolate, {"x": randn(1, 2, 5, 7)}, ["x"])
case("interpolate_bilinear_align", "interpolate", {"size": [7, 3], "mode": "bilinear", "align_corners": True},
     interpolate, {"x": randn(1, 2, 4, 5)}, ["x"])
case("local_response_norm", "local_response_norm", {"size": 4, "alpha": 0.5, "beta": 0.75, "k": 1.0}, lrn,
     {"x": randn(2, 7, 3, 4)}, ["x"])

out = os.path.join(os.path.dirname(__file__), "..", "crates", "tessera", "tests", "fixtures", "cnn.json")
with open(out, "w") as f:
    json.dump(cases, f, separators=(",", ":"))
print(f"wrote {len(cases)} cases to {out}")
