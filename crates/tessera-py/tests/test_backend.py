"""torch.compile(backend="tessera") against eager PyTorch: values and
gradients, fallbacks, hints, options, dynamic shapes."""

import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tessera
import tessera.torch
from tessera.seed import PySDPA, PySDPAHinted


def values_and_grads(fn, inputs, params=()):
    """fn's outputs and the gradients of their sum of (output · fixed
    weights) with respect to `inputs` and `params`."""
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    for p in params:
        p.grad = None
    out = fn(*inputs)
    outs = out if isinstance(out, (tuple, list)) else [out]
    gen = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o in outs)
    loss.backward()
    grads = [t.grad for t in inputs if t.requires_grad] + [p.grad for p in params]
    return [o.detach() for o in outs], [g.clone() for g in grads]


def assert_close_all(got, want, atol=1e-5, rtol=1e-4):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol)


def compare(fn, inputs, params=(), atol=1e-5, rtol=1e-4, **compile_kwargs):
    want = values_and_grads(fn, inputs, params)
    compiled = torch.compile(fn, backend="tessera", **compile_kwargs)
    got = values_and_grads(compiled, inputs, params)
    assert_close_all(got[0], want[0], atol, rtol)
    assert_close_all(got[1], want[1], atol, rtol)
    return compiled


def tessera_graphs():
    return [g for p in tessera.torch.compiled_partitions() for g in p.compiled_graphs()]


def graph_texts(kind):
    return [g.graph_text() for p in tessera.torch.compiled_partitions() if p.name.startswith(kind) for g in p.compiled_graphs()]


# -- tensors across DLPack --------------------------------------------------------


def test_dlpack_import_and_export_share_memory():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t = tessera.Tensor.from_dlpack(torch.utils.dlpack.to_dlpack(x))
    assert t.shape == [3, 4] and t.dtype == "f32"
    x[0, 0] = 42.0
    assert t.to_list()[0] == 42.0, "tessera reads torch's memory, not a copy"
    back = torch.utils.dlpack.from_dlpack(t.to_dlpack())
    assert back.data_ptr() == x.data_ptr()
    # A strided view crosses with its strides.
    xt = x.t()
    tt = tessera.Tensor.from_dlpack(torch.utils.dlpack.to_dlpack(xt))
    assert tt.to_list() == xt.reshape(-1).tolist()
    for dtype in (torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool):
        y = (torch.arange(6) % 2).to(dtype)
        z = torch.utils.dlpack.from_dlpack(tessera.Tensor.from_dlpack(torch.utils.dlpack.to_dlpack(y)).to_dlpack())
        assert z.dtype == dtype and torch.equal(z, y)


def test_dlpack_refuses_what_tessera_lacks():
    # uint8 crosses since the integer dtypes; complex numbers do not.
    t = tessera.Tensor.from_dlpack(torch.utils.dlpack.to_dlpack(torch.arange(3, dtype=torch.uint8)))
    assert t.dtype == "u8" and t.to_list() == [0, 1, 2]
    with pytest.raises(tessera.TesseraError, match="has no tessera dtype"):
        tessera.Tensor.from_dlpack(torch.utils.dlpack.to_dlpack(torch.zeros(3, dtype=torch.complex64)))
    cap = torch.utils.dlpack.to_dlpack(torch.zeros(3))
    tessera.Tensor.from_dlpack(cap)
    with pytest.raises(tessera.TesseraError, match="used once"):
        tessera.Tensor.from_dlpack(cap)


def test_graph_text_errors_name_the_line():
    bad = "graph g(%a) {\n  %a = input : f32[2,3]\n  %b = relu(%a) : f32[2,4]\n  return %b as b\n}\n"
    with pytest.raises(tessera.TesseraError, match=r"declared type f32\[2,4\].*<m.tir>:3:8"):
        tessera.CompiledGraph(bad, source="<m.tir>")


# -- models -------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(12, 32)
        self.norm = nn.LayerNorm(32)
        self.l2 = nn.Linear(32, 16)
        self.l3 = nn.Linear(16, 5)

    def forward(self, x):
        h = self.norm(F.gelu(self.l1(x)))
        h = torch.tanh(self.l2(h)) + F.relu(h[:, :16])
        return self.l3(h)


def test_mlp_with_cross_entropy_matches_eager(fallbacks):
    m = MLP()
    y = torch.randint(0, 5, (8,))

    def loss(x):
        logits = m(x)
        return F.cross_entropy(logits, y), F.softmax(logits, dim=-1), F.log_softmax(logits, dim=1)

    compare(loss, [torch.randn(8, 12)], list(m.parameters()))
    assert fallbacks() == [], "every op of the MLP and its backward runs on tessera"
    assert tessera_graphs(), "the graphs ran on tessera"


