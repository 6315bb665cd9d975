"""tessera's CUDA backend inside a PyTorch process: its device memory from
PyTorch's caching allocator, and the stream each call is ordered with.

Two caching allocators in one process each keep the blocks they freed,
which the other cannot reuse: under ``torch.compile(backend="tessera")`` a
training step's peak was the sum of both pools. So, on the first call that
runs on the GPU, tessera is handed PyTorch's allocator (``install``): every
block tessera allocates is PyTorch's (``torch.cuda.memory_allocated``
counts it), and the blocks it frees go back to PyTorch's pool as soon as
PyTorch's stream is ordered after tessera's work on them (at the end of
each call; see ``tessera_cuda::ExternalAllocator``).

The allocator is reached through the C shim PyTorch ships for AOTInductor
(no GIL per block; ``src/torch_alloc.rs`` says why), whose symbols are
found here with ctypes in torch's own libraries.

``TESSERA_TORCH_ALLOCATOR=0`` (or ``use_torch_allocator(False)``) keeps
tessera's own allocator.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from . import _tessera

log = logging.getLogger("tessera")

ENV = "TESSERA_TORCH_ALLOCATOR"

#: None until the first GPU call decides; then True when PyTorch's
#: allocator serves tessera, False when tessera's own does.
_state = {"on": None}


def _wanted():
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def symbol_addresses():
    """{symbol: address} of the shim functions tessera calls, in the
    PyTorch of this process; LookupError naming the ones not found."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    wanted = _tessera.torch_allocator_symbols()
    found = {}
    for name in ("libtorch_cpu.so", "libtorch_cuda.so", "libtorch.so"):
        path = os.path.join(lib, name)
        if not os.path.exists(path):
            continue
        handle = ctypes.CDLL(path)  # already loaded by torch: the same library
        for symbol in wanted:
            if symbol not in found and hasattr(handle, symbol):
                found[symbol] = ctypes.cast(getattr(handle, symbol), ctypes.c_void_p).value
    missing = [s for s in wanted if s not in found]
    if missing:
        raise LookupError(f"PyTorch {torch.__version__} in {lib} lacks {missing}")
    return found


def use_torch_allocator(enabled=True):
    """tessera's CUDA memory from PyTorch's caching allocator (True) or
    tessera's own (False), from now on; returns whether PyTorch's serves.
    Blocks alive keep their allocator until freed."""
    if not enabled:
        _tessera.cuda_use_own_allocator()
        _state["on"] = False
        return False
    try:
        _tessera.cuda_use_torch_allocator(symbol_addresses())
    except (LookupError, OSError, _tessera.TesseraError) as e:
        log.warning("tessera: CUDA memory from tessera's own allocator, not PyTorch's: %s", e)
        _state["on"] = False
        return False
    _state["on"] = True
    return True


def ensure():
    """On the first GPU call: PyTorch's allocator for tessera, unless
    ``TESSERA_TORCH_ALLOCATOR=0`` or a ``use_torch_allocator`` call said."""
    if _state["on"] is None:
        use_torch_allocator(_wanted())


def current_stream():
    """PyTorch's current stream on GPU 0, as the integer ``CUstream``."""
    return torch.cuda.current_stream(torch.device("cuda", 0)).cuda_stream
