"""tessera as a ``torch.compile`` backend: ``torch.compile(model, backend="tessera")``.

Dynamo hands :func:`backend` a graph of torch ops; AOTAutograd (with
``core_aten_decompositions`` and a few more, see :data:`DECOMPOSITIONS`)
turns it into a forward and a backward graph of ATen ops, or one
inference graph where nothing needs a gradient (an optimizer's update,
code under ``torch.no_grad``). Each is split
into partitions: maximal runs of nodes tessera converts
(:mod:`tessera._convert`) become one tessera graph each, compiled by
tessera's pipeline (passes, fusion, the schedule under context hints, the
memory plan) and run on tessera's CPU backend, or its CUDA backend when the
inputs are on the GPU; every other node runs in PyTorch, and each op that
does is logged once (logger ``"tessera"``), as a graph break is. Tensors
cross by DLPack without a copy, in host and GPU memory; PyTorch's and
tessera's CUDA streams are ordered with events at each call's start and
end, never by synchronising the host. On the GPU, tessera's memory comes
from PyTorch's caching allocator, one pool for both
(:mod:`tessera._torch_cuda`; ``TESSERA_TORCH_ALLOCATOR=0`` or
:func:`use_torch_allocator` turn that off).

Options (``torch.compile(..., mode=..., options={...})``):

- ``mode``: ``default`` | ``reduce-overhead`` | ``max-autotune``, tessera's
  modes;
- ``options["schedule"]``: ``bfs`` | ``dfs`` | ``strict`` | ``auto``, how
  kernels are ordered outside hinted regions;
- ``options["memory_budget_mb"]``: the most MiB a graph's intermediates may
  hold at once;
- ``options["fullgraph"]``: an op tessera lacks is an error instead of a
  PyTorch partition;
- ``options["dynamic"]``: tessera's dynamic dims (None: automatic);
- ``options["fuse_attention"]``: tessera's attention-pattern pass (on).
"""

from __future__ import annotations

import logging
import operator
import re
import time

import torch
import torch.fx
from torch._dynamo.backends.common import aot_autograd
from torch._decomp import core_aten_decompositions, get_decompositions
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupport

from . import _convert, _dims, _foreach, _hints, _torch_cuda
from ._tessera import CompiledGraph, TesseraError

log = logging.getLogger("tessera")

aten = torch.ops.aten

#: Ops tessera converts as they are, which the core decompositions would
#: otherwise split (the converters do better: one softmax, one embedding).
KEEP = [
    aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default,
    aten.embedding_dense_backward.default,
    aten.embedding.default,
    aten.gelu.default,
    aten.gelu_backward.default,
    aten.nll_loss_backward.default,
    # Decomposed, a causal mask compares two aranges: of a symbolic length
    # they would run in PyTorch (tessera's arange has a constant length).
    aten.tril.default,
    aten.triu.default,
]

#: The decompositions applied while AOTAutograd traces: PyTorch's core
#: ATen set less :data:`KEEP`, plus layer norm, batch norm, the NLL loss and the
#: multi-tensor ops of torch.optim's foreach paths (:mod:`tessera._foreach`).
DECOMPOSITIONS = {k: v for k, v in core_aten_decompositions().items() if k not in KEEP}
DECOMPOSITIONS.update(
    get_decompositions(
        [
            aten.native_layer_norm,
            aten.native_layer_norm_backward,
            aten.nll_loss_forward,
            # Batch norm (train: its batch statistics and the running
            # update, returned as new buffers that AOTAutograd copies back;
            # eval: the running statistics) in var_mean, rsqrt and
            # elementwise ops; its backward is in the core set already.
            aten._native_batch_norm_legit_functional,
            aten._native_batch_norm_legit_no_training,
            aten._native_batch_norm_legit,
            aten.native_batch_norm,
        ]
    )
)
DECOMPOSITIONS.update(_foreach.DECOMPOSITIONS)

