"""ATen's convolution and pooling ops to tessera's built-in CNN ops
(``tessera::conv2d``, ``tessera::max_pool2d``, … and their backward ops;
signatures and attributes in crates/tessera/src/ir/custom/conv.rs).

A call is a ``custom`` node (``op=`` the op's name, ``attrs=`` its
attributes as JSON text); a further output that something reads, the max
pool's indices, is a ``custom_output`` node of the call. tessera's verifier
checks each call against the FX node's types, as for every converter (the
last value emitted is declared with the node's type).

Layouts are NCHW, as PyTorch's. The max pool's indices are the flat
position in each input plane's ``H·W``, as PyTorch's, so the backward
takes indices from a forward that ran in either. Batch norm needs no
converter: it is decomposed into var_mean, rsqrt and elementwise ops while
AOTAutograd traces (``tessera.torch.DECOMPOSITIONS``); adaptive average
pooling to ``(1, 1)`` is a mean in PyTorch's core decompositions, and to
an output size that divides the input an average pool here.

What tessera's ops do not take is :class:`Unsupported` with the reason
(the node runs in PyTorch, logged): transposed convolutions, other ranks
than 2-D images (4-D tensors), integer dtypes, adaptive pools of windows
of varying size, symbolic channels or spatial sizes (a symbolic batch
stays symbolic).
"""

from __future__ import annotations

import json

import torch

from ._convert import TT, Unsupported, arg, converts, fmt_list, tir_dtype
from ._dims import concrete

aten = torch.ops.aten

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _attrs_text(attrs):
    """`attrs` as the text form spells a custom op's: a JSON string of JSON."""
    return json.dumps(json.dumps(attrs, sort_keys=True, separators=(",", ":")))


def _call(e, label, name, inputs, attrs, out):
    """One call of the custom op `name` declared with `out` (a TT): its value."""
    return e.line(label, "custom", inputs, [("op", json.dumps(name)), ("attrs", _attrs_text(attrs))],
                  out.dtype, list(out.shape))  # fmt: skip


def _output(e, label, call, index, out):
    """Output `index` (≥ 1) of the custom node `call`, of type `out`."""
    attrs = [("index", index), ("dtype", tir_dtype(out.dtype)), ("shape", fmt_list(out.shape))]
    return e.line(label, "custom_output", [call], attrs, out.dtype, list(out.shape))


def _image(v, what):
    """Checks that `v` is a 4-D float tensor whose dims other than the batch
    are concrete (tessera's CNN ops take only the batch symbolic)."""
    if len(v.shape) != 4:
        raise Unsupported(f"{what} of rank {len(v.shape)} (tessera's CNN ops take 4-D NCHW tensors)")
    if v.dtype not in FLOATS:
        raise Unsupported(f"{what} of dtype {v.dtype} (tessera's CNN ops take float tensors)")
    for d, name in zip(v.shape[1:], ("channels", "height", "width")):
        concrete(d, f"the {name} of {what}")


def _pair(value, what, default=None):
    """A 2-D geometry argument as two ints: one int (or a list of one) is
    used for both axes, an empty list is `default`."""
    if isinstance(value, int):
        value = [value]
    value = list(value)
    if not value and default is not None:
        return list(default)
    if len(value) == 1:
        value = value * 2
    if len(value) != 2 or not all(isinstance(v, int) for v in value):
        raise Unsupported(f"{what} {value} (expected two ints)")
    return value


def _hw(v):
    return [concrete(d, "a spatial size") for d in v.shape[2:]]


# -- convolution ----------------------------------------------------------------


def _conv_attrs(stride, padding, dilation, transposed, output_padding, groups):
    """tessera's `Conv2d` attributes of ATen's convolution arguments."""
    if transposed:
        raise Unsupported("a transposed convolution (tessera's conv2d takes the direct one)")
    if any(int(p) != 0 for p in output_padding):
        raise Unsupported(f"output_padding {list(output_padding)} of a direct convolution")
    ph, pw = _pair(padding, "padding")
    return {
        "stride": _pair(stride, "stride"),
        "padding": [ph, ph, pw, pw],  # top, bottom, left, right
        "dilation": _pair(dilation, "dilation"),
        "groups": int(groups),
        "activation": "none",
    }


@converts(aten.convolution.default)
def _convolution(e, node):
    x, w = e.val(node.args[0]), e.val(node.args[1])
    bias = node.args[2]
    _image(x, "convolution's input")
    _image(w, "convolution's weight")
    attrs = _conv_attrs(*node.args[3:9])
    inputs = [x, w] + ([e.val(bias)] if bias is not None else [])
    dtype, shape = e.out_type()
    if any(v.dtype != dtype for v in inputs):
        raise Unsupported(f"convolution of mixed dtypes {[str(v.dtype) for v in inputs]}")
    return _call(e, node.name, "tessera::conv2d", inputs, attrs, TT(dtype, shape))


@converts(aten.convolution_backward.default)
def _convolution_backward(e, node):
    # (grad_input, grad_weight, grad_bias) for the outputs `output_mask` asks.
    dy, x, w = (e.val(a) for a in node.args[:3])
    for v, what in ((dy, "convolution_backward's grad_output"), (x, "its input"), (w, "its weight")):
        _image(v, what)
    attrs = _conv_attrs(*node.args[4:10])
    mask = list(node.args[10])
    outs = e.meta(node)
    if any(v.dtype != dy.dtype for v in (x, w)):
        raise Unsupported(f"convolution_backward of mixed dtypes {[str(v.dtype) for v in (dy, x, w)]}")
    values = [None, None, None]
    if mask[0]:
        values[0] = _call(e, f"{node.name}_0", "tessera::conv2d_backward_input", [dy, w],
                          {**attrs, "input_hw": _hw(x)}, outs[0])  # fmt: skip
    if mask[1]:
        values[1] = _call(e, f"{node.name}_1", "tessera::conv2d_backward_weight", [x, dy],
                          {**attrs, "kernel_hw": _hw(w)}, outs[1])  # fmt: skip
    if mask[2]:
        values[2] = e.line(f"{node.name}_2", "sum", [e.cast(dy, outs[2].dtype)],
                           [("dims", "[0,2,3]"), ("keepdim", "false")], outs[2].dtype, list(outs[2].shape))  # fmt: skip
    return values


