"""ATen FX graphs to tessera's text IR (``.tir``, see docs/IR.md).

One converter per ATen op (``CONVERTERS``): it reads the FX node's
arguments and the node's concrete result type (dtype and shape) and emits
tessera ops through an :class:`Emitter`. The last op a converter emits is
declared with the FX node's own type, so tessera's verifier checks every
conversion: a wrong one is an error naming the node, the op and its line in
the generated text, never a silently wrong value.

Each line carries the FX node's call site (``# file.py:LINE:1``, from its
``stack_trace``) and the tessera hints attached to it
(``node.meta["custom"]["tessera_hints"]``, see :mod:`tessera._hints`).
"""

from __future__ import annotations

import collections
import json
import math
import operator
import re

import torch

from ._dims import NotSymbolic, Unsupported, any_symbolic, broadcast, concrete, dim_of, dim_str, is_symbolic

aten = torch.ops.aten
prims = torch.ops.prims

DTYPES = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "bool",
}


class TT(collections.namedtuple("TT", ["dtype", "shape"])):
    """A tensor's type (dtype, shape of ints and symbolic dims, see
    :mod:`tessera._dims`): what converters read of a node's value."""


def tir_dtype(dtype):
    try:
        return DTYPES[dtype]
    except KeyError:
        raise Unsupported(f"dtype {dtype} has no tessera dtype") from None


def type_str(dtype, shape):
    return f"{tir_dtype(dtype)}[{','.join(dim_str(d) for d in shape)}]"


def fmt_scalar(value, dtype):
    """A scalar in the text form, spelled for `dtype` (floats as floats)."""
    if dtype == torch.bool:
        return "true" if bool(value) else "false"
    if dtype.is_floating_point:
        v = float(value)
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    return str(int(value))


_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def call_site(node):
    """`file:line:1` of the user's line that made `node`, if known."""
    trace = node.meta.get("stack_trace") or ""
    found = _FILE_LINE.findall(trace)
    if not found:
        return None
    path, line = found[-1]
    if not path or path[0] in " \"" or path[-1] == " " or any(ord(c) < 32 for c in path):
        path = json.dumps(path)
    return f"{path}:{line}:1"


_backward_hints = {}


def node_hints(node, backward=False):
    """The node's hints as JSON text; in a backward graph, those a backward
    op inherits (tessera's `hints::for_backward`: `backward_group_id`
    becomes the `group_id`)."""
    from ._hints import hints_of

    h = hints_of(node.meta)
    if not h:
        return None
    if backward:
        if h not in _backward_hints:
            from ._tessera import backward_hints

            _backward_hints[h] = backward_hints(h)
        return _backward_hints[h]
    return h


def normalise_dim(dim, rank):
    d = int(dim)
    if d < 0:
        d += max(rank, 1)
    if not 0 <= d < max(rank, 1):
        raise Unsupported(f"dim {dim} out of range for rank {rank}")
    return d


def broadcast_shapes(*shapes):
    return broadcast(*shapes)


class Value:
    """A tessera value: its label, dtype and shape."""

    __slots__ = ("name", "dtype", "shape")

    def __init__(self, name, dtype, shape):
        self.name = name
        self.dtype = dtype
        self.shape = [dim_of(d) for d in shape]


class Emitter:
    """Writes one graph's lines; `types` gives each FX node's concrete value
    (a FakeTensor or a tuple of them)."""

    def __init__(self, name, types, backward=False):
        self.backward = backward
        self.graph_name = name
        self.types = types
        self.lines = []
        self.inputs = []
        self.values = {}  # fx node -> Value (or list of Value for tuples)
        self.count = 0
        self.node = None  # the FX node being converted

    # -- values -----------------------------------------------------------
    def fresh(self, base):
        self.count += 1
        return f"{base}__{self.count}"

    def meta(self, node):
        return self.types[node]

    def out_type(self):
        v = self.meta(self.node)
        if not isinstance(v, TT):
            raise Unsupported(f"its result is a {type(v).__name__}, not a tensor")
        return v.dtype, list(v.shape)

    def val(self, arg):
        if isinstance(arg, torch.fx.Node):
            v = self.values.get(arg)
            if v is None or isinstance(v, list):
                raise Unsupported(f"input {arg.name} is not a tessera tensor")
            return v
        raise Unsupported(f"expected a tensor argument, got {type(arg).__name__}")

    def line(self, label, op, inputs, attrs, dtype, shape, node=None):
        node = node if node is not None else self.node
        text = f"  %{label} = {op}"
        if inputs:
            text += "(" + ", ".join(f"%{v.name}" for v in inputs) + ")"
        if attrs:
            text += " {" + ", ".join(f"{k}={v}" for k, v in attrs) + "}"
        text += f" : {type_str(dtype, shape)}"
        if node is not None:
            h = node_hints(node, self.backward)
            if h:
                text += f"  hints={h}"
            site = call_site(node)
            if site:
                text += f"  # {site}"
        self.lines.append(text)
        return Value(label, dtype, shape)

    def op(self, op, inputs, attrs=(), dtype=None, shape=None, final=False):
        """Emits `op`; `final`: the node's own value, of its FX type."""
        if final:
            dtype, shape = self.out_type()
            label = self.node.name
        else:
            label = self.fresh(self.node.name)
        return self.line(label, op, inputs, list(attrs), dtype, shape)

    def scalar(self, value, dtype):
        return self.op(
            "full",
            [],
            [("value", fmt_scalar(value, dtype)), ("shape", "[]"), ("dtype", tir_dtype(dtype))],
            dtype,
            [],
        )

    def operand(self, arg, dtype):
        """A tensor argument (cast to `dtype`) or a Python scalar as a rank-0
        tensor of `dtype`."""
        if isinstance(arg, torch.fx.Node):
            return self.cast(self.val(arg), dtype)
        if isinstance(arg, (bool, int, float)):
            return self.scalar(arg, dtype)
        raise Unsupported(f"operand of type {type(arg).__name__}")

    def cast(self, v, dtype, final=False):
        if v.dtype == dtype and not final:
            return v
        return self.op("cast", [v], [("dtype", tir_dtype(dtype))], dtype, v.shape, final=final)

    def identity(self, v):
        """The node's value is `v` (a no-op such as detach)."""
        dtype, shape = self.out_type()
        if v.dtype != dtype or v.shape != [dim_of(d) for d in shape]:
            raise Unsupported(f"an identity from {type_str(v.dtype, v.shape)} to {type_str(dtype, shape)}")
        return v

    def text(self, outputs):
        header = f"graph {self.graph_name}(" + ", ".join(f"%{v.name}" for v in self.inputs) + ") {"
        ret = "  return " + ", ".join(f"%{v.name} as o{i}" for i, v in enumerate(outputs))
        return "\n".join([header, *self.lines, ret, "}"]) + "\n"


