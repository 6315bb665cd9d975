"""The seed's attention in PyTorch (seeds/000: ``sdpa_fwd``, ``PySDPA``,
``PySDPAHinted``), as the blog post writes it, less the HPU-only causal
kernel (``torch.ops.hpu.scaled_triangular_softmax_retain``): the causal
variant is not part of this module.

``sdpa_bwd`` is not in the post; it is the textbook backward of the same
sliced computation (P recomputed per slice from Q and K). ``hinted_context``
is Gaudi's call (``hinted_context(fn, *args, hint=...)``) on top of
PyTorch's ``torch.ops.higher_order.hints_wrapper`` where that op exists,
else on :func:`tessera.hints`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._hints import _hint_dict_const, hints

#: The seed's hint, with the backward as its own group (as
#: ``tessera seed-table`` runs it).
SEED_HINT = '{"order": "strict", "group_id": 0, "backward_group_id": 1}'


def hinted_context(fn, *args, hint):
    """Runs ``fn(*args)`` with its ops hinted. Tensors, ints, floats and
    bools in `args` are passed through ``hints_wrapper`` when PyTorch has
    it; other arguments (``ctx``, ``None``) are closed over."""
    hop = getattr(torch.ops.higher_order, "hints_wrapper", None)
    spec = _hint_dict_const(hint) if isinstance(hint, str) else dict(hint)
    if hop is None or torch.is_grad_enabled():
        # hints_wrapper has no autograd rule: under grad, the context
        # manager carries the hints instead.
        with hints(spec):
            return fn(*args)
    passed = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def body(*tensors):
        full = list(args)
        for i, t in zip(passed, tensors):
            full[i] = t
        return fn(*full)

    return hop(body, tuple(args[i] for i in passed), {}, hints=spec)


def sdpa_fwd(ctx, q, k, v, is_causal, with_slice):
    """
    1. using retain tensor
    2. if slice enabled, using default size 1
    """
    if is_causal:
        raise NotImplementedError("the causal variant needs the HPU softmax-retain kernel")
    # no slice on batch heads dimensions
    batch_heads = 1
    if with_slice:
        batch_heads = q.shape[0] * q.shape[1]

    scale = 1 / math.sqrt(q.size(-1))

    Q = torch.flatten(q, end_dim=1)
    K = torch.flatten(k, end_dim=1)
    V = torch.flatten(v, end_dim=1)

    Qi = torch.tensor_split(Q, batch_heads)
    Ki = torch.tensor_split(K, batch_heads)
    Vi = torch.tensor_split(V, batch_heads)

    output_slices = []
    for slice in range(batch_heads):
        current_Qi = Qi[slice]
        current_Ki = Ki[slice]
        current_Vi = Vi[slice]

        Si = torch.matmul(current_Qi, current_Ki.transpose(-2, -1))
        Si = torch.mul(Si, scale)
        Pi = F.softmax(Si, dim=-1)

        output_slices.append(torch.matmul(Pi, current_Vi))

    return (
        torch.cat(output_slices).reshape((q.shape[0], q.shape[1], v.shape[2], v.shape[3])),
        None,
        None,
    )


def sdpa_bwd(dout, q, k, v, out, is_causal, retain_exp, retain_max, with_slice):
    """The gradients of :func:`sdpa_fwd` with the same slicing."""
    batch_heads = q.shape[0] * q.shape[1] if with_slice else 1
    scale = 1 / math.sqrt(q.size(-1))
    Q, K, V, dO = (torch.flatten(t, end_dim=1) for t in (q, k, v, dout))
    parts = [torch.tensor_split(t, batch_heads) for t in (Q, K, V, dO)]
    dqs, dks, dvs = [], [], []
    for Qi, Ki, Vi, dOi in zip(*parts):
        Pi = F.softmax(torch.mul(torch.matmul(Qi, Ki.transpose(-2, -1)), scale), dim=-1)
        dvs.append(torch.matmul(Pi.transpose(-2, -1), dOi))
        dPi = torch.matmul(dOi, Vi.transpose(-2, -1))
        dSi = Pi * (dPi - (dPi * Pi).sum(dim=-1, keepdim=True))
        dqs.append(torch.matmul(dSi, Ki) * scale)
        dks.append(torch.matmul(dSi.transpose(-2, -1), Qi) * scale)
    return tuple(torch.cat(g).reshape(t.shape) for g, t in ((dqs, q), (dks, k), (dvs, v)))


class PySDPA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, with_slice=False):
        out, retain_exp, retain_max = sdpa_fwd(ctx, q, k, v, is_causal, with_slice)

        ctx.save_for_backward(q, k, v, out)

        ctx.is_causal = is_causal
        ctx.with_slice = with_slice

        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out = ctx.saved_tensors
        dq, dk, dv = sdpa_bwd(dout, q, k, v, out, ctx.is_causal, None, None, ctx.with_slice)
        return dq, dk, dv, None, None


class PySDPAHinted(torch.autograd.Function):
    """PySDPA whose forward and backward run under the seed's hint
    (``{"order": "strict", "group_id": 0}``; the backward as group 1)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, with_slice=True):
        def forward_hinted(q, k, v):
            (out, _, _) = sdpa_fwd(None, q, k, v, is_causal, with_slice)
            return (out,)

        (out,) = hinted_context(forward_hinted, q, k, v, hint='{"order": "strict", "group_id": 0}')
        ctx.save_for_backward(q, k, v, out)
        ctx.with_slice = with_slice
        ctx.is_causal = is_causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out = ctx.saved_tensors

        def backward_hinted(dout, q, k, v, out):
            return sdpa_bwd(dout, q, k, v, out, ctx.is_causal, None, None, ctx.with_slice)

        dq, dk, dv = hinted_context(
            backward_hinted, dout, q, k, v, out, hint='{"order": "strict", "group_id": 1}'
        )
        return dq, dk, dv, None, None
