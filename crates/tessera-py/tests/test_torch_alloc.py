"""What tessera needs to borrow PyTorch's CUDA caching allocator, checked
without a GPU: the AOTInductor shim's symbols in this PyTorch, and the
switch (the GPU cases are in test_cuda.py)."""

import os

import pytest
import torch

import tessera
from tessera import _torch_cuda


def test_the_shims_symbols_are_found_in_this_pytorch():
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    if not os.path.exists(os.path.join(lib, "libtorch_cuda.so")):
        with pytest.raises(LookupError, match="aoti_torch_create_cuda_stream_guard"):
            _torch_cuda.symbol_addresses()
        return
    found = _torch_cuda.symbol_addresses()
    assert sorted(found) == sorted(tessera._tessera.torch_allocator_symbols())
    assert all(isinstance(a, int) and a > 0 for a in found.values())
    assert len(set(found.values())) == len(found), "each symbol its own function"


@pytest.mark.parametrize("value, wanted", [(None, True), ("1", True), ("0", False), ("off", False), ("False", False)])
def test_the_environment_turns_torchs_allocator_off(monkeypatch, value, wanted):
    if value is None:
        monkeypatch.delenv(_torch_cuda.ENV, raising=False)
    else:
        monkeypatch.setenv(_torch_cuda.ENV, value)
    assert _torch_cuda._wanted() is wanted


def test_cpu_graphs_run_without_touching_cuda():
    """A graph on host tensors needs no stream and no allocator."""
    f = torch.compile(lambda a: torch.relu(a) * 2.0, backend="tessera")
    x = torch.randn(4, 5)
    torch.testing.assert_close(f(x), torch.relu(x) * 2.0)
    if not tessera.cuda_is_available():
        assert _torch_cuda._state["on"] is None, "no GPU call, no allocator decided"
