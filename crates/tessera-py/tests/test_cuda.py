"""CUDA tensors under backend="tessera": they cross without a copy and run
on tessera's CUDA backend, ordered with PyTorch's stream by events. Run on a
GPU machine with TESSERA_CUDA_TESTS=1."""

import gc
import os

import pytest
import torch
import torch.nn.functional as F

import tessera
from test_backend import MLP, Block, compare, graph_texts, steps_match_eager, tessera_graphs
from test_cnn import CASES as CNN_CASES
from test_cnn import conv_batch_norm_pools_match_eager, train_steps_match_eager
from tessera.seed import PySDPA

pytestmark = pytest.mark.skipif(
    os.environ.get("TESSERA_CUDA_TESTS") != "1" or not torch.cuda.is_available(),
    reason="needs TESSERA_CUDA_TESTS=1 and a CUDA device",
)


@pytest.fixture
def on_tessera_gpu():
    """Checks that the test's graphs ran on tessera's GPU allocator, not
    through the host: tessera's GPU peak grows, its host peak does not."""
    assert tessera.cuda_is_available(), "tessera's CUDA backend opens on this machine"
    tessera.cuda_synchronize()
    tessera.cuda_reset_peak_memory()
    tessera.reset_peak_memory()
    host0, _ = tessera.memory_stats()
    yield
    tessera.cuda_synchronize()
    _, gpu_peak = tessera.cuda_memory_stats()
    _, host_peak = tessera.memory_stats()
    assert gpu_peak > 0, "tessera allocated GPU memory"
    # Scalars and small constants may live on the host; no activation does.
    assert host_peak - host0 < 64 * 1024, f"tessera's host peak grew by {host_peak - host0} bytes"


def test_dlpack_shares_gpu_memory_both_ways():
    x = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    t = tessera.Tensor.from_dlpack(torch.utils.dlpack.to_dlpack(x))
    assert (t.shape, t.dtype, t.device) == ([3, 4], "f32", "cuda")
    x[0, 0] = 42.0
    torch.cuda.synchronize()
    assert t.to_list()[0] == 42.0, "tessera reads torch's GPU memory, not a copy"
    back = torch.utils.dlpack.from_dlpack(t.to_dlpack())
    assert back.device.type == "cuda" and back.data_ptr() == x.data_ptr()
    xt = x.t()
    tt = tessera.Tensor.from_dlpack(torch.utils.dlpack.to_dlpack(xt))
    assert tt.to_list() == xt.reshape(-1).tolist(), "a strided view crosses with its strides"
    for dtype in (torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.bool):
        y = (torch.arange(6, device="cuda") % 2).to(dtype)
        z = torch.utils.dlpack.from_dlpack(tessera.Tensor.from_dlpack(torch.utils.dlpack.to_dlpack(y)).to_dlpack())
        assert z.dtype == dtype and z.device.type == "cuda" and torch.equal(z, y)
    empty = tessera.Tensor.from_dlpack(torch.utils.dlpack.to_dlpack(torch.zeros(0, 3, device="cuda")))
    assert empty.shape == [0, 3] and empty.device == "cuda"


def test_mlp_on_cuda_matches_eager_and_stays_on_cuda(fallbacks, on_tessera_gpu):
    m = MLP().cuda()
    x = torch.randn(8, 12, device="cuda")
    compiled = compare(m, [x], list(m.parameters()))
    assert compiled(x).device.type == "cuda"
    assert [p.grad.device.type for p in m.parameters()] == ["cuda"] * len(list(m.parameters()))
    assert fallbacks() == [], fallbacks()
    assert tessera_graphs()


@pytest.mark.parametrize("sdpa", [False, True])
def test_transformer_block_on_cuda_trains_like_eager(sdpa, fallbacks, on_tessera_gpu):
    m = Block(sdpa=sdpa).cuda()
    ids = torch.randint(0, 11, (3, 8), device="cuda")
    targets = torch.randint(0, 11, (3, 8), device="cuda")
    compare(lambda: m(ids, targets), [], list(m.parameters()), atol=1e-4, rtol=1e-4)
    assert fallbacks() == [], fallbacks()


