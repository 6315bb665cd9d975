"""Each converted ATen op (and its backward) under torch.compile(backend="tessera")
against eager PyTorch: values and gradients, and no op falling back."""

import pytest
import torch
import torch.nn.functional as F

from test_backend import compare, tessera_graphs

R = lambda *s: torch.randn(*s)  # noqa: E731
P = lambda *s: torch.rand(*s) + 0.5  # noqa: E731  (positive: log, sqrt, pow)

CASES = {
    "add_sub_alpha": (lambda a, b: torch.add(a, b, alpha=2.0) - torch.sub(b, a, alpha=0.5) - 1.5, [R(3, 4), R(4)]),
    "rsub_scalar": (lambda a: 2.0 - a, [R(5)]),
    "mul_div": (lambda a, b: a * b / (b * b + 1.0) * 3.0, [R(3, 4), R(3, 1)]),
    "neg_abs": (lambda a: -a.abs() + a, [R(6)]),
    "exp_log_sqrt_rsqrt": (lambda a: a.exp() + a.log() + a.sqrt() + a.rsqrt() + a.reciprocal(), [P(2, 5)]),
    "sin_cos_tanh_sigmoid_silu": (lambda a: a.sin() * a.cos() + a.tanh() + a.sigmoid() + F.silu(a), [R(7)]),
    "relu_gelu_gelu_tanh": (lambda a: F.relu(a) + F.gelu(a) + F.gelu(a, approximate="tanh"), [R(4, 4)]),
    "pow_scalar_tensor": (lambda a, b: a**2.5 + torch.pow(a, b), [P(5), P(5)]),
    "maximum_minimum_clamp": (lambda a, b: torch.maximum(a, b) + torch.minimum(a, b) + a.clamp(-0.5, 0.5), [R(6), R(6)]),
    "clamp_tensor_bounds": (lambda a, b: a.clamp(min=b) + a.clamp(max=b) + a.clamp(b - 1, b[:1] + 1), [R(3, 6), R(6)]),
    "where_compare": (lambda a, b: torch.where(a > b, a, b * 2) + (a <= 0.1).float() + (a != b).to(a.dtype), [R(8), R(8)]),
    "sum_mean_dims": (lambda a: a.sum(dim=1) + a.mean(dim=(0, 1), keepdim=True).squeeze(0) + a.sum(), [R(3, 4, 5)]),
    "amax_amin": (lambda a: a.amax(dim=-1) - a.amin(dim=0).sum(), [R(4, 6)]),
    "softmax_log_softmax": (lambda a: F.softmax(a, dim=-1) * F.log_softmax(a, dim=0), [R(3, 5)]),
    "mm_bmm_matmul": (lambda a, b, c: (a @ b).sum() + torch.bmm(c, c.transpose(1, 2)).sum(), [R(3, 4), R(4, 2), R(2, 3, 4)]),
    "linear_addmm": (lambda x, w, b: F.linear(x, w, b), [R(5, 3), R(4, 3), R(4)]),
    "matmul_broadcast": (lambda a, b: torch.matmul(a, b), [R(2, 3, 4), R(4, 5)]),
    "view_permute_transpose": (lambda a: a.view(6, 4).t().reshape(2, 12).transpose(0, 1).permute(1, 0).contiguous(), [R(2, 3, 4)]),
    "expand_unsqueeze_squeeze": (lambda a: a.unsqueeze(0).expand(3, 4, 5).squeeze() * 1.0, [R(4, 5)]),
    "slice_cat_split": (lambda a: torch.cat([a[:, 1:3], a[:, ::1][:, :2], *a.split(2, dim=1)], dim=1), [R(3, 4)]),
    "chunk_unbind_stack": (lambda a: torch.stack([x * i for i, x in enumerate(a.unbind(0))], dim=1) + a.chunk(2, 1)[0].sum(), [R(3, 4)]),
    "constant_pad_crop": (lambda a: F.pad(a, (1, 2, -1, 0), value=1.5) + F.pad(a, (0, 0, 0, 0, 1, 1))[1:3].sum(), [R(2, 3, 4)]),
    "tril_triu": (lambda a: a.tril() + a.triu(1) * 2, [R(4, 4)]),
    "masked_fill_causal": (lambda a: a.masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf")).softmax(-1), [R(2, 4, 4)]),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (6,), w, b), [R(3, 6), R(6), R(6)]),
    "cross_entropy": (lambda x: F.cross_entropy(x, torch.tensor([1, 0, 3])), [R(3, 4)]),
    "nll_loss_sum_ignore": (lambda x: F.nll_loss(F.log_softmax(x, -1), torch.tensor([1, -100, 3]), reduction="sum"), [R(3, 4)]),
    "embedding": (lambda w: F.embedding(torch.tensor([[0, 2], [2, 1]]), w), [R(3, 4)]),
    "embedding_padding": (lambda w: F.embedding(torch.tensor([0, 2, 1]), w, padding_idx=1), [R(3, 4)]),
    "gather_index_select": (lambda a: a.gather(1, torch.tensor([[0, 2], [1, 1]])) + a.index_select(1, torch.tensor([2, 0])), [R(2, 3)]),
    "arange_full_zeros": (lambda a: a + torch.arange(4.0) + torch.zeros(4) + torch.full((4,), 2.0) + torch.ones_like(a), [R(4)]),
    "to_dtype": (lambda a: (a.to(torch.float64) * 2).to(torch.float32) + a.double().float(), [R(5)]),
    "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), [R(1, 2, 4, 3), R(1, 2, 4, 3), R(1, 2, 4, 3)]),
    "sdpa_causal_scale": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3),
        [R(1, 2, 4, 3), R(1, 2, 4, 3), R(1, 2, 4, 3)],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_matches_eager(name, fallbacks):
    fn, inputs = CASES[name]
    compare(fn, inputs)
    assert fallbacks() == [], f"{name}: {fallbacks()}"
    assert tessera_graphs(), f"{name}: no graph ran on tessera"


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_float_dtypes(dtype):
    tol = {torch.float64: 1e-10, torch.bfloat16: 2e-2}[dtype]
    x, w = torch.randn(4, 6, dtype=dtype), torch.randn(6, 3, dtype=dtype)
    compare(lambda x, w: F.softmax(torch.tanh(x @ w), -1), [x, w], atol=tol, rtol=tol)