# -- pooling --------------------------------------------------------------------


def _pool_attrs(kernel, stride, padding, dilation=1, ceil_mode=False, count_include_pad=True, divisor_override=None):
    """tessera's `Pool2d` attributes of ATen's pooling arguments."""
    kernel = _pair(kernel, "kernel_size")
    return {
        "kernel": kernel,
        "stride": _pair(stride, "stride", default=kernel),
        "padding": _pair(padding, "padding"),
        "dilation": _pair(dilation, "dilation"),
        "ceil_mode": bool(ceil_mode),
        "count_include_pad": bool(count_include_pad),
        "divisor_override": None if divisor_override is None else int(divisor_override),
    }


def _max_pool_attrs(node, first):
    a = [arg(node, first + i, k, d) for i, (k, d) in enumerate(
        (("kernel_size", None), ("stride", []), ("padding", 0), ("dilation", 1), ("ceil_mode", False)))]  # fmt: skip
    return _pool_attrs(*a)


def _avg_pool_attrs(node, first):
    a = [arg(node, first + i, k, d) for i, (k, d) in enumerate(
        (("kernel_size", None), ("stride", []), ("padding", 0), ("ceil_mode", False),
         ("count_include_pad", True), ("divisor_override", None)))]  # fmt: skip
    kernel, stride, padding, ceil_mode, count_include_pad, divisor_override = a
    return _pool_attrs(kernel, stride, padding, 1, ceil_mode, count_include_pad, divisor_override)


@converts(aten.max_pool2d_with_indices.default)
def _max_pool2d(e, node):
    x = e.val(node.args[0])
    _image(x, "max_pool2d's input")
    y_t, idx_t = e.meta(node)
    y = _call(e, f"{node.name}_0", "tessera::max_pool2d", [x], _max_pool_attrs(node, 1), y_t)
    return [y, _output(e, f"{node.name}_1", y, 1, idx_t)]


@converts(aten.max_pool2d_with_indices_backward.default)
def _max_pool2d_backward(e, node):
    dy, x, idx = e.val(node.args[0]), e.val(node.args[1]), e.val(arg(node, 7, "indices"))
    _image(dy, "max_pool2d_with_indices_backward's grad_output")
    attrs = {**_max_pool_attrs(node, 2), "input_hw": _hw(x)}
    dtype, shape = e.out_type()
    return _call(e, node.name, "tessera::max_pool2d_backward", [dy, idx], attrs, TT(dtype, shape))


@converts(aten.avg_pool2d.default)
def _avg_pool2d(e, node):
    x = e.val(node.args[0])
    _image(x, "avg_pool2d's input")
    dtype, shape = e.out_type()
    return _call(e, node.name, "tessera::avg_pool2d", [x], _avg_pool_attrs(node, 1), TT(dtype, shape))


@converts(aten.avg_pool2d_backward.default)
def _avg_pool2d_backward(e, node):
    dy, x = e.val(node.args[0]), e.val(node.args[1])
    _image(dy, "avg_pool2d_backward's grad_output")
    attrs = {**_avg_pool_attrs(node, 2), "input_hw": _hw(x)}
    dtype, shape = e.out_type()
    return _call(e, node.name, "tessera::avg_pool2d_backward", [dy], attrs, TT(dtype, shape))


def _adaptive_attrs(x, out_hw):
    """An adaptive average pool whose output divides its input is an
    average pool of kernel = stride = input / output (PyTorch's windows
    are then exactly those); other sizes have windows of varying size,
    which tessera's pool does not take."""
    hw = _hw(x)
    out_hw = [concrete(d, "an adaptive pool's output size") for d in out_hw]
    if any(o <= 0 or i % o for i, o in zip(hw, out_hw)):
        raise Unsupported(f"an adaptive average pool from {hw} to {out_hw} (tessera's windows are all one "
                          "size: the output must divide the input)")  # fmt: skip
    kernel = [i // o for i, o in zip(hw, out_hw)]
    return _pool_attrs(kernel, kernel, 0)


@converts(aten._adaptive_avg_pool2d.default)
def _adaptive_avg_pool2d(e, node):
    x = e.val(node.args[0])
    _image(x, "adaptive_avg_pool2d's input")
    dtype, shape = e.out_type()
    return _call(e, node.name, "tessera::avg_pool2d", [x], _adaptive_attrs(x, shape[2:]), TT(dtype, shape))


@converts(aten._adaptive_avg_pool2d_backward.default)
def _adaptive_avg_pool2d_backward(e, node):
    dy, x = e.val(node.args[0]), e.val(node.args[1])
    _image(dy, "adaptive_avg_pool2d_backward's grad_output")
    attrs = {**_adaptive_attrs(x, dy.shape[2:]), "input_hw": _hw(x)}
    dtype, shape = e.out_type()
    return _call(e, node.name, "tessera::avg_pool2d_backward", [dy], attrs, TT(dtype, shape))
