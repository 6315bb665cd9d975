"""Context hints from PyTorch code: ``with tessera.hints('{"order": "strict"}'):``.

The hints of the ops traced inside the block are recorded in their FX
nodes' ``meta["custom"]["tessera_hints"]`` through
``torch.fx.traceback.annotate``, which Dynamo traces and AOTAutograd copies
onto the backward nodes made from them. The backend writes them on the
tessera IR nodes it converts (``hints={...}``), where they act as tessera's
own ``hints::scope`` does: the schedule orders the region's kernels as
asked. Nested blocks merge, the inner value winning.

The keys are tessera's (crates/tessera/src/hints.rs): ``order``
(``strict`` | ``dfs`` | ``bfs`` | ``auto``; Gaudi's ``schedule_policy`` is
an alias), ``group_id``, ``backward_group_id``, ``memory_budget_mb``,
``recompute``. A malformed object or a wrong type raises ``TesseraError``
naming the key; an unknown key is logged as a warning.
"""

from __future__ import annotations

import json
import logging

from ._tessera import check_hints

log = logging.getLogger("tessera")


def normalise(spec):
    """The hint object `spec` (JSON text or a dict) checked by tessera and
    returned as compact JSON text."""
    text = spec if isinstance(spec, str) else json.dumps(spec)
    normal, warnings = check_hints(text)
    for w in warnings:
        log.warning("tessera: %s", w)
    return normal


def _merged(spec):
    import torch.fx.traceback as fx_traceback

    outer = (fx_traceback.current_meta.get("custom") or {}).get("tessera_hints")
    inner = json.loads(normalise(spec))
    if outer:
        merged = json.loads(outer)
        merged.update(inner)
        return json.dumps(merged, separators=(",", ":"), sort_keys=True)
    return json.dumps(inner, separators=(",", ":"), sort_keys=True)


def hints(spec):
    """A context manager attaching the hints `spec` (JSON text such as
    ``'{"order": "strict"}'`` or a dict) to the ops traced inside it, in
    forward and backward graphs."""
    import torch
    import torch.fx.traceback as fx_traceback

    if torch.compiler.is_compiling():
        # Dynamo traces this call: the hint text is a constant of the trace.
        return fx_traceback.annotate({"tessera_hints": _constant_hints(spec)})
    return fx_traceback.annotate({"tessera_hints": _merged(spec)})


def _constant_hints(spec):
    return _constant(spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True))


def _constant(text):
    return _normalised_cached(text)


_cache = {}


def _normalised_cached(text):
    if text not in _cache:
        _cache[text] = normalise(text)
    return _cache[text]
