"""tessera, a deep-learning graph compiler, from Python.

- ``torch.compile(model, backend="tessera")``: see :mod:`tessera.torch`;
- ``tessera.hints('{"order": "strict"}')``: context hints for the ops traced
  inside a block (see :mod:`tessera._hints`);
- ``tessera.CompiledGraph``: a graph in tessera's text form, compiled;
- ``tessera.Tensor``: a tessera tensor (``from_dlpack``/``to_dlpack``);
- ``tessera.cuda_is_available()`` and the ``cuda_*`` functions: tessera's
  CUDA backend (opened when a CUDA tensor first crosses), its GPU memory
  (``cuda_allocator_stats``: whose allocator serves it, PyTorch's by
  default under ``tessera.torch``).
"""

from ._tessera import (  # noqa: F401
    CompiledGraph,
    Tensor,
    TesseraError,
    __version__,
    check_hints,
    cuda_allocator_stats,
    cuda_describe,
    cuda_is_available,
    cuda_memory_stats,
    cuda_reset_peak_memory,
    cuda_synchronize,
    dtypes,
    memory_stats,
    reset_peak_memory,
)
from ._hints import hints  # noqa: F401


def _register_torch_backend():
    try:
        import torch  # noqa: F401
    except ImportError:
        return
    from . import torch as _backend

    _backend.register()


_register_torch_backend()
