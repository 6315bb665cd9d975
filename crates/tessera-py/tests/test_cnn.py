"""CNN ops under torch.compile(backend="tessera") against eager PyTorch:
convolution (bias, stride, padding, dilation, groups, depthwise), max and
average pooling (padding, ceil_mode, dilation, count_include_pad,
divisor_override), global average pooling and batch norm (train, with its
running statistics, and eval), values and gradients, each running on
tessera's CNN ops with nothing falling back; and a small ResNet trained a
few steps as eager trains it."""

import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tessera.torch
from test_backend import assert_close_all, compare, graph_texts, values_and_grads

R = torch.randn

# PyTorch warns that an even kernel's "same" padding copies the input.
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same'")


def conv(stride=1, padding=0, dilation=1, groups=1, bias=True):
    def f(x, w, *b):
        return F.conv2d(x, w, b[0] if b else None, stride, padding, dilation, groups)

    return f


def conv_inputs(n, c, h, w, o, k, groups=1, bias=True, dtype=torch.float32):
    kh, kw = (k, k) if isinstance(k, int) else k
    ts = [R(n, c, h, w), R(o, c // groups, kh, kw)] + ([R(o)] if bias else [])
    return [t.to(dtype) for t in ts]


# (id, fn, inputs, the tessera ops the forward and the backward must hold)
CONV = "tessera::conv2d"
CONV_BW = ("tessera::conv2d_backward_input", "tessera::conv2d_backward_weight")
CASES = [
    ("conv_bias", conv(), conv_inputs(2, 3, 6, 7, 4, 3), CONV, CONV_BW),
    ("conv_no_bias_stride_pad", conv(2, 1, bias=False), conv_inputs(2, 3, 9, 8, 5, 3, bias=False), CONV, CONV_BW),
    ("conv_uneven_pad_dilation", conv(1, (2, 1), 2), conv_inputs(1, 2, 7, 9, 3, (3, 2)), CONV, CONV_BW),
    ("conv_groups", conv(1, 1, 1, 2), conv_inputs(2, 4, 5, 5, 6, 3, groups=2), CONV, CONV_BW),
    ("conv_depthwise_x2", conv((2, 1), 1, 1, 4), conv_inputs(2, 4, 7, 6, 8, 3, groups=4), CONV, CONV_BW),
    ("conv_same_even_kernel", lambda x, w: F.conv2d(x, w, padding="same"), conv_inputs(2, 3, 7, 8, 4, (4, 2), bias=False),
     CONV, CONV_BW),
    ("conv_1x1_stride2", conv(2), conv_inputs(3, 5, 5, 5, 2, 1), CONV, CONV_BW),
    ("max_pool_k2", lambda x: F.max_pool2d(x, 2), [R(2, 3, 8, 6)], "tessera::max_pool2d",
     ("tessera::max_pool2d_backward",)),
    ("max_pool_k3_s2_p1_overlap", lambda x: F.max_pool2d(x, 3, 2, 1), [R(2, 3, 9, 7)], "tessera::max_pool2d",
     ("tessera::max_pool2d_backward",)),
    ("max_pool_ceil_dilation", lambda x: F.max_pool2d(x, (3, 2), (2, 1), (1, 0), dilation=(1, 2), ceil_mode=True),
     [R(1, 2, 8, 7)], "tessera::max_pool2d", ("tessera::max_pool2d_backward",)),
    ("max_pool_after_relu_ties", lambda x: F.max_pool2d(F.relu(x - 1.0), 2, 1), [R(2, 2, 5, 5)],
     "tessera::max_pool2d", ("tessera::max_pool2d_backward",)),
    ("avg_pool_k2", lambda x: F.avg_pool2d(x, 2), [R(2, 3, 6, 7)], "tessera::avg_pool2d",
     ("tessera::avg_pool2d_backward",)),
    ("avg_pool_pad_exclude_ceil", lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
     [R(2, 2, 8, 7)], "tessera::avg_pool2d", ("tessera::avg_pool2d_backward",)),
    ("avg_pool_ceil_include_pad", lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True), [R(1, 2, 8, 6)],
     "tessera::avg_pool2d", ("tessera::avg_pool2d_backward",)),
    ("avg_pool_divisor_override", lambda x: F.avg_pool2d(x, (2, 3), 1, (1, 1), divisor_override=5),
     [R(1, 3, 5, 6)], "tessera::avg_pool2d", ("tessera::avg_pool2d_backward",)),
    ("global_avg_pool", lambda x: F.adaptive_avg_pool2d(x, (1, 1)).flatten(1) + x.mean((2, 3)), [R(2, 5, 4, 3)],
     "mean", ("expand",)),
    ("adaptive_avg_pool_divisible", lambda x: F.adaptive_avg_pool2d(x, (2, 3)), [R(2, 3, 6, 9)],
     "tessera::avg_pool2d", ("tessera::avg_pool2d_backward",)),
]  # fmt: skip


@pytest.mark.parametrize("fn, inputs, forward_op, backward_ops", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_cnn_op_matches_eager(fn, inputs, forward_op, backward_ops, fallbacks):
    compare(fn, inputs)
    assert fallbacks() == [], fallbacks()
    assert any(forward_op in t for t in graph_texts("forward")), graph_texts("forward")
    for op in backward_ops:
        assert any(op in t for t in graph_texts("backward")), (op, graph_texts("backward"))


def random_conv_case(rng):
    """A convolution of random geometry (odd sizes, stride, padding,
    dilation, groups) that PyTorch accepts."""
    groups = rng.choice([1, 1, 2, 3])
    c, o = groups * rng.randint(1, 3), groups * rng.randint(1, 3)
    kh, kw = rng.randint(1, 4), rng.randint(1, 4)
    dilation = (rng.randint(1, 2), rng.randint(1, 2))
    padding = (rng.randint(0, 2), rng.randint(0, 2))
    stride = (rng.randint(1, 3), rng.randint(1, 3))
    h = dilation[0] * (kh - 1) + 1 + rng.randint(0, 6)
    w = dilation[1] * (kw - 1) + 1 + rng.randint(0, 6)
    bias = rng.random() < 0.5
    return conv(stride, padding, dilation, groups, bias), conv_inputs(rng.randint(1, 3), c, h, w, o, (kh, kw), groups, bias)


def conv_batch_norm_pools_match_eager(dtype, tol, device="cpu"):
    def f(x, w, b, gamma, beta):
        h = F.batch_norm(F.conv2d(x, w, b, 1, 1), None, None, gamma, beta, training=True)
        return F.max_pool2d(h, 2) + F.avg_pool2d(h, 2)

    x, w, b = conv_inputs(2, 3, 6, 6, 4, 3)
    inputs = [x, w * 0.3, b, R(4), R(4)]
    compare(f, [t.to(device, dtype) for t in inputs], atol=tol, rtol=tol)


def random_pool_case(rng):
    """A max or average pool of random geometry that PyTorch accepts."""
    k = [rng.randint(1, 4), rng.randint(1, 4)]
    stride = [rng.randint(1, 3), rng.randint(1, 3)]
    padding = [rng.randint(0, kk // 2) for kk in k]
    ceil_mode = rng.random() < 0.5
    x = R(rng.randint(1, 3), rng.randint(1, 3), k[0] + rng.randint(0, 6), k[1] + rng.randint(0, 6))
    if rng.random() < 0.5:
        dilation = [rng.randint(1, 2), rng.randint(1, 2)]
        x = R(*x.shape[:2], x.shape[2] + k[0] * dilation[0], x.shape[3] + k[1] * dilation[1])
        return (lambda x: F.max_pool2d(x, k, stride, padding, dilation, ceil_mode)), [x]
    include, divisor = rng.random() < 0.5, rng.choice([None, 3])
    return (lambda x: F.avg_pool2d(x, k, stride, padding, ceil_mode, include, divisor)), [x]


@pytest.mark.parametrize("make_case, seed, count", [(random_conv_case, 19, 6), (random_pool_case, 5, 8)], ids=["conv", "pool"])
def test_random_geometries_match_eager(make_case, seed, count, fallbacks):
    rng = random.Random(seed)
    for _ in range(count):
        tessera.torch.reset()
        fn, inputs = make_case(rng)
        compare(fn, inputs)
    assert fallbacks() == [], fallbacks()


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.bfloat16, 3e-2)])
def test_conv_batch_norm_and_pools_in_other_float_dtypes(dtype, tol, fallbacks):
    conv_batch_norm_pools_match_eager(dtype, tol)
    assert fallbacks() == [], fallbacks()


def test_batch_norm_train_and_eval_match_eager_with_running_stats(fallbacks):
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(5, momentum=0.3)
    bn = nn.BatchNorm2d(5, momentum=0.3)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.normal_()
    bn.load_state_dict(ref.state_dict())
    compiled = torch.compile(bn, backend="tessera")
    for mode in ("train", "train", "eval"):
        ref.train(mode == "train")
        bn.train(mode == "train")
        x = R(3, 5, 4, 6) * 2 + 1
        want = values_and_grads(ref, [x], list(ref.parameters()))
        got = values_and_grads(compiled, [x], list(bn.parameters()))
        assert_close_all(got[0], want[0])
        assert_close_all(got[1], want[1])
        for b, r in zip(bn.buffers(), ref.buffers()):
            torch.testing.assert_close(b, r)
    assert ref.num_batches_tracked.item() == 2
    assert fallbacks() == [], fallbacks()


def test_what_tessera_lacks_falls_back_with_the_reason(fallbacks):
    # A transposed convolution, a 1-D one and an adaptive pool of windows of
    # varying size run in PyTorch, logged with why; the values stay eager's.
    # (A fallback is logged once per op: reset between the two.)
    compare(lambda x, w: F.conv_transpose2d(x, w, stride=2), [R(1, 2, 4, 4), R(2, 3, 3, 3)])
    assert any("aten.convolution" in line and "transposed" in line for line in fallbacks()), fallbacks()
    tessera.torch.reset()
    compare(lambda x, w: F.conv1d(x, w, padding=1), [R(2, 3, 9), R(4, 3, 3)])
    assert any("aten.convolution" in line and "rank 3" in line for line in fallbacks()), fallbacks()
    compare(lambda x: F.adaptive_avg_pool2d(x, (2, 3)), [R(1, 2, 5, 7)])
    assert any("_adaptive_avg_pool2d" in line and "must divide" in line for line in fallbacks()), fallbacks()


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block: two 3x3 convs with batch norm, a
    strided 1x1 projection on the shortcut."""

    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.down(x))


class SmallResNet(nn.Module):
    """Stem (conv with bias, BN, ReLU, 3x3/2 max pool), a basic block, a
    depthwise-separable stage, average and global average pooling, a
    linear head."""

    def __init__(self, classes=5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        self.block = BasicBlock(8, 12, 2)
        self.dw = nn.Conv2d(12, 12, 3, 1, 2, dilation=2, groups=12)
        self.pw = nn.Conv2d(12, 16, 1)
        self.pool = nn.AvgPool2d(2, ceil_mode=True)
        self.gap = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        h = self.block(self.stem(x))
        h = self.pool(F.relu(self.pw(self.dw(h))))
        return self.fc(self.gap(h).flatten(1))


def train_steps_match_eager(optimizer, device="cpu", atol=1e-5, steps=3, **options):
    """`steps` training steps (forward, cross-entropy, backward, the
    optimizer) of SmallResNet compiled with backend="tessera" against
    eager: the losses, the parameters and the batch norms' running
    statistics; then an eval-mode forward."""
    torch.manual_seed(0)
    ref = SmallResNet().to(device)
    m = SmallResNet().to(device)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(4, 3, 15, 13, device=device)
    y = torch.randint(0, 5, (4,), device=device)

    def make_step(model):
        opt = getattr(torch.optim, optimizer)(model.parameters(), lr=0.05, **options)

        def step():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        return step

    eager, compiled = make_step(ref), torch.compile(make_step(m), backend="tessera")
    for _ in range(steps):
        torch.testing.assert_close(compiled(), eager(), atol=atol, rtol=1e-4)
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=atol, rtol=1e-4)
    for b, r in zip(m.buffers(), ref.buffers()):
        torch.testing.assert_close(b, r, atol=atol, rtol=1e-4)
    m.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(m, backend="tessera")(x), ref(x), atol=atol, rtol=1e-4)


@pytest.mark.parametrize("optimizer, options", [("SGD", {"momentum": 0.9}), ("AdamW", {"eps": 1e-3})])
def test_small_resnet_trains_like_eager(optimizer, options, fallbacks):
    train_steps_match_eager(optimizer, **options)
    assert fallbacks() == [], fallbacks()
    forward, backward = "\n".join(graph_texts("forward")), "\n".join(graph_texts("backward"))
    for op in ("tessera::conv2d", "tessera::max_pool2d", "tessera::avg_pool2d"):
        assert op in forward, op
    for op in ("conv2d_backward_input", "conv2d_backward_weight", "max_pool2d_backward", "avg_pool2d_backward"):
        assert op in backward, op


def test_a_symbolic_batch_stays_symbolic(fallbacks):
    # Batch norm's statistics over a symbolic batch need its size constant
    # (var_mean's divisor): a net without it is one graph for every batch.
    net = nn.Sequential(nn.Conv2d(3, 4, 3, 2, 1), nn.ReLU(), nn.MaxPool2d(2), nn.AvgPool2d(2), nn.Flatten())
    compiled = torch.compile(net, backend="tessera")
    for batch in (2, 3, 5):
        x = R(batch, 3, 16, 16)
        torch._dynamo.mark_dynamic(x, 0)
        got, want = values_and_grads(compiled, [x], list(net.parameters())), values_and_grads(net, [x], list(net.parameters()))
        assert_close_all(got[0], want[0])
        assert_close_all(got[1], want[1])
    compiles = [p.compiles() for p in tessera.torch.compiled_partitions()]
    assert compiles and max(compiles) == 1, compiles
    assert fallbacks() == [], fallbacks()


def test_a_symbolic_image_size_runs_in_pytorch_with_the_reason(fallbacks):
    net = nn.Sequential(nn.Conv2d(3, 4, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2))
    compiled = torch.compile(net, backend="tessera", dynamic=True)
    for batch, size in ((2, 8), (3, 10)):
        x = R(batch, 3, size, size)
        got, want = values_and_grads(compiled, [x], list(net.parameters())), values_and_grads(net, [x], list(net.parameters()))
        assert_close_all(got[0], want[0])
        assert_close_all(got[1], want[1])
    lines = fallbacks()
    for op in ("aten.convolution.default", "aten.max_pool2d_with_indices.default"):
        assert any(op in line and "the height" in line and "symbolic size" in line for line in lines), (op, lines)
