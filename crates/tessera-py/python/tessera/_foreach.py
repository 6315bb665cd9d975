"""PyTorch's multi-tensor ops (``aten._foreach_*``) as per-tensor ATen ops.

torch.optim's foreach paths (the default on CUDA, ``foreach=True``
anywhere) update lists of tensors one call at a time:
``torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)``. AOTAutograd
functionalizes those into ``_foreach_*`` nodes that return lists. The
decompositions here (:data:`DECOMPOSITIONS`, applied while AOTAutograd
traces, see :data:`tessera.torch.DECOMPOSITIONS`) make each one ATen call
per list element, the loop PyTorch's own CPU kernels run (the "slow path"
of ``ForeachOpsKernels.cpp``), so every result has PyTorch's dtype and
shape; the core decompositions then split those calls further (``lerp``,
``addcdiv``) and the elementwise converters take them. tessera's fusion
then sees each tensor's whole chain of updates (its kernels are per
tensor, where PyTorch's multi-tensor kernels cover many tensors a launch:
not measured against each other).

Only the ops whose per-tensor form tessera converts are listed: any other
``_foreach_*`` op stays one node and runs in PyTorch (logged), one
multi-tensor kernel rather than a PyTorch call per tensor.
"""

from __future__ import annotations

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from ._tessera import TesseraError

aten = torch.ops.aten


def _zip(per_tensor):
    """The decomposition calling `per_tensor` once per list element: each
    list argument (tensors or scalars) gives its i-th element, the other
    arguments are passed as they are."""

    def decomposition(*args, **kwargs):
        lengths = {len(a) for a in args if isinstance(a, (list, tuple))}
        if len(lengths) != 1:
            raise TesseraError(f"{per_tensor}: the lists of a foreach call differ in length ({sorted(lengths)})")
        (n,) = lengths
        return [per_tensor(*[a[i] if isinstance(a, (list, tuple)) else a for a in args], **kwargs) for i in range(n)]

    return decomposition


def _addc_tensor(divide):
    """``_foreach_addcmul.Tensor``/``_foreach_addcdiv.Tensor``: `scalars` is
    a 1-D tensor with one value per list element, which PyTorch reads as a
    Python scalar (``convert_tensor_to_scalar_list``) and applies as
    ``self + value * t1 * t2`` (``/ t2``) in the op-math dtype (f32 for
    f16/bf16); a scalar argument cannot be a traced value, so the formula
    is written out, with PyTorch's type promotion."""

    def per_tensor(x, t1, t2, value):
        math, dtype = elementwise_dtypes(x, t1, t2, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
        x, t1, t2, value = (aten._to_copy.default(t, dtype=math) for t in (x, t1, t2, value))
        scaled = aten.mul.Tensor(value, t1)
        term = aten.div.Tensor(scaled, t2) if divide else aten.mul.Tensor(scaled, t2)
        return aten._to_copy.default(aten.add.Tensor(x, term), dtype=dtype)

    def decomposition(self, tensor1, tensor2, scalars):
        if scalars.dim() != 1 or scalars.shape[0] != len(self):
            raise TesseraError(
                f"_foreach_addc{'div' if divide else 'mul'}.Tensor: scalars of shape {list(scalars.shape)} "
                f"for {len(self)} tensors"
            )
        values = [aten.select.int(scalars, 0, i) for i in range(len(self))]
        return _zip(per_tensor)(self, tensor1, tensor2, values)

    return decomposition


def _value_keyword(op):
    """`op` (addcmul, addcdiv) with its keyword-only `value` passed by position."""
    return lambda x, t1, t2, value=1: op(x, t1, t2, value=value)


def _norm(self, ord=2, dtype=None):
    """``_foreach_norm``: ``linalg_vector_norm`` of each tensor over all its
    elements (clip_grad_norm_'s foreach path)."""
    return [aten.linalg_vector_norm.default(x, ord, None, False, dtype=dtype) for x in self]


def _overloads(name, *overloads):
    """The overloads of ``aten._foreach_<name>`` this torch has (older
    releases lack some: ``_foreach_lerp.ScalarList``)."""
    packet = getattr(aten, f"_foreach_{name}", None)
    return [getattr(packet, o) for o in overloads if packet is not None and hasattr(packet, o)]


def _table():
    table = {}

    def put(name, overloads, decomposition):
        for op in _overloads(name, *overloads):
            table[op] = decomposition

    # Unary ops whose per-tensor op has a converter.
    for name in ("abs", "neg", "exp", "log", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tanh", "sigmoid", "sign"):
        put(name, ["default"], _zip(getattr(aten, name).default))
    # Binary ops: a scalar, a list of tensors, a list of scalars, or one
    # tensor (a 0-d step or learning rate) with each element.
    for name in ("add", "sub", "mul", "div"):
        put(name, ["Scalar", "List", "ScalarList", "Tensor"], _zip(getattr(aten, name).Tensor))
    # maximum/minimum with scalars are PyTorch's clamp_min/clamp_max.
    for name, clamp in (("maximum", "clamp_min"), ("minimum", "clamp_max")):
        put(name, ["List"], _zip(getattr(aten, name).default))
        put(clamp, ["List"], _zip(getattr(aten, clamp).Tensor))
        for foreach in (name, clamp):
            put(foreach, ["Scalar", "ScalarList"], _zip(getattr(aten, clamp).default))
    put("pow", ["List"], _zip(aten.pow.Tensor_Tensor))
    put("pow", ["Scalar", "ScalarList"], _zip(aten.pow.Tensor_Scalar))
    put("pow", ["ScalarAndTensor"], _zip(aten.pow.Scalar))
    # Pointwise ops of three lists: value a scalar, a list of scalars or a
    # tensor of them.
    for name, divide in (("addcmul", False), ("addcdiv", True)):
        put(name, ["Scalar", "ScalarList"], _zip(_value_keyword(getattr(aten, name).default)))
        put(name, ["Tensor"], _addc_tensor(divide))
    put("lerp", ["List"], _zip(aten.lerp.Tensor))
    put("lerp", ["Scalar", "ScalarList"], _zip(aten.lerp.Scalar))
    put("copy", ["default"], _zip(aten.copy.default))
    put("zero", ["default"], _zip(aten.zeros_like.default))
    put("clone", ["default"], _zip(aten.clone.default))
    put("norm", ["Scalar"], _norm)
    return table


#: Each decomposed ``_foreach_*`` overload and its decomposition.
DECOMPOSITIONS = _table()