_logged_fallbacks = set()
_compiled = []  # every TesseraPartition made, for introspection


def _note_fallback(name, why):
    if name in _logged_fallbacks:
        return
    _logged_fallbacks.add(name)
    log.warning("tessera: %s runs in PyTorch (%s)", name, why)


TT = _convert.TT


def _type_of(v):
    """The TT of a node's value, its SymInt sizes as tessera symbolic dims
    (see :mod:`tessera._dims`)."""
    if isinstance(v, torch.Tensor):
        return TT(v.dtype, [_dims.dim_of(d) for d in v.shape])
    if isinstance(v, (list, tuple)):
        return [_type_of(x) for x in v]
    return v


def _is_symbolic(v):
    if isinstance(v, torch.Tensor):
        return any(isinstance(d, torch.SymInt) for d in v.shape)
    if isinstance(v, (list, tuple)):
        return any(_is_symbolic(x) for x in v)
    return isinstance(v, torch.SymInt)


def _types(gm):
    return {n: _type_of(n.meta.get("val")) for n in gm.graph.nodes}


def _device_ok(v):
    if isinstance(v, torch.Tensor):
        return v.device.type in ("cpu", "cuda")
    if isinstance(v, (list, tuple)):
        return all(_device_ok(x) for x in v)
    return True


_gpu = {}  # "refused": logged

#: tessera's CUDA memory from PyTorch's caching allocator (True, the
#: default) or its own (see :mod:`tessera._torch_cuda`).
use_torch_allocator = _torch_cuda.use_torch_allocator


def _gpu_stream(inputs):
    """PyTorch's current CUDA stream (an integer ``CUstream``), which the
    call is ordered with, when a partition's inputs are on the GPU and
    tessera's CUDA backend opens; None when it runs on the host."""
    if not any(t.device.type == "cuda" for t in inputs):
        return None
    from . import _tessera

    if not _tessera.cuda_is_available():
        if "refused" not in _gpu:
            _gpu["refused"] = True
            log.warning(
                "tessera: CUDA tensors cross through the host and run on tessera's CPU backend: %s",
                _tessera.cuda_unavailable_reason(),
            )
        return None
    devices = {t.device.index or 0 for t in inputs if t.device.type == "cuda"}
    if devices != {0}:
        raise TesseraError(
            f"tessera's CUDA backend runs GPU 0 of the process; inputs on cuda:{sorted(devices)} "
            "(choose the GPU with CUDA_VISIBLE_DEVICES)"
        )
    _torch_cuda.ensure()
    return _torch_cuda.current_stream()


# -- partitioning ---------------------------------------------------------------


class _DryEmitter(_convert.Emitter):
    """Converts single nodes to see whether they convert: any tensor input
    is available, typed by its FX meta."""

    def val(self, arg):
        if isinstance(arg, torch.fx.Node) and arg not in self.values:
            if not isinstance(self.types.get(arg), TT):
                raise _convert.Unsupported(f"input {arg.name} is not a tensor")
            self.values[arg] = _value_of(arg.name, self.types[arg])
        return super().val(arg)


def _value_of(name, t):
    if isinstance(t, list):
        return [_value_of(f"{name}_{i}", x) for i, x in enumerate(t)]
    if not isinstance(t, TT):
        raise _convert.Unsupported(f"{name} is not a tensor")
    return _convert.Value(name, t.dtype, t.shape)