@pytest.mark.parametrize("foreach", [None, False])
def test_training_steps_with_adamw_on_cuda_match_eager(foreach, fallbacks, on_tessera_gpu):
    """AdamW's default on CUDA (foreach=None: the multi-tensor `_foreach_*`
    ops, decomposed per tensor by tessera._foreach) and its single-tensor
    path: the whole step runs on tessera."""
    steps_match_eager("AdamW", device="cuda", atol=1e-4, eps=1e-3, foreach=foreach)
    assert fallbacks() == [], fallbacks()


@pytest.mark.parametrize("with_slice", [False, True])
def test_seed_attention_on_cuda_matches_eager(with_slice, fallbacks, on_tessera_gpu):
    qkv = [torch.randn(2, 3, 16, 8, device="cuda") for _ in range(3)]
    compare(lambda q, k, v: PySDPA.apply(q, k, v, False, with_slice), qkv, atol=1e-4, rtol=1e-4)
    assert fallbacks() == [], fallbacks()


def test_work_queued_on_torchs_stream_is_seen_by_tessera(on_tessera_gpu):
    """PyTorch's writes on its own (non-default) stream before the call and
    its reads after are ordered with tessera's stream: no host sync between."""
    f = torch.compile(lambda a, b: F.gelu(a @ b) * 2.0, backend="tessera")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        a = torch.randn(512, 512, device="cuda")
        b = torch.randn(512, 512, device="cuda")
        f(a, b)  # compile outside the measured sequence
        for _ in range(3):
            # A spin of ~50 ms on `side`, then the write: unordered, tessera's
            # kernels would read `a` before the write lands.
            torch.cuda._sleep(50_000_000)
            a.mul_(1.5)
            got = f(a, b).sum()
            want = (F.gelu(a @ b) * 2.0).sum()
    torch.cuda.synchronize()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-2)


def test_a_host_scalar_next_to_gpu_tensors_goes_to_the_gpu(fallbacks, on_tessera_gpu):
    scale = torch.tensor(3.0)  # a 0-dim CPU tensor, as PyTorch allows with CUDA tensors

    def f(x):
        return torch.relu(x) * scale

    x = torch.randn(5, 7, device="cuda")
    got = torch.compile(f, backend="tessera")(x)
    assert got.device.type == "cuda"
    torch.testing.assert_close(got, f(x))


@pytest.fixture
def no_tf32():
    """PyTorch's cuDNN convolutions default to TF32 (10-bit mantissas):
    eager's CNN reference then differs from f32 by ~1e-3. Off for the test."""
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("fn, inputs, forward_op, backward_ops", [c[1:] for c in CNN_CASES], ids=[c[0] for c in CNN_CASES])
def test_cnn_op_on_cuda_matches_eager(fn, inputs, forward_op, backward_ops, fallbacks, on_tessera_gpu, no_tf32):
    compare(fn, [t.cuda() for t in inputs], atol=1e-4, rtol=1e-4)
    assert fallbacks() == [], fallbacks()
    assert any(forward_op in t for t in graph_texts("forward")), graph_texts("forward")


def test_cnn_bf16_on_cuda_matches_eager(fallbacks, on_tessera_gpu):
    conv_batch_norm_pools_match_eager(torch.bfloat16, 3e-2, device="cuda")
    assert fallbacks() == [], fallbacks()


@pytest.mark.parametrize("optimizer, options", [("SGD", {"momentum": 0.9}), ("AdamW", {"eps": 1e-3})])
def test_small_resnet_on_cuda_trains_like_eager(optimizer, options, fallbacks, on_tessera_gpu, no_tf32):
    """Forward, backward, batch norms' running statistics and the
    optimizer's update (AdamW: its foreach path, CUDA's default) on
    tessera's CUDA backend; then eval mode."""
    train_steps_match_eager(optimizer, device="cuda", atol=5e-4, **options)
    assert fallbacks() == [], fallbacks()


# -- tessera's memory from PyTorch's caching allocator ---------------------------


