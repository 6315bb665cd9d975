"""CUDA tensors under backend="tessera" (they cross through the host:
tessera-py runs tessera's CPU backend). Run on a GPU machine with
TESSERA_CUDA_TESTS=1."""

import os

import pytest
import torch

from test_backend import MLP, compare, tessera_graphs

pytestmark = pytest.mark.skipif(
    os.environ.get("TESSERA_CUDA_TESTS") != "1" or not torch.cuda.is_available(),
    reason="needs TESSERA_CUDA_TESTS=1 and a CUDA device",
)


def test_mlp_on_cuda_matches_eager_and_stays_on_cuda(fallbacks):
    m = MLP().cuda()
    x = torch.randn(8, 12, device="cuda")
    compiled = compare(m, [x], list(m.parameters()))
    assert compiled(x).device.type == "cuda"
    assert [p.grad.device.type for p in m.parameters()] == ["cuda"] * len(list(m.parameters()))
    assert fallbacks() == [] and tessera_graphs()