def _supported_nodes(gm):
    """For each call_function node: None when tessera converts it, else why not."""
    dry = _DryEmitter("dry", _types(gm))
    verdict = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        v = node.meta.get("val")
        if node.target is operator.getitem:
            ok = verdict.get(node.args[0]) is None and isinstance(dry.values.get(node.args[0]), list)
            verdict[node] = None if ok else "a getitem of a PyTorch node"
            if ok:
                dry.values[node] = dry.values[node.args[0]][node.args[1]]
            continue
        if not isinstance(v, (torch.Tensor, list, tuple)):
            verdict[node] = "not a tensor op"
            continue
        if not _device_ok(v) or any(
            isinstance(a, torch.fx.Node) and not _device_ok(a.meta.get("val")) for a in node.all_input_nodes
        ):
            verdict[node] = "a device tessera-py does not run"
            continue
        # A node that needs a symbolic size constant (`_dims.NotSymbolic`)
        # runs in PyTorch as an unsupported one does: the rest stays one
        # tessera graph for every size.
        try:
            dry.values[node] = _convert.convert_node(dry, node)
            verdict[node] = None
        except _convert.Unsupported as e:
            verdict[node] = str(e)
    return verdict


class _Support(OperatorSupport):
    def __init__(self, verdict):
        super().__init__()
        self.verdict = verdict

    def is_node_supported(self, submodules, node):
        return node.op == "call_function" and self.verdict.get(node, "x") is None


def _unwrap_hints_wrapper(gm):
    """Inlines `torch.ops.higher_order.hints_wrapper(body, args, {}, hints=…)`
    calls: the body's nodes get the hints (merged into enclosing ones)."""
    hop = getattr(torch.ops.higher_order, "hints_wrapper", None)
    if hop is None:
        return

    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target is not hop:
                continue
            body_node, args = node.args[0], node.args[1]
            body = getattr(gm, body_node.target)
            inner = {_hints.PREFIX + k: v for k, v in _hints.normalise(dict(node.kwargs.get("hints") or {}))}
            env = {}
            placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
            for p, a in zip(placeholders, args):
                env[p] = a
            result = None
            with gm.graph.inserting_before(node):
                for bn in body.graph.nodes:
                    if bn.op == "placeholder":
                        continue
                    if bn.op == "output":
                        result = torch.fx.node.map_arg(bn.args[0], lambda n: env[n])
                        continue
                    new = gm.graph.node_copy(bn, lambda n: env[n])
                    # Enclosing hints, then the wrapper's, then the body node's own.
                    custom = {**(node.meta.get("custom") or {}), **inner, **(bn.meta.get("custom") or {})}
                    new.meta = dict(bn.meta)
                    new.meta["custom"] = custom
                    if "stack_trace" not in new.meta and "stack_trace" in node.meta:
                        new.meta["stack_trace"] = node.meta["stack_trace"]
                    env[bn] = new
            for user in list(node.users):
                if user.op == "call_function" and user.target is operator.getitem:
                    user.replace_all_uses_with(result[user.args[1]])
                    gm.graph.erase_node(user)
            if node.users:
                node.replace_all_uses_with(result if not isinstance(result, (list, tuple)) else result[0])
            gm.graph.erase_node(node)
            if not body_node.users:
                gm.graph.erase_node(body_node)
            changed = True
            break
    gm.graph.lint()
    gm.recompile()


# -- running a partition --------------------------------------------------------