def _deep(x, w):
    """Eight tanh(x·w) layers: intermediates of x's size in tessera's arena,
    tens of ms of kernels at 4096² (a window for an unordered write)."""
    for _ in range(8):
        x = torch.tanh(x @ w)
    return x


@pytest.fixture
def no_gc():
    """No earlier test's garbage is collected during the test (its blocks
    would move the memory counts)."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.fixture
def torch_allocator(no_gc):
    """PyTorch's caching allocator serves tessera (the default), restored
    after the test."""
    assert tessera.torch.use_torch_allocator(True), "the shim's symbols are found in this PyTorch"
    yield
    tessera.torch.use_torch_allocator(True)


def test_tessera_runs_on_memory_from_torchs_allocator(torch_allocator, on_tessera_gpu):
    f = torch.compile(_deep, backend="tessera")
    x = torch.randn(1024, 1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda") / 32
    f(x, w)  # compiled outside the measurement
    torch.cuda.synchronize()
    assert tessera.cuda_allocator_stats()["allocator"] == "PyTorch's caching allocator"
    before = tessera.cuda_allocator_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = f(x, w)
    torch.cuda.synchronize()
    after = tessera.cuda_allocator_stats()
    out_bytes = got.numel() * 4
    # The output is PyTorch's memory; the intermediates (tessera's arena)
    # showed in PyTorch's peak; nothing else stays allocated.
    assert torch.cuda.memory_allocated() - base == pytest.approx(out_bytes, abs=4096)
    assert torch.cuda.max_memory_allocated() - base >= 2 * out_bytes
    assert after["external_allocs"] > before["external_allocs"]
    assert after["external_allocs"] - before["external_allocs"] == after["external_frees"] - before["external_frees"] + 1
    assert after["cached_bytes"] == 0, "tessera keeps no block PyTorch could reuse"
    torch.testing.assert_close(got, _deep(x, w), rtol=1e-4, atol=1e-4)
    del got
    assert torch.cuda.memory_allocated() == base, "the output's block went back to PyTorch"


def test_tesseras_own_allocator_is_kept_when_asked(no_gc, on_tessera_gpu):
    try:
        assert tessera.torch.use_torch_allocator(False) is False
        f = torch.compile(lambda a: torch.relu(a) * 2.0, backend="tessera")
        x = torch.randn(512, 512, device="cuda")
        f(x)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        got = f(x)
        torch.cuda.synchronize()
        assert tessera.cuda_allocator_stats()["allocator"] == "tessera"
        assert torch.cuda.memory_allocated() == base, "tessera's output is not PyTorch's memory"
        torch.testing.assert_close(got, torch.relu(x) * 2.0)
    finally:
        tessera.torch.use_torch_allocator(True)
    # The output allocated before the switch goes back to tessera's cache.
    del got


@pytest.mark.parametrize("side_stream", [False, True])
def test_a_block_tessera_frees_is_reused_by_torch_only_after_tesseras_work(side_stream, torch_allocator, on_tessera_gpu):
    """Right after a call (no host sync) PyTorch allocates the blocks tessera
    freed and writes NaN over them on its stream; tessera's kernels, still
    queued, read their intermediates there: unordered, the NaNs would land
    in the result."""
    n = 4096
    f = torch.compile(_deep, backend="tessera")
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        x = torch.randn(n, n, device="cuda")
        w = torch.randn(n, n, device="cuda") / 64
        want = _deep(x, w)
        f(x, w)  # compiled
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reused = 0
        for _ in range(3):
            got = f(x, w)
            # Free blocks in PyTorch's pool now: the ones tessera gave back.
            freed = {
                b["address"]: b["size"]
                for seg in torch.cuda.memory_snapshot()
                if seg["stream"] == stream.cuda_stream
                for b in seg["blocks"]
                if b["state"] == "inactive" and b["size"] >= n * n * 4
            }
            junk = [torch.empty(size // 4, device="cuda").fill_(float("nan")) for size in freed.values()]
            reused += sum(j.data_ptr() in freed for j in junk)
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
            del junk, got
    assert reused > 0, "PyTorch reused blocks tessera freed"
