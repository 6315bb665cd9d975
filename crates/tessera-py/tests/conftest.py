import logging

import pytest

torch = pytest.importorskip("torch")
import tessera  # noqa: E402
import tessera.torch  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_backend():
    """Each test starts with no compiled frames, partitions or logged fallbacks."""
    tessera.torch.reset()
    torch.manual_seed(0)
    yield
    tessera.torch.reset()


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def fallbacks():
    """The fallback lines the "tessera" logger writes during the test."""
    handler = _Collect()
    logger = logging.getLogger("tessera")
    logger.addHandler(handler)

    def lines():
        return [m for m in handler.messages if "runs in PyTorch" in m]

    yield lines
    logger.removeHandler(handler)