def attention(q, k, v, causal):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[-2]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return F.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("with_slice", [False, True])
def test_seed_attention_matches_eager(with_slice, fallbacks):
    qkv = [torch.randn(2, 3, 16, 8) for _ in range(3)]
    compare(lambda q, k, v: PySDPA.apply(q, k, v, False, with_slice), qkv)
    assert fallbacks() == []


class Block(nn.Module):
    """A GPT-style block: embedding, pre-norm causal attention, GELU MLP."""

    def __init__(self, vocab=11, d=16, heads=2, sdpa=False):
        super().__init__()
        self.heads = heads
        self.sdpa = sdpa
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(8, d) * 0.1)
        self.ln1, self.ln2, self.lnf = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.drop = nn.Dropout(0.0)

    def forward(self, ids, targets):
        b, n = ids.shape
        x = self.emb(ids) + self.pos[:n]
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=-1)
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        if self.sdpa:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            a = attention(q, k, v, causal=True)
        a = a.transpose(1, 2).reshape(b, n, -1)
        x = x + self.drop(self.proj(a))
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        logits = self.head(self.lnf(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


@pytest.mark.parametrize("sdpa", [False, True])
def test_transformer_block_trains_like_eager(sdpa, fallbacks):
    m = Block(sdpa=sdpa)
    ids = torch.randint(0, 11, (3, 8))
    targets = torch.randint(0, 11, (3, 8))
    compare(lambda: m(ids, targets), [], list(m.parameters()))
    assert fallbacks() == [], "embedding, layer norm, attention, gelu and their backward run on tessera"


def test_dropout_falls_back_and_the_rest_runs_on_tessera(fallbacks):
    w = torch.randn(6, 6, requires_grad=True)
    f = torch.compile(lambda x: F.dropout(torch.relu(x @ w), 0.5).sum(), backend="tessera")
    f(torch.randn(4, 6)).backward()
    assert [line for line in fallbacks() if "aten.native_dropout" in line], fallbacks()
    assert w.grad is not None and tessera_graphs()


def steps_match_eager(optimizer, device="cpu", atol=1e-5, clip=None, **options):
    """Three whole training steps of a GPT block (zero_grad, forward,
    backward, the gradients' norm clipped to `clip` when given (foreach),
    `optimizer` with `options`) compiled with backend="tessera":
    the losses and the parameters after them are eager's, and the
    optimizer's update is a tessera graph (an inference graph with an
    output per parameter at least)."""
    torch.manual_seed(0)
    ref = Block(sdpa=True).to(device)
    m = Block(sdpa=True).to(device)
    m.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 11, (2, 8), device=device)
    targets = torch.randint(0, 11, (2, 8), device=device)

    def make_step(model):
        opt = getattr(torch.optim, optimizer)(model.parameters(), lr=0.05, **options)

        def step():
            opt.zero_grad()
            loss = model(ids, targets)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
            opt.step()
            return loss.detach()

        return step

    eager, compiled = make_step(ref), torch.compile(make_step(m), backend="tessera")
    for _ in range(3):
        torch.testing.assert_close(compiled(), eager(), atol=atol, rtol=1e-4)
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=atol, rtol=1e-4)
    updates = [p for p in tessera.torch.compiled_partitions() if p.name.startswith("inference") and p.compiled_graphs()]
    assert sum(len(p.out_devices) for p in updates) >= len(list(m.parameters())), [p.name for p in updates]


# AdamW's and Adam's default eps (1e-8) turns the rounding noise of a
# gradient that is zero in exact arithmetic (the key bias: softmax ignores a
# per-row constant) into full-size updates, under any backend (aot_eager and
# Inductor differ from eager by 1e-2 there too); eps=1e-3 keeps the update a
# smooth function of the gradient.
ADAM_EPS = {"eps": 1e-3}