def arg(node, i, name, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


# -- converters -------------------------------------------------------------

CONVERTERS = {}


def converts(*targets):
    def register(fn):
        for t in targets:
            CONVERTERS[t] = fn
        return fn

    return register


def dims_list(dims, rank):
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({normalise_dim(d, rank) for d in dims})


def fmt_list(xs):
    return "[" + ",".join(dim_str(x) for x in xs) + "]"


UNARY = {
    aten.neg.default: "neg",
    aten.abs.default: "abs",
    aten.relu.default: "relu",
    aten.exp.default: "exp",
    aten.log.default: "log",
    aten.sqrt.default: "sqrt",
    aten.rsqrt.default: "rsqrt",
    aten.reciprocal.default: "reciprocal",
    aten.sin.default: "sin",
    aten.cos.default: "cos",
    aten.tanh.default: "tanh",
    aten.sigmoid.default: "sigmoid",
    aten.silu.default: "silu",
}


def _unary(e, node):
    dtype, _ = e.out_type()
    x = e.cast(e.val(node.args[0]), dtype)
    return e.op(UNARY[node.target], [x], final=True)


for _t in UNARY:
    CONVERTERS[_t] = _unary


@converts(aten.gelu.default)
def _gelu(e, node):
    approx = arg(node, 1, "approximate", "none")
    op = {"none": "gelu", "tanh": "gelu_tanh"}.get(approx)
    if op is None:
        raise Unsupported(f"gelu approximate={approx!r}")
    return e.op(op, [e.val(node.args[0])], final=True)


def _gelu_tanh_backward(e, node, g, x, dtype):
    # y = x/2·(1 + tanh(u)), u = √(2/π)·(x + 0.044715·x³):
    # dy/dx = (1 + t)/2 + x/2·(1 - t²)·√(2/π)·(1 + 3·0.044715·x²).
    xs = x.shape
    k = math.sqrt(2 / math.pi)

    def op(name, ins, attrs=()):
        return e.op(name, ins, attrs, dtype=dtype, shape=xs)

    x2 = op("mul", [x, x])
    x3 = op("mul", [x2, x])
    u = op("mul", [op("add", [x, op("mul", [x3, e.scalar(0.044715, dtype)])]), e.scalar(k, dtype)])
    t = op("tanh", [u])
    one = e.scalar(1, dtype)
    half = e.scalar(0.5, dtype)
    left = op("mul", [op("add", [one, t]), half])
    sech2 = op("sub", [one, op("mul", [t, t])])
    du = op("mul", [op("add", [one, op("mul", [x2, e.scalar(3 * 0.044715, dtype)])]), e.scalar(k, dtype)])
    right = op("mul", [op("mul", [op("mul", [x, half]), sech2]), du])
    return e.op("mul", [g, op("add", [left, right])], final=True)


@converts(aten.gelu_backward.default)
def _gelu_backward(e, node):
    # d/dx x·Φ(x) = Φ(x) + x·φ(x), with Φ(x) = gelu(x)/x (1/2 at 0: tessera
    # has no erf) and φ(x) = exp(-x²/2)/√(2π).
    approx = node.kwargs.get("approximate", node.args[2] if len(node.args) > 2 else "none")
    dtype, shape = e.out_type()
    g, x = e.cast(e.val(node.args[0]), dtype), e.cast(e.val(node.args[1]), dtype)
    if approx == "tanh":
        return _gelu_tanh_backward(e, node, g, x, dtype)
    if approx != "none":
        raise Unsupported(f"gelu_backward approximate={approx!r}")
    xs = x.shape
    gelu = e.op("gelu", [x], dtype=dtype, shape=xs)
    zero = e.scalar(0, dtype)
    is_zero = e.op("eq", [x, zero], dtype=torch.bool, shape=xs)
    one = e.scalar(1, dtype)
    safe_x = e.op("where", [is_zero, one, x], dtype=dtype, shape=xs)
    ratio = e.op("div", [gelu, safe_x], dtype=dtype, shape=xs)
    cdf = e.op("where", [is_zero, e.scalar(0.5, dtype), ratio], dtype=dtype, shape=xs)
    x2 = e.op("mul", [x, x], dtype=dtype, shape=xs)
    half_x2 = e.op("mul", [x2, e.scalar(-0.5, dtype)], dtype=dtype, shape=xs)
    pdf = e.op("mul", [e.op("exp", [half_x2], dtype=dtype, shape=xs), e.scalar(1 / math.sqrt(2 * math.pi), dtype)],
               dtype=dtype, shape=xs)  # fmt: skip
    xpdf = e.op("mul", [x, pdf], dtype=dtype, shape=xs)
    d = e.op("add", [cdf, xpdf], dtype=dtype, shape=xs)
    return e.op("mul", [g, d], final=True)


@converts(aten.nll_loss_backward.default)
def _nll_loss_backward(e, node):
    # grad_input[n, c] = -g_n / total_weight (mean) where c == target[n] and
    # target[n] != ignore_index, else 0.
    grad_out, x, target = e.val(node.args[0]), e.val(node.args[1]), e.val(node.args[2])
    weight, reduction, ignore_index, total_weight = node.args[3], node.args[4], node.args[5], node.args[6]
    if weight is not None:
        raise Unsupported("nll_loss_backward with class weights")
    dtype, shape = e.out_type()
    if len(shape) != 2:
        raise Unsupported(f"nll_loss_backward of a rank-{len(shape)} input")
    n, c = shape[0], concrete(shape[1], "nll_loss_backward's class count")
    t = e.op("reshape", [target], [("shape", fmt_list([n, 1]))], dtype=target.dtype, shape=[n, 1])
    classes = e.op(
        "arange", [], [("start", "0.0"), ("end", repr(float(c))), ("step", "1.0"), ("dtype", tir_dtype(target.dtype))],
        dtype=target.dtype, shape=[c],
    )  # fmt: skip
    hit = e.op("eq", [t, classes], dtype=torch.bool, shape=[n, c])
    valid = e.op("ne", [t, e.scalar(ignore_index, target.dtype)], dtype=torch.bool, shape=[n, 1])
    g = e.cast(grad_out, dtype)
    if reduction == 1:  # mean
        g = e.op("div", [g, e.cast(e.val(total_weight), dtype)], dtype=dtype, shape=g.shape)
    if reduction == 0 and len(g.shape) == 1:
        g = e.op("reshape", [g], [("shape", fmt_list([n, 1]))], dtype=dtype, shape=[n, 1])
    neg = e.op("neg", [g], dtype=dtype, shape=g.shape)
    zero = e.scalar(0, dtype)
    picked = e.op("where", [hit, neg, zero], dtype=dtype, shape=[n, c])
    return e.op("where", [valid, picked, zero], final=True)


def _binary_operands(e, node, a, b):
    dtype, _ = e.out_type()
    return dtype, e.operand(a, dtype), e.operand(b, dtype)


def _scaled(e, v, alpha):
    if alpha is None or alpha == 1:
        return v
    s = e.scalar(alpha, v.dtype)
    return e.op("mul", [v, s], dtype=v.dtype, shape=v.shape)


@converts(aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar)
def _add_sub(e, node):
    dtype, a, b = _binary_operands(e, node, node.args[0], node.args[1])
    b = _scaled(e, b, node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1))
    op = "add" if node.target in (aten.add.Tensor, aten.add.Scalar) else "sub"
    return e.op(op, [a, b], final=True)