class TesseraPartition(torch.nn.Module):
    """One converted partition, run through DLPack. A partition whose FX
    types have symbolic sizes (`dynamic=True`, or dims Dynamo made dynamic)
    becomes one tessera graph with symbolic dims, compiled once for every
    size (its ops that need a size constant were left to PyTorch by the
    partitioner); when tessera refuses that graph, or a symbol is a dim of
    no tensor input (nothing would bind it), that is logged with why, and
    it is compiled per set of input shapes, as a partition of static shapes
    is (tessera's own cache serves repeated calls)."""

    def __init__(self, gm, name, config, backward=False):
        super().__init__()
        self.backward = backward
        self.gm = gm
        self.name = name
        self.config = config
        self.entries = {}
        out = next(n for n in gm.graph.nodes if n.op == "output")
        self.tuple_output = isinstance(out.args[0], (list, tuple))
        results = out.args[0] if self.tuple_output else [out.args[0]]
        # Where each output lives in PyTorch (tessera computes on its inputs' device).
        self.out_devices = [
            r.meta["val"].device if isinstance(r, torch.fx.Node) and isinstance(r.meta.get("val"), torch.Tensor)
            else torch.device("cpu")
            for r in results
        ]  # fmt: skip
        self.symbolic = any(_is_symbolic(n.meta.get("val")) for n in gm.graph.nodes)
        self.shared = None  # the symbolic entry, once built: (graph, positions)
        _compiled.append(self)

    def _key(self, args):
        return tuple(
            (tuple(a.shape), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else ("v", a) for a in args
        )

    def _types_for(self, args):
        if not self.symbolic:
            return _types(self.gm)
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        FakeTensorProp(self.gm, mode).propagate_dont_convert_inputs(*fakes)
        return _types(self.gm)

    def _compile(self, args):
        types = self._types_for(args)
        for p, a in zip([n for n in self.gm.graph.nodes if n.op == "placeholder"], args):
            if isinstance(a, torch.Tensor):
                types[p] = TT(a.dtype, list(a.shape))
        text, positions, _ = _convert.to_tir(self.gm, self.name, types, self.backward)
        return self._build(text), positions

    def _compile_symbolic(self):
        """The partition as one graph over its symbolic dims, or None (logged)."""
        types = _types(self.gm)
        try:
            _check_bound(self.gm, types)
            text, positions, _ = _convert.to_tir(self.gm, self.name, types, self.backward)
            graph = self._build(text)
            if graph.symbolic_refusal():
                # tessera serves it per size: its calls trace and compile
                # anew where a trace does not generalise.
                log.warning("tessera: %s is compiled per size: %s", self.name, graph.symbolic_refusal())
            return graph, positions
        except (_convert.Unsupported, TesseraError) as e:
            log.warning("tessera: %s is compiled per size, its dims cannot stay symbolic: %s", self.name, e)
            return None

    def _build(self, text):
        c = self.config
        started = time.perf_counter()
        try:
            graph = CompiledGraph(
                text,
                source=f"<{self.name}>",
                mode=c.mode,
                dynamic=c.dynamic,
                fullgraph=c.fullgraph,
                schedule=c.schedule,
                memory_budget_mb=c.memory_budget_mb,
                fuse_attention=c.fuse_attention,
            )
        except TesseraError as e:
            # The error's line is one of the generated text: show it (it
            # ends with the FX node's call site).
            at = re.search(r"<" + re.escape(self.name) + r">:(\d+):\d+", str(e))
            lines = text.splitlines()
            if at and 0 < int(at.group(1)) <= len(lines):
                raise TesseraError(f"{e}\n  in: {lines[int(at.group(1)) - 1].strip()}") from e
            raise
        log.debug("tessera: %s compiled in %.3f s:\n%s", self.name, time.perf_counter() - started, text)
        return graph

    def _entry(self, args):
        if self.symbolic and self.shared is None:
            self.shared = self._compile_symbolic() or (None, None)
        if self.shared is not None and self.shared[0] is not None:
            return self.shared
        key = self._key(args)
        entry = self.entries.get(key)
        if entry is None:
            try:
                entry = self._compile(args)
            except (TesseraError, _convert.Unsupported) as e:
                if self.config.fullgraph:
                    raise
                log.warning("tessera: partition %s runs in PyTorch: %s", self.name, e)
                entry = (None, None)
            self.entries[key] = entry
        return entry

    def forward(self, *args):
        graph, positions = self._entry(args)
        if graph is None:
            return self.gm(*args)
        inputs = [args[i].detach() for i in positions]
        stream = _gpu_stream(inputs)
        target = "cpu" if stream is None else "cuda"
        # Host scalars next to GPU tensors go to the GPU (tessera runs a
        # graph on one device); CUDA tensors cross through the host only
        # when tessera's CUDA backend does not open (logged once).
        inputs = [t if t.device.type == target else t.to(target) for t in inputs]
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        # On the GPU tessera's work waits for what PyTorch queued on
        # `stream` before (the inputs' producers, the copies just above),
        # and PyTorch's later work for tessera's: a block either frees is
        # reused by the other only after (`cuda::foreign_call`).
        results = graph.run_dlpack([torch.utils.dlpack.to_dlpack(t) for t in inputs], torch_stream=stream)
        outs = []
        for c, device in zip(results, self.out_devices):
            o = torch.utils.dlpack.from_dlpack(c)
            # tessera may hand back an input's buffer (`contiguous` of a
            # contiguous input) or one buffer for two outputs; PyTorch takes
            # the outputs of a node that is not a view as fresh tensors.
            ptr = o.untyped_storage().data_ptr()
            if ptr in storages and o.numel() > 0:
                o = o.clone()
                ptr = o.untyped_storage().data_ptr()
            storages.add(ptr)
            outs.append(o if o.device == device else o.to(device))
        return tuple(outs) if self.tuple_output else outs[0]

    def compiled_graphs(self):
        """The tessera graphs built so far: the symbolic one, or one per
        set of input shapes."""
        shared = [self.shared[0]] if self.shared is not None and self.shared[0] is not None else []
        return shared + [g for g, _ in self.entries.values() if g is not None]

    def compiles(self):
        """How many executables tessera built for this partition (every
        graph's first compile and its recompiles)."""
        return sum(g.stats()["compiles"] for g in self.compiled_graphs())


def _check_bound(gm, types):
    """Every symbol the partition's types use is a whole dim of one of its
    tensor inputs, which binds it when tessera is called (a size that only
    a non-tensor input carries would have no value)."""
    used, bound = set(), set()
    for node in gm.graph.nodes:
        for t in types[node] if isinstance(types.get(node), list) else [types.get(node)]:
            if isinstance(t, TT):
                used |= _dims.symbols_of(t.shape)
                if node.op == "placeholder":
                    bound |= _dims.plain_symbols(t.shape)
    if used - bound:
        raise _dims.NotSymbolic(
            f"the size symbol(s) {sorted(used - bound)} are not a dim of any tensor input "
            f"(inputs bind {sorted(bound) or 'none'})"
        )


class Config:
    def __init__(self, mode=None, options=None):
        options = dict(options or {})
        self.mode = mode or options.pop("mode", None) or "default"
        self.schedule = options.pop("schedule", None)
        self.memory_budget_mb = options.pop("memory_budget_mb", None)
        self.fullgraph = bool(options.pop("fullgraph", False))
        self.dynamic = options.pop("dynamic", None)
        self.fuse_attention = bool(options.pop("fuse_attention", True))
        if options:
            raise TesseraError(
                f"unknown tessera option(s) {sorted(options)}: expected schedule, memory_budget_mb, "
                "fullgraph, dynamic, fuse_attention, mode"
            )
        if self.mode not in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
            raise TesseraError(f"unknown mode {self.mode!r}: expected default, reduce-overhead or max-autotune")
        if self.schedule is not None and self.schedule not in ("bfs", "dfs", "strict", "auto"):
            raise TesseraError(f"unknown schedule {self.schedule!r}: expected bfs, dfs, strict or auto")


_counter = [0]


_logged_recompute = set()


def _note_unhonoured_recompute(gm):
    """tessera checkpoints a region whose hints ask for `recompute` (the
    default under `order: strict`) in its own AOT partition; here
    AOTAutograd partitions, so the hint is not honoured: said once per
    hint object, as a stage that ignores a hint must."""
    import json

    for node in gm.graph.nodes:
        text = _hints.hints_of(node.meta)
        if not text or text in _logged_recompute:
            continue
        h = json.loads(text)
        order = h.get("order", h.get("schedule_policy"))
        if h.get("recompute", order == "strict"):
            _logged_recompute.add(text)
            log.warning(
                "tessera: hints %s: `recompute` is not honoured under torch.compile (AOTAutograd's "
                "partitioner decides what the backward saves; torch.utils.checkpoint recomputes)",
                text,
            )


def compile_aten_graph(gm, example_inputs, config, kind):
    """Partitions an ATen graph into tessera partitions and PyTorch nodes;
    returns the callable AOTAutograd runs (boxed: a list of arguments)."""
    _unwrap_hints_wrapper(gm)
    if kind == "forward":
        _note_unhonoured_recompute(gm)
    verdict = _supported_nodes(gm)
    for node, why in verdict.items():
        if why is not None and why != "not a tensor op" and isinstance(node.target, torch._ops.OpOverload):
            if config.fullgraph:
                raise TesseraError(f"fullgraph: {_convert.op_name(node)} ({node.name}) cannot run on tessera: {why}")
            _note_fallback(_convert.op_name(node), why)
    partitioner = CapabilityBasedPartitioner(gm, _Support(verdict), allows_single_node_partition=True)
    partitions = partitioner.propose_partitions()
    fused = partitioner.fuse_partitions(partitions)
    _counter[0] += 1
    for node in list(fused.graph.nodes):
        if node.op == "call_module" and node.target.startswith("fused_"):
            sub = getattr(fused, node.target)
            name = f"{kind}{_counter[0]}_{node.target}"
            setattr(fused, node.target, TesseraPartition(sub, name, config, kind == "backward"))
    fused.recompile()

    def run(args):
        out = fused(*args)
        args.clear()
        return out

    run._boxed_call = True
    run.graph_module = fused
    return run


def _sdpa_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` in plain ops (softmax(q·kᵀ·scale +
    mask)·v), which AOTAutograd differentiates op by op and tessera's
    attention pass turns back into its flash attention."""
    scale = 1.0 / (query.shape[-1] ** 0.5) if scale is None else scale
    s = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        n, m = query.shape[-2], key.shape[-2]
        keep = torch.ones(n, m, dtype=torch.bool, device=query.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask
    return torch.matmul(torch.softmax(s, dim=-1), value)


def _rewrite_sdpa(gm):
    """Calls of ``F.scaled_dot_product_attention`` without dropout or GQA
    become :func:`_sdpa_math`, so that their backward is made of ops
    tessera converts (PyTorch's fused backward kernels are not)."""
    targets = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in targets:
            dropout = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
            if dropout == 0.0 and not node.kwargs.get("enable_gqa", False):
                node.target = _sdpa_math
                changed = True
    if changed:
        gm.recompile()


def backend(gm, example_inputs, mode=None, options=None, **kwargs):
    """The ``torch.compile`` backend (registered as ``"tessera"``)."""
    if kwargs:
        raise TesseraError(f"unknown backend argument(s) {sorted(kwargs)}")
    config = Config(mode, options)

    def fw(g, inputs):
        return compile_aten_graph(g, inputs, config, "forward")

    def bw(g, inputs):
        return compile_aten_graph(g, inputs, config, "backward")

    def inference(g, inputs):
        return compile_aten_graph(g, inputs, config, "inference")

    _rewrite_sdpa(gm)
    compiler = aot_autograd(fw_compiler=fw, bw_compiler=bw, inference_compiler=inference, decompositions=DECOMPOSITIONS)
    return compiler(gm, example_inputs)


def compiled_partitions():
    """Every tessera partition built so far (newest last): each has a
    ``name`` that starts with its graph's kind (``forward``, ``backward``,
    ``inference``) and ``compiled_graphs()`` (tessera ``CompiledGraph``s with
    ``graph_text()`` and ``artifacts()``)."""
    return list(_compiled)


def reset():
    """Forgets the partitions and the fallbacks logged (and resets Dynamo)."""
    _compiled.clear()
    _logged_fallbacks.clear()
    _logged_recompute.clear()
    torch._dynamo.reset()


def register():
    from torch._dynamo import list_backends, register_backend

    if "tessera" not in list_backends(exclude_tags=()):
        register_backend(name="tessera")(backend)