# Each optimizer's single-tensor path (foreach=False, the default on CPU) and
# its foreach path (`_foreach_*` ops, the default on CUDA), with the options
# that add ops to its update.
OPTIMIZERS = [
    ("SGD", {}),
    ("AdamW", ADAM_EPS),
    ("SGD", {"foreach": True, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("SGD", {"foreach": True, "momentum": 0.9, "dampening": 0.1, "maximize": True}),
    ("AdamW", {"foreach": True, **ADAM_EPS}),
    ("AdamW", {"foreach": True, "amsgrad": True, "maximize": True, **ADAM_EPS}),
    ("Adam", {"foreach": True, "weight_decay": 0.01, "amsgrad": True, **ADAM_EPS}),
    ("AdamW", {"foreach": True, "clip": 0.5, **ADAM_EPS}),
]


@pytest.mark.parametrize(
    "optimizer, options", OPTIMIZERS, ids=[f"{o}-{'-'.join(k for k in kw if k != 'eps') or 'default'}" for o, kw in OPTIMIZERS]
)
def test_training_step_with_optimizer_matches_eager(optimizer, options, fallbacks):
    steps_match_eager(optimizer, **options)
    assert fallbacks() == [], "the model, its backward and the optimizer's update run on tessera"


def test_strided_expanded_empty_and_scalar_inputs_cross_as_they_are():
    f = torch.compile(lambda a, b: a * 2 + b.sum(0), backend="tessera")
    a, b = torch.randn(4).expand(3, 4), torch.randn(5, 8)[1:, ::2]  # stride 0; offset and step
    torch.testing.assert_close(f(a, b), a * 2 + b.sum(0))
    x = torch.randn(2, 3, 4).permute(2, 0, 1)
    torch.testing.assert_close(torch.compile(lambda x: torch.softmax(x, -1), backend="tessera")(x), x.softmax(-1))
    assert torch.compile(lambda x: x + 1, backend="tessera")(torch.randn(0, 3)).shape == (0, 3)
    assert torch.compile(lambda x: x * 3, backend="tessera")(torch.tensor(2.0)).item() == 6.0
    assert tessera_graphs()


def test_outputs_do_not_alias_inputs_or_each_other():
    f = torch.compile(lambda x: (x.clone(), x.contiguous() * 1, x + 0), backend="tessera")
    x = torch.randn(5)
    before = x.clone()
    a, b, c = f(x)
    a.add_(1.0)
    b.mul_(2.0)
    assert torch.equal(x, before), "an output written in place leaves the input as it was"
    torch.testing.assert_close(c, before)


# -- fallback -------------------------------------------------------------------


def test_an_unsupported_op_runs_in_pytorch_logged_once(fallbacks):
    w = torch.randn(6, 6, requires_grad=True)

    def f(x):
        h = torch.relu(x @ w)
        return torch.cumsum(h, dim=1).exp().sum(dim=0)

    compiled = compare(f, [torch.randn(4, 6)], [w])
    compiled(torch.randn(4, 6))
    lines = fallbacks()
    assert len([line for line in lines if "aten.cumsum" in line]) == 1, lines
    assert tessera_graphs(), "the rest of the graph still runs on tessera"


def test_a_conversion_tessera_refuses_names_the_line_and_falls_back(monkeypatch, fallbacks):
    """A converter that emitted a wrong type (simulated: relu emitted as a
    full reduction) is caught by tessera's verifier: the error names the
    op, the types and the generated line (with the user's call site); the
    partition then runs in PyTorch, or, under fullgraph, the error is
    raised."""
    from tessera import _convert

    def wrong(e, node):
        return e.op("sum", [e.val(node.args[0])], [("dims", "[0]"), ("keepdim", "false")], final=True)

    monkeypatch.setitem(_convert.CONVERTERS, torch.ops.aten.relu.default, wrong)
    f = lambda x: torch.relu(x) * 2  # noqa: E731
    x = torch.randn(3, 4)
    strict = torch.compile(f, backend="tessera", options={"fullgraph": True})
    with pytest.raises(tessera.TesseraError, match=r"sum: .*declared type f32\[3,4\].*\n  in: %relu = sum.*test_backend.py:\d+"):
        strict(x)
    tessera.torch.reset()
    lenient = torch.compile(f, backend="tessera")
    torch.testing.assert_close(lenient(x), f(x))
    assert [m for m in fallbacks() if "partition" in m and "declared type" in m], fallbacks()


def test_fullgraph_option_refuses_a_fallback():
    f = torch.compile(lambda x: torch.cumsum(x, 0), backend="tessera", options={"fullgraph": True})
    with pytest.raises(Exception, match="aten.cumsum"):
        f(torch.randn(3))


# -- hints ---------------------------------------------------------------------------


def hinted_lines(texts, hint):
    return [line for t in texts for line in t.splitlines() if hint in line]


def test_hints_context_reaches_forward_and_backward_nodes():
    w = torch.randn(8, 8, requires_grad=True)

    def f(x):
        y = x @ w
        with tessera.hints('{"order": "strict", "group_id": 3, "backward_group_id": 4}'):
            z = torch.exp(torch.relu(y)) * 2.0
        return z.sum() + y.mean()

    compare(f, [torch.randn(4, 8)], [w])
    fw, bw = graph_texts("forward"), graph_texts("backward")
    fw_hinted = hinted_lines(fw, '"group_id":3')
    assert {re.search(r"= (\w+)", line).group(1) for line in fw_hinted} >= {"relu", "exp", "mul"}
    matmuls = hinted_lines(fw, "matmul(")
    assert matmuls and all("hints=" not in line for line in matmuls), "the matmul is outside the block"
    # The backward ops made from the hinted region inherit its hints, with
    # backward_group_id as their group (tessera's own rule).
    assert hinted_lines(bw, '"group_id":4'), bw
    assert not hinted_lines(bw, '"group_id":3')


def test_nested_hints_merge_the_inner_value_winning():
    def f(x):
        with tessera.hints({"order": "strict", "group_id": 1}):
            y = x.exp()
            with tessera.hints('{"group_id": 2}'):
                z = y.relu()
        return z * 2

    compare(f, [torch.randn(3)])
    (text,) = graph_texts("forward")  # one graph: no graph break
    assert re.search(r'exp\(%in_\w+\) : f32\[3\]  hints={"group_id":1,"order":"strict"}', text), text
    assert 'relu(%exp) : f32[3]  hints={"group_id":2,"order":"strict"}' in text, text
    assert "mul(" in text and all("hints=" not in line for line in text.splitlines() if "mul(" in line)


def test_hints_accept_a_dict_and_refuse_bad_values():
    with tessera.hints({"order": "dfs"}):
        pass
    with pytest.raises(tessera.TesseraError, match="order"):
        tessera.hints('{"order": "sideways"}')
    with pytest.raises(tessera.TesseraError):
        tessera.hints("{not json")


def predicted_peak(kind):
    peaks = []
    for p in tessera.torch.compiled_partitions():
        if p.name.startswith(kind):
            for g in p.compiled_graphs():
                for name, text in g.artifacts():
                    if name.endswith("schedule.txt"):
                        peaks += [int(x) for x in re.findall(r"predicted peak (\d+) bytes", text)]
    return max(peaks)


def measured_peak(fn, qkv):
    """tessera's allocator peak over one more forward + backward of the
    compiled `fn` (the predicted peaks are the schedule's; this is what the
    run held)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv)
    tessera.reset_peak_memory()
    live, _ = tessera.memory_stats()
    fn(q, k, v).sum().backward()
    return tessera.memory_stats()[1] - live


def test_seed_hints_change_the_schedule_and_its_memory():
    """PySDPAHinted (hints through torch's hints_wrapper HOP) against
    PySDPA, both sliced, tessera's attention pass off, both on the
    throughput order ``bfs`` (the default, ``auto``, already picks a
    low-memory order for the unhinted graph): the strict regions' peak is
    lower, predicted (forward and backward) and measured."""
    qkv = [torch.randn(2, 4, 32, 8) for _ in range(3)]
    options = {"fuse_attention": False, "schedule": "bfs"}
    plain_fn = compare(lambda q, k, v: PySDPA.apply(q, k, v, False, True), qkv, options=options)
    plain = predicted_peak("forward"), predicted_peak("backward"), measured_peak(plain_fn, qkv)
    tessera.torch.reset()
    hinted_fn = compare(lambda q, k, v: PySDPAHinted.apply(q, k, v, False, True), qkv, options=options)
    assert hinted_lines(graph_texts("forward"), '"group_id":0,"order":"strict"')
    assert hinted_lines(graph_texts("backward"), '"group_id":1,"order":"strict"')
    hinted = predicted_peak("forward"), predicted_peak("backward"), measured_peak(hinted_fn, qkv)
    assert all(h < p for h, p in zip(hinted, plain)), (hinted, plain)


# -- options and shapes -----------------------------------------------------------------


def test_options_map_to_compile_options():
    w = torch.randn(8, 8, requires_grad=True)
    f = lambda x: torch.softmax(x @ w, dim=-1).sum()  # noqa: E731
    compare(f, [torch.randn(4, 8)], [w], options={"schedule": "dfs", "memory_budget_mb": 1})
    for mode in ("max-autotune", "reduce-overhead"):
        torch._dynamo.reset()
        compare(f, [torch.randn(4, 8)], [w], mode=mode)
    with pytest.raises(Exception, match="unknown tessera option"):
        torch.compile(f, backend="tessera", options={"sheduel": "dfs"})(torch.randn(4, 8))
    with pytest.raises(Exception, match="unknown schedule"):
        torch.compile(f, backend="tessera", options={"schedule": "fast"})(torch.randn(4, 8))


def tessera_compiles():
    """Executables tessera built, per partition."""
    return {p.name: p.compiles() for p in tessera.torch.compiled_partitions()}


def symbolic_texts():
    return [g.graph_text() for p in tessera.torch.compiled_partitions() if p.shared for g in p.compiled_graphs()]


def test_dynamic_batch_sizes_without_recompiles(fallbacks):
    from torch._dynamo.utils import counters

    m = MLP()
    compiled = torch.compile(m, backend="tessera", dynamic=True)
    counters.clear()
    for batch in (3, 5, 9, 17, 30):
        x = torch.randn(batch, 12)
        want = values_and_grads(m, [x], list(m.parameters()))
        got = values_and_grads(compiled, [x], list(m.parameters()))
        assert_close_all(got[0], want[0])
        assert_close_all(got[1], want[1])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    compiles = tessera_compiles()
    assert {k[:3] for k in compiles} == {"for", "bac"}, compiles
    assert max(compiles.values()) <= 2, compiles
    # The forward and the backward are graphs over the batch symbol.
    texts = symbolic_texts()
    assert len(texts) == len(compiles) and all(re.search(r"f32\[s\d+,12\]", t) for t in texts), texts
    assert fallbacks() == []


@pytest.mark.parametrize("sdpa", [False, True])
def test_dynamic_batch_and_sequence_lengths_of_a_gpt_block(sdpa, fallbacks):
    m = Block(sdpa=sdpa)
    compiled = torch.compile(lambda i, t: m(i, t), backend="tessera", dynamic=True)
    params = list(m.parameters())
    for batch, n in ((4, 3), (6, 5), (9, 7), (10, 3), (12, 5)):
        ids, targets = torch.randint(0, 11, (batch, n)), torch.randint(0, 11, (batch, n))
        want = values_and_grads(lambda: m(ids, targets), [], params)
        got = values_and_grads(lambda: compiled(ids, targets), [], params)
        assert_close_all(got[0], want[0])
        assert_close_all(got[1], want[1])
    compiles = tessera_compiles()
    assert compiles and max(compiles.values()) <= 2, compiles
    assert len(symbolic_texts()) == len(compiles), "every partition is one symbolic graph"
    # pos[:n]'s gradient writes a slice of symbolic length into a constant
    # shape, which tessera's ops cannot say: that one op runs in PyTorch.
    assert [line for line in fallbacks() if "slice_scatter" not in line] == [], fallbacks()


def test_a_creation_op_of_a_symbolic_size_runs_in_pytorch(fallbacks):
    def f(x):
        return torch.tanh(x) * torch.arange(x.shape[0], dtype=x.dtype)[:, None]

    compiled = torch.compile(f, backend="tessera", dynamic=True)
    for batch in (3, 6, 7):
        x = torch.randn(batch, 4)
        assert_close_all(values_and_grads(compiled, [x])[0], values_and_grads(f, [x])[0])
    assert any("arange" in line and "symbolic" in line for line in fallbacks()), fallbacks()
    assert max(tessera_compiles().values()) <= 1


def test_an_op_needing_a_constant_size_runs_in_pytorch(fallbacks):
    def f(x):
        return F.layer_norm(torch.sin(x), x.shape[-1:])

    compiled = torch.compile(f, backend="tessera", dynamic=True)
    for batch in (3, 6):
        x = torch.randn(batch, 4)
        got, want = values_and_grads(compiled, [x]), values_and_grads(f, [x])
        assert_close_all(got[0], want[0])
        assert_close_all(got[1], want[1])
    assert any("var_mean" in line and "symbolic size" in line for line in fallbacks()), fallbacks()
    assert tessera_graphs(), "the rest runs on tessera"


def test_a_partition_whose_symbols_no_input_binds_compiles_per_size(caplog):
    def f(x):
        flat = torch.cumsum(x.reshape(-1), dim=0)  # cumsum runs in PyTorch
        return torch.tanh(flat).reshape(x.shape[0], -1)

    compiled = torch.compile(f, backend="tessera", dynamic=True)
    with caplog.at_level("WARNING", logger="tessera"):
        for batch in (3, 6):
            x = torch.randn(batch, 4)
            got, want = values_and_grads(compiled, [x]), values_and_grads(f, [x])
            assert_close_all(got[0], want[0])
            assert_close_all(got[1], want[1])
    lines = [r.getMessage() for r in caplog.records if "compiled per size" in r.getMessage()]
    assert any("not a dim of any tensor input" in line for line in lines), caplog.text
    assert tessera_graphs(), "the partition still runs on tessera, per size"