@converts(aten.rsub.Scalar, aten.rsub.Tensor)
def _rsub(e, node):
    dtype, a, b = _binary_operands(e, node, node.args[0], node.args[1])
    a = _scaled(e, a, node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1))
    return e.op("sub", [b, a], final=True)


BINARY = {
    aten.mul.Tensor: "mul",
    aten.mul.Scalar: "mul",
    aten.maximum.default: "maximum",
    aten.minimum.default: "minimum",
    aten.pow.Tensor_Scalar: "pow",
    aten.pow.Tensor_Tensor: "pow",
}


def _binary(e, node):
    _, a, b = _binary_operands(e, node, node.args[0], node.args[1])
    return e.op(BINARY[node.target], [a, b], final=True)


for _t in BINARY:
    CONVERTERS[_t] = _binary


@converts(aten.pow.Scalar)
def _pow_scalar_base(e, node):
    dtype, _ = e.out_type()
    return e.op("pow", [e.operand(node.args[0], dtype), e.operand(node.args[1], dtype)], final=True)


@converts(prims.fma.default)
def _fma(e, node):
    dtype, shape = e.out_type()
    a, b, c = (e.operand(x, dtype) for x in node.args[:3])
    ab = e.op("mul", [a, b], dtype=dtype, shape=broadcast_shapes(a.shape, b.shape))
    return e.op("add", [ab, c], final=True)


@converts(aten.copy.default)
def _copy(e, node):
    # The functional copy: `src`'s values in `self`'s shape and dtype.
    dtype, shape = e.out_type()
    src = e.cast(e.val(node.args[1]), dtype)
    if src.shape != shape:
        src = e.op("expand", [src], [("shape", fmt_list(shape))], dtype=dtype, shape=shape)
    return e.op("contiguous", [src], final=True)


@converts(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode)
def _div(e, node):
    mode = node.kwargs.get("rounding_mode", node.args[2] if len(node.args) > 2 else None)
    dtype, _ = e.out_type()
    if mode is not None and not (mode == "trunc" and not dtype.is_floating_point):
        raise Unsupported(f"div with rounding_mode={mode!r}")
    _, a, b = _binary_operands(e, node, node.args[0], node.args[1])
    return e.op("div", [a, b], final=True)


COMPARE = {
    aten.eq.Tensor: "eq", aten.eq.Scalar: "eq",
    aten.ne.Tensor: "ne", aten.ne.Scalar: "ne",
    aten.lt.Tensor: "lt", aten.lt.Scalar: "lt",
    aten.le.Tensor: "le", aten.le.Scalar: "le",
    aten.gt.Tensor: "gt", aten.gt.Scalar: "gt",
    aten.ge.Tensor: "ge", aten.ge.Scalar: "ge",
}  # fmt: skip


def _operand_dtype(e, a):
    if isinstance(a, torch.fx.Node):
        return e.val(a).dtype
    return None


def _compute_dtype(e, a, b):
    """PyTorch's promotion of two operands (a Python scalar counts as a
    wrapped number of its kind)."""
    ta, tb = _operand_dtype(e, a), _operand_dtype(e, b)
    if ta is None and tb is None:
        raise Unsupported("two scalars")
    if ta is None or tb is None:
        t, s = (ta, b) if ta is not None else (tb, a)
        if isinstance(s, float) and not t.is_floating_point:
            return torch.get_default_dtype()
        if isinstance(s, int) and not isinstance(s, bool) and t == torch.bool:
            return torch.int64
        return t
    return torch.promote_types(ta, tb)


def _compare(e, node):
    a, b = node.args[0], node.args[1]
    dtype = _compute_dtype(e, a, b)
    return e.op(COMPARE[node.target], [e.operand(a, dtype), e.operand(b, dtype)], final=True)


for _t in COMPARE:
    CONVERTERS[_t] = _compare


@converts(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(e, node):
    dtype, _ = e.out_type()
    cond = e.val(node.args[0])
    if cond.dtype != torch.bool:
        raise Unsupported("where with a non-bool condition")
    return e.op("where", [cond, e.operand(node.args[1], dtype), e.operand(node.args[2], dtype)], final=True)


def _as_bool(e, arg):
    v = e.val(arg)
    if v.dtype == torch.bool:
        return v
    return e.op("ne", [v, e.scalar(0, v.dtype)], dtype=torch.bool, shape=v.shape)


@converts(aten.logical_not.default, aten.bitwise_not.default)
def _logical_not(e, node):
    dtype, _ = e.out_type()
    if node.target == aten.bitwise_not.default and dtype != torch.bool:
        raise Unsupported("bitwise_not of integers")
    x = _as_bool(e, node.args[0])
    return e.op("eq", [x, e.scalar(False, torch.bool)], final=True)


@converts(aten.logical_and.default, aten.logical_or.default, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor)
def _logical_and_or(e, node):
    dtype, _ = e.out_type()
    if dtype != torch.bool:
        raise Unsupported("bitwise ops on integers")
    a, b = _as_bool(e, node.args[0]), _as_bool(e, node.args[1])
    if node.target in (aten.logical_and.default, aten.bitwise_and.Tensor):
        return e.op("where", [a, b, e.scalar(False, torch.bool)], final=True)
    return e.op("where", [a, e.scalar(True, torch.bool), b], final=True)


@converts(aten.any.dim, aten.any.dims, aten.any.default)
def _any(e, node):
    x = _as_bool(e, node.args[0])
    dims = dims_list(arg(node, 1, "dim"), len(x.shape)) if node.target != aten.any.default else list(range(len(x.shape)))
    keep = bool(arg(node, 2, "keepdim", False)) if node.target != aten.any.default else False
    _, shape = e.out_type()
    xi = e.op("cast", [x], [("dtype", "i32")], dtype=torch.int32, shape=x.shape)
    m = e.op("max", [xi], [("dims", fmt_list(dims)), ("keepdim", "true" if keep else "false")],
             dtype=torch.int32, shape=shape)  # fmt: skip
    return e.op("gt", [m, e.scalar(0, torch.int32)], final=True)


@converts(aten.sign.default)
def _sign(e, node):
    # 1 above 0, -1 below, x·0 otherwise (±0 keep their sign, NaN stays NaN).
    dtype, shape = e.out_type()
    x = e.cast(e.val(node.args[0]), dtype)
    if not dtype.is_floating_point:
        raise Unsupported("sign of integers")
    zero = e.scalar(0, dtype)
    pos = e.op("gt", [x, zero], dtype=torch.bool, shape=x.shape)
    neg = e.op("lt", [x, zero], dtype=torch.bool, shape=x.shape)
    x0 = e.op("mul", [x, zero], dtype=dtype, shape=x.shape)
    below = e.op("where", [neg, e.scalar(-1, dtype), x0], dtype=dtype, shape=x.shape)
    return e.op("where", [pos, e.scalar(1, dtype), below], final=True)


@converts(aten.threshold_backward.default)
def _threshold_backward(e, node):
    grad, x = e.val(node.args[0]), e.val(node.args[1])
    threshold = node.args[2]
    t = e.scalar(threshold, x.dtype)
    le = e.op("le", [x, t], dtype=torch.bool, shape=broadcast_shapes(x.shape, []))
    zero = e.scalar(0, grad.dtype)
    return e.op("where", [le, zero, grad], final=True)


@converts(aten.clamp_min.default)
def _clamp_min(e, node):
    dtype, _ = e.out_type()
    x = e.cast(e.val(node.args[0]), dtype)
    return e.op("maximum", [x, e.scalar(node.args[1], dtype)], final=True)


@converts(aten.clamp_max.default)
def _clamp_max(e, node):
    dtype, _ = e.out_type()
    x = e.cast(e.val(node.args[0]), dtype)
    return e.op("minimum", [x, e.scalar(node.args[1], dtype)], final=True)


@converts(aten.clamp.default, aten.clamp.Tensor)
def _clamp(e, node):
    # Bounds are scalars (clamp.default) or tensors (clamp.Tensor: what
    # clamp_min/clamp_max with a tensor decompose to), either may be None.
    dtype, shape = e.out_type()
    v = e.cast(e.val(node.args[0]), dtype)
    lo, hi = arg(node, 1, "min"), arg(node, 2, "max")
    if lo is not None:
        v = e.op("maximum", [v, e.operand(lo, dtype)], dtype=dtype, shape=shape)
    if hi is not None:
        v = e.op("minimum", [v, e.operand(hi, dtype)], dtype=dtype, shape=shape)
    return e.op("contiguous", [v], final=True)


# -- reductions ---------------------------------------------------------------


def _reduce(e, node, op, dims, keepdim, dtype=None):
    x = e.val(node.args[0])
    out_dtype, _ = e.out_type()
    x = e.cast(x, out_dtype)
    dims = dims_list(dims, len(x.shape))
    keep = "true" if keepdim else "false"
    return e.op(op, [x], [("dims", fmt_list(dims)), ("keepdim", keep)], final=True)


@converts(aten.sum.dim_IntList)
def _sum(e, node):
    return _reduce(e, node, "sum", arg(node, 1, "dim"), arg(node, 2, "keepdim", False))


@converts(aten.sum.default)
def _sum_all(e, node):
    return _reduce(e, node, "sum", None, False)


@converts(aten.mean.dim)
def _mean(e, node):
    return _reduce(e, node, "mean", arg(node, 1, "dim"), arg(node, 2, "keepdim", False))


@converts(aten.mean.default)
def _mean_all(e, node):
    return _reduce(e, node, "mean", None, False)


@converts(aten.amax.default)
def _amax(e, node):
    return _reduce(e, node, "max", arg(node, 1, "dim", []), arg(node, 2, "keepdim", False))


@converts(aten.amin.default)
def _amin(e, node):
    return _reduce(e, node, "min", arg(node, 1, "dim", []), arg(node, 2, "keepdim", False))


@converts(aten.prod.dim_int)
def _prod(e, node):
    return _reduce(e, node, "prod", [arg(node, 1, "dim")], arg(node, 2, "keepdim", False))


@converts(aten.argmax.default, aten.argmin.default)
def _argmax(e, node):
    x = e.val(node.args[0])
    dim = arg(node, 1, "dim")
    if dim is None:
        raise Unsupported("argmax/argmin over all dims")
    op = "argmax" if node.target == aten.argmax.default else "argmin"
    keep = "true" if arg(node, 2, "keepdim", False) else "false"
    return e.op(op, [x], [("dim", normalise_dim(dim, len(x.shape))), ("keepdim", keep)], final=True)


@converts(aten._softmax.default, aten._log_softmax.default)
def _softmax(e, node):
    x = e.val(node.args[0])
    dtype, _ = e.out_type()
    x = e.cast(x, dtype)
    op = "softmax" if node.target == aten._softmax.default else "log_softmax"
    return e.op(op, [x], [("dim", normalise_dim(node.args[1], len(x.shape)))], final=True)


@converts(aten._softmax_backward_data.default)
def _softmax_backward(e, node):
    # grad_in = y * (g - sum(g * y, dim, keepdim))
    g, y = e.val(node.args[0]), e.val(node.args[1])
    dim = normalise_dim(node.args[2], len(y.shape))
    dtype, shape = e.out_type()
    g, y = e.cast(g, dtype), e.cast(y, dtype)
    gy = e.op("mul", [g, y], dtype=dtype, shape=shape)
    kept = list(shape)
    kept[dim] = 1
    s = e.op("sum", [gy], [("dims", fmt_list([dim])), ("keepdim", "true")], dtype=dtype, shape=kept)
    d = e.op("sub", [g, s], dtype=dtype, shape=shape)
    return e.op("mul", [y, d], final=True)


@converts(aten._log_softmax_backward_data.default)
def _log_softmax_backward(e, node):
    # grad_in = g - exp(y) * sum(g, dim, keepdim)
    g, y = e.val(node.args[0]), e.val(node.args[1])
    dim = normalise_dim(node.args[2], len(y.shape))
    dtype, shape = e.out_type()
    g, y = e.cast(g, dtype), e.cast(y, dtype)
    kept = list(shape)
    kept[dim] = 1
    s = e.op("sum", [g], [("dims", fmt_list([dim])), ("keepdim", "true")], dtype=dtype, shape=kept)
    p = e.op("exp", [y], dtype=dtype, shape=shape)
    ps = e.op("mul", [p, s], dtype=dtype, shape=shape)
    return e.op("sub", [g, ps], final=True)


# -- linear algebra -------------------------------------------------------------


@converts(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _mm(e, node):
    a, b = e.val(node.args[0]), e.val(node.args[1])
    return e.op("matmul", [a, b], final=True)


@converts(aten.addmm.default)
def _addmm(e, node):
    bias, a, b = (e.val(x) for x in node.args[:3])
    beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
    dtype, shape = e.out_type()
    ab = e.op("matmul", [a, b], dtype=dtype, shape=shape)
    ab = _scaled(e, ab, alpha)
    bias = _scaled(e, bias, beta)
    return e.op("add", [ab, bias], final=True)


# -- shapes ---------------------------------------------------------------------


@converts(
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.flatten.using_ints,
    prims.collapse_view.default,
)
def _reshape(e, node):
    x = e.val(node.args[0])
    _, shape = e.out_type()
    return e.op("reshape", [x], [("shape", fmt_list(shape))], final=True)


@converts(aten.permute.default)
def _permute(e, node):
    x = e.val(node.args[0])
    perm = [normalise_dim(d, len(x.shape)) for d in node.args[1]]
    return e.op("permute", [x], [("perm", fmt_list(perm))], final=True)


@converts(aten.t.default)
def _t(e, node):
    x = e.val(node.args[0])
    if len(x.shape) < 2:
        return e.identity(x)
    return e.op("permute", [x], [("perm", "[1,0]")], final=True)


@converts(aten.transpose.int)
def _transpose(e, node):
    x = e.val(node.args[0])
    r = len(x.shape)
    a, b = normalise_dim(node.args[1], r), normalise_dim(node.args[2], r)
    perm = list(range(r))
    if r == 0:
        return e.identity(x)
    perm[a], perm[b] = perm[b], perm[a]
    return e.op("permute", [x], [("perm", fmt_list(perm))], final=True)


@converts(aten.expand.default)
def _expand(e, node):
    x = e.val(node.args[0])
    _, shape = e.out_type()
    return e.op("expand", [x], [("shape", fmt_list(shape))], final=True)


@converts(aten.clone.default, aten.contiguous.default)
def _clone(e, node):
    return e.op("contiguous", [e.val(node.args[0])], final=True)


@converts(aten.detach.default, aten.alias.default, aten.lift_fresh_copy.default)
def _identity(e, node):
    return e.identity(e.val(node.args[0]))


def size_arg(a):
    """A size argument (an int, a SymInt, or the FX node of a SymInt) as a
    dim; None stays None."""
    if isinstance(a, torch.fx.Node):
        a = a.meta.get("val")
        if not isinstance(a, (int, torch.SymInt)):
            raise Unsupported(f"a size argument of type {type(a).__name__}")
    return None if a is None else dim_of(a)


def _symbolic_slice(e, x, dim, start, step):
    """A slice where the dim, start or end is symbolic: PyTorch has clamped
    the bounds already (its result's length says where it ends); tessera
    takes a symbolic end from a start of 0 with step 1."""
    _, shape = e.out_type()
    length = shape[dim]
    start = concrete(0 if start is None else start, f"the start of a slice along dim {dim}")
    if start < 0:
        raise NotSymbolic(f"a slice from {start} (from the end) of the symbolic dim {x.shape[dim]}")
    if is_symbolic(length):
        if (start, step) != (0, 1):
            raise NotSymbolic(f"a slice of symbolic length {length} from {start} with step {step} "
                              "(tessera's symbolic slices start at 0 with step 1)")  # fmt: skip
        end = length
    else:
        end = start + (length - 1) * step + 1 if length > 0 else start
    attrs = [("dim", dim), ("start", start), ("end", dim_str(end)), ("step", step)]
    return e.op("slice", [x], attrs, final=True)


@converts(aten.slice.Tensor)
def _slice(e, node):
    x = e.val(node.args[0])
    r = len(x.shape)
    dim = normalise_dim(arg(node, 1, "dim", 0), r)
    size = x.shape[dim]
    start, end, step = (size_arg(arg(node, i, k, d)) for i, k, d in ((2, "start", None), (3, "end", None), (4, "step", 1)))
    step = 1 if step is None else concrete(step, "a slice step")
    if step < 1:
        raise Unsupported(f"slice step {step}")
    if any(is_symbolic(v) for v in (size, start, end)):
        return _symbolic_slice(e, x, dim, start, step)
    start = 0 if start is None else int(start)
    end = size if end is None else int(end)
    if start < 0:
        start += size
    if end < 0:
        end += size
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    attrs = [("dim", dim), ("start", start), ("end", end), ("step", step)]
    return e.op("slice", [x], attrs, final=True)


@converts(aten.slice_scatter.default)
def _slice_scatter(e, node):
    # base with src in place of base[start:end] along dim: three parts joined.
    base, src = e.val(node.args[0]), e.val(node.args[1])
    r = len(base.shape)
    dim = normalise_dim(arg(node, 2, "dim", 0), r)
    if arg(node, 5, "step", 1) in (None, 1) and src.shape == base.shape:
        # The whole dim (of a size that may be symbolic) is written.
        return e.op("contiguous", [e.cast(src, e.out_type()[0])], final=True)
    size = concrete(base.shape[dim], f"the dim slice_scatter writes along ({dim})")
    start, end, step = (size_arg(arg(node, i, k, d)) for i, k, d in ((3, "start", None), (4, "end", None), (5, "step", 1)))
    start, end = (None if v is None else concrete(v, "a slice_scatter bound") for v in (start, end))
    if step not in (None, 1):
        raise Unsupported(f"slice_scatter with step {step}")
    start = 0 if start is None else int(start)
    end = size if end is None else int(end)
    start = min(max(start + size if start < 0 else start, 0), size)
    end = min(max(end + size if end < 0 else end, start), size)
    dtype, shape = e.out_type()
    parts = []
    for lo, hi in ((0, start), (end, size)):
        if hi > lo:
            sh = list(base.shape)
            sh[dim] = hi - lo
            parts.append(e.op("slice", [base], [("dim", dim), ("start", lo), ("end", hi), ("step", 1)],
                              dtype=base.dtype, shape=sh))  # fmt: skip
    parts.insert(1 if start > 0 else 0, e.cast(src, dtype))
    if len(parts) == 1:
        return e.op("contiguous", parts, final=True)
    return e.op("cat", parts, [("dim", dim)], final=True)


@converts(aten.select.int)
def _select(e, node):
    x = e.val(node.args[0])
    dim = normalise_dim(node.args[1], len(x.shape))
    i = concrete(size_arg(node.args[2]), "select's index")
    size = x.shape[dim]
    if is_symbolic(size):
        if i < 0:
            raise NotSymbolic(f"select of index {i} (from the end) of the symbolic dim {size}")
    elif not -size <= i < size:
        raise Unsupported(f"select index {i} out of range for size {size}")
    i = i + size if i < 0 else i
    sh = list(x.shape)
    sh[dim] = 1
    part = e.op("slice", [x], [("dim", dim), ("start", i), ("end", i + 1), ("step", 1)], dtype=x.dtype, shape=sh)
    _, shape = e.out_type()
    return e.op("reshape", [part], [("shape", fmt_list(shape))], final=True)


@converts(aten.cat.default)
def _cat(e, node):
    tensors = [e.val(t) for t in node.args[0]]
    dtype, shape = e.out_type()
    tensors = [e.cast(t, dtype) for t in tensors if any(d != 0 for d in t.shape) or len(t.shape) > 1]
    dim = normalise_dim(arg(node, 1, "dim", 0), len(shape))
    return e.op("cat", tensors, [("dim", dim)], final=True)


@converts(aten.constant_pad_nd.default)
def _constant_pad_nd(e, node):
    # `pad` holds (before, after) pairs from the last dim backwards; a
    # negative amount crops (the pad's own backward), a positive one joins
    # a block of `value` on that side.
    x = e.val(node.args[0])
    pad, value = list(node.args[1]), arg(node, 2, "value", 0)
    dtype, _ = e.out_type()
    if len(pad) % 2 or len(pad) // 2 > len(x.shape):
        raise Unsupported(f"constant_pad_nd with pad {pad} of a rank-{len(x.shape)} tensor")
    v = e.cast(x, dtype)
    for i in range(len(pad) // 2):
        dim = len(x.shape) - 1 - i
        before, after = (concrete(size_arg(p), f"the padding of dim {dim}") for p in pad[2 * i : 2 * i + 2])
        v = _pad_dim(e, v, dim, before, after, value)
    return e.op("contiguous", [v], final=True)


def _pad_dim(e, v, dim, before, after, value):
    """`v` with `before`/`after` elements of `value` joined along `dim`
    (negative: that many cut off)."""
    size = v.shape[dim]
    lo, hi = max(-before, 0), size - max(-after, 0)
    if (lo, hi) != (0, size):
        sh = list(v.shape)
        sh[dim] = hi - lo
        v = e.op("slice", [v], [("dim", dim), ("start", lo), ("end", dim_str(hi)), ("step", 1)], dtype=v.dtype, shape=sh)
    parts = [v]
    for n, at in ((before, 0), (after, 1)):
        if n > 0:
            sh = list(v.shape)
            sh[dim] = n
            block = e.op("full", [], [("value", fmt_scalar(value, v.dtype)), ("shape", fmt_list(sh)),
                                      ("dtype", tir_dtype(v.dtype))], dtype=v.dtype, shape=sh)  # fmt: skip
            parts.insert(at * len(parts), block)
    if len(parts) == 1:
        return v
    sh = list(v.shape)
    sh[dim] = sum(p.shape[dim] for p in parts)
    return e.op("cat", parts, [("dim", dim)], dtype=v.dtype, shape=sh)


@converts(aten.tril.default, aten.triu.default)
def _tri(e, node):
    x = e.val(node.args[0])
    op = "tril" if node.target == aten.tril.default else "triu"
    return e.op(op, [x], [("diagonal", int(arg(node, 1, "diagonal", 0)))], final=True)


# -- creation -------------------------------------------------------------------


def _full(e, value):
    dtype, shape = e.out_type()
    attrs = [("value", fmt_scalar(value, dtype)), ("shape", fmt_list(shape)), ("dtype", tir_dtype(dtype))]
    return e.op("full", [], attrs, final=True)


@converts(aten.full.default)
def _full_default(e, node):
    return _full(e, node.args[1])


@converts(aten.scalar_tensor.default)
def _scalar_tensor(e, node):
    return _full(e, node.args[0])


@converts(aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default)
def _zeros(e, node):
    return _full(e, 0)


@converts(aten.ones.default, aten.ones_like.default, aten.new_ones.default)
def _ones(e, node):
    return _full(e, 1)


@converts(aten.full_like.default)
def _full_like(e, node):
    return _full(e, node.args[1])


@converts(aten.arange.start_step, aten.arange.default, aten.arange.start)
def _arange(e, node):
    dtype, shape = e.out_type()
    a = list(node.args)
    if node.target == aten.arange.default:
        start, end, step = 0, a[0], 1
    elif node.target == aten.arange.start:
        start, end, step = a[0], a[1], 1
    else:
        start, end = a[0], a[1]
        step = a[2] if len(a) > 2 else node.kwargs.get("step", 1)
    start, end, step = (concrete(size_arg(v), f"arange's {k}") if isinstance(v, (torch.fx.Node, torch.SymInt)) else v
                        for v, k in ((start, "start"), (end, "end"), (step, "step")))  # fmt: skip
    attrs = [
        ("start", repr(float(start))),
        ("end", repr(float(end))),
        ("step", repr(float(step))),
        ("dtype", tir_dtype(dtype)),
    ]
    return e.op("arange", [], attrs, final=True)


# -- casts ----------------------------------------------------------------------


@converts(aten._to_copy.default, prims.convert_element_type.default)
def _to_copy(e, node):
    x = e.val(node.args[0])
    dtype, _ = e.out_type()
    # A device argument changes nothing here: a partition runs on one
    # device, its inputs moved there first (a host scalar beside GPU
    # tensors: AdamW's step count) and each output moved to the device
    # PyTorch expects it on (`TesseraPartition.forward`).
    if x.dtype == dtype:
        return e.op("contiguous", [x], final=True)
    return e.cast(x, dtype, final=True)


# -- indexing -------------------------------------------------------------------


@converts(aten.index_select.default)
def _index_select(e, node):
    x, idx = e.val(node.args[0]), e.val(node.args[2])
    dim = normalise_dim(node.args[1], len(x.shape))
    return e.op("index_select", [x, idx], [("dim", dim)], final=True)


@converts(aten.gather.default)
def _gather(e, node):
    x, idx = e.val(node.args[0]), e.val(node.args[2])
    dim = normalise_dim(node.args[1], len(x.shape))
    return e.op("gather", [x, idx], [("dim", dim)], final=True)


@converts(aten.scatter_add.default)
def _scatter_add(e, node):
    base, idx, src = e.val(node.args[0]), e.val(node.args[2]), e.val(node.args[3])
    dim = normalise_dim(node.args[1], len(base.shape))
    return e.op("scatter_add", [base, idx, src], [("dim", dim)], final=True)


@converts(aten.index_add.default)
def _index_add(e, node):
    base, idx, src = e.val(node.args[0]), e.val(node.args[2]), e.val(node.args[3])
    if node.kwargs.get("alpha", 1) != 1:
        src = _scaled(e, src, node.kwargs["alpha"])
    dim = normalise_dim(node.args[1], len(base.shape))
    return e.op("index_add", [base, idx, src], [("dim", dim)], final=True)


@converts(aten.index_put.default)
def _index_put(e, node):
    # Only the accumulating form with one 1-D index (index_select's
    # backward): index_add along that dim.
    base, indices, values = e.val(node.args[0]), node.args[1], e.val(node.args[2])
    accumulate = arg(node, 3, "accumulate", False)
    given = [(d, i) for d, i in enumerate(indices) if i is not None]
    if not accumulate or len(given) != 1:
        raise Unsupported("index_put other than accumulating with one index tensor")
    dim, idx = given[0]
    idx = e.val(idx)
    want = list(base.shape)
    if len(idx.shape) != 1:
        raise Unsupported("index_put with a multi-dimensional index")
    want[dim] = idx.shape[0]
    if values.shape != want:
        raise Unsupported(f"index_put of values shaped {values.shape}, not {want}")
    return e.op("index_add", [base, idx, e.cast(values, base.dtype)], [("dim", dim)], final=True)


@converts(aten.embedding.default)
def _embedding(e, node):
    w, ids = e.val(node.args[0]), e.val(node.args[1])
    n = 1
    for d in ids.shape:
        n *= d
    flat = e.op("reshape", [ids], [("shape", fmt_list([n]))], dtype=ids.dtype, shape=[n])
    rows = e.op("index_select", [w, flat], [("dim", 0)], dtype=w.dtype, shape=[n, w.shape[1]])
    _, shape = e.out_type()
    return e.op("reshape", [rows], [("shape", fmt_list(shape))], final=True)


@converts(aten.embedding_dense_backward.default)
def _embedding_backward(e, node):
    grad, ids = e.val(node.args[0]), e.val(node.args[1])
    num_weights = concrete(size_arg(node.args[2]), "embedding_dense_backward's row count")
    padding_idx = concrete(size_arg(node.args[3]), "embedding_dense_backward's padding index")
    if len(node.args) > 4 and node.args[4]:
        raise Unsupported("embedding backward with scale_grad_by_freq")
    dtype, shape = e.out_type()
    d = shape[1]
    n = 1
    for s in ids.shape:
        n *= s
    flat_ids = e.op("reshape", [ids], [("shape", fmt_list([n]))], dtype=ids.dtype, shape=[n])
    rows = e.op("reshape", [e.cast(grad, dtype)], [("shape", fmt_list([n, d]))], dtype=dtype, shape=[n, d])
    if padding_idx >= 0:
        pad = e.scalar(padding_idx, ids.dtype)
        hit = e.op("eq", [flat_ids, pad], dtype=torch.bool, shape=[n])
        hit2 = e.op("reshape", [hit], [("shape", fmt_list([n, 1]))], dtype=torch.bool, shape=[n, 1])
        rows = e.op("where", [hit2, e.scalar(0, dtype), rows], dtype=dtype, shape=[n, d])
    zeros = e.op(
        "full",
        [],
        [("value", fmt_scalar(0, dtype)), ("shape", fmt_list([num_weights, d])), ("dtype", tir_dtype(dtype))],
        dtype=dtype,
        shape=[num_weights, d],
    )
    return e.op("index_add", [zeros, flat_ids, rows], [("dim", 0)], final=True)


# -- multi-output ops (their getitem nodes pick one) ----------------------------


@converts(aten.var_mean.correction)
def _var_mean(e, node):
    x = e.val(node.args[0])
    dims = dims_list(arg(node, 1, "dim"), len(x.shape))
    correction = node.kwargs.get("correction", 1)
    correction = 1 if correction is None else correction
    keepdim = node.kwargs.get("keepdim", False)
    var_t, mean_t = e.meta(node)
    dtype = var_t.dtype
    x = e.cast(x, dtype)
    kept = [1 if i in dims else s for i, s in enumerate(x.shape)]
    n = 1
    for i in dims:
        n *= x.shape[i]
    mean_k = e.op("mean", [x], [("dims", fmt_list(dims)), ("keepdim", "true")], dtype=dtype, shape=kept)
    diff = e.op("sub", [x, mean_k], dtype=dtype, shape=x.shape)
    sq = e.op("mul", [diff, diff], dtype=dtype, shape=x.shape)
    ss = e.op("sum", [sq], [("dims", fmt_list(dims)), ("keepdim", "true" if keepdim else "false")],
              dtype=dtype, shape=list(var_t.shape))  # fmt: skip
    n = concrete(n, f"the element count var_mean divides by (dims {dims})")
    denom = e.scalar(max(n - correction, 0), dtype)
    var = e.line(node.name + "_var", "div", [ss, denom], [], dtype, list(var_t.shape))
    if keepdim:
        mean = mean_k
    else:
        mean = e.op("reshape", [mean_k], [("shape", fmt_list(mean_t.shape))], dtype=dtype, shape=list(mean_t.shape))
    return [var, mean]


@converts(aten.split_with_sizes.default, aten.split.Tensor, aten.unbind.int)
def _split(e, node):
    x = e.val(node.args[0])
    outs = e.meta(node)
    if not isinstance(outs, list) or not all(isinstance(o, TT) for o in outs):
        raise Unsupported("split without tensor results")
    default_dim = 0
    dim = normalise_dim(arg(node, 2 if node.target != aten.unbind.int else 1, "dim", default_dim), len(x.shape))
    values, start = [], 0
    for i, o in enumerate(outs):
        n = 1 if node.target == aten.unbind.int else o.shape[dim]
        sh = list(x.shape)
        sh[dim] = n
        start = concrete(start, f"the start of split part {i} along dim {dim}")
        part = e.line(f"{node.name}_{i}" if node.target != aten.unbind.int else f"{node.name}_s{i}", "slice", [x],
                      [("dim", dim), ("start", start), ("end", dim_str(start + n)), ("step", 1)], x.dtype, sh)  # fmt: skip
        if node.target == aten.unbind.int:
            part = e.line(f"{node.name}_{i}", "reshape", [part], [("shape", fmt_list(o.shape))], x.dtype, o.shape)
        values.append(part)
        start += n
    return values


@converts(operator.getitem)
def _getitem(e, node):
    src = e.values.get(node.args[0])
    if not isinstance(src, list):
        raise Unsupported("getitem of a value that is not a tuple")
    return src[node.args[1]]


def convert_node(e, node):
    """Emits `node`; its Value (or list of Values)."""
    fn = CONVERTERS.get(node.target)
    if fn is None:
        raise Unsupported(f"{op_name(node)} has no tessera conversion")
    e.node = node
    try:
        return fn(e, node)
    except NotSymbolic as err:
        site = call_site(node)
        where = f"{op_name(node)} ({node.name}{', ' + site if site else ''})"
        raise NotSymbolic(f"{where}: {err}") from None
    finally:
        e.node = None


def op_name(node):
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return f"aten.{t.__name__}" if t.namespace == "aten" else str(t)
    return getattr(t, "__name__", str(t))


def to_tir(gm, name, types, backward=False):
    """The text of `gm` (an FX graph of converted ops) as a tessera graph,
    with `types` the concrete value of each node. Returns (text, the
    positions of `gm`'s placeholders that are graph inputs, output count)."""
    e = Emitter(name, types, backward)
    tensor_inputs = []
    outputs = []
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        v = types.get(node)
        if isinstance(v, TT):
            e.node = None
            label = f"in_{node.name}"
            val = e.line(label, "input", [], [], v.dtype, list(v.shape), node=None)
            e.inputs.append(val)
            e.values[node] = val
            tensor_inputs.append(i)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            e.values[node] = convert_node(e, node)
        elif node.op == "output":
            for out in torch.fx.node.map_arg(node.args[0], lambda n: n) if isinstance(node.args[0], (list, tuple)) else [node.args[0]]:
                outputs.append(e.val(out))
        elif node.op != "placeholder":
            raise Unsupported(f"an FX node of kind {node.op}")
    return e.text(outputs), tensor_inputs, len(outputs)


# The CNN ops' converters register themselves in CONVERTERS (they import
# this module's helpers, so they come last).
from . import _cnn  # noqa: E402,F401
