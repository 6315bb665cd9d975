"""Context hints from PyTorch code: ``with tessera.hints('{"order": "strict"}'):``.

The hints of the ops traced inside the block are recorded in their FX
nodes' ``meta["custom"]["tessera_hints"]`` through
``torch.fx.traceback.annotate``, which Dynamo traces and AOTAutograd copies
onto the backward nodes made from them. The backend writes them on the
tessera IR nodes it converts (``hints={...}``), where they act as tessera's
own ``hints::scope`` does: the schedule orders the region's kernels as
asked (in a backward graph, ``backward_group_id`` becomes the
``group_id``, as for tessera's own backward ops). Nested blocks merge, the
inner value winning.

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

_normalised = {}


def normalise(spec):
    """The hint object `spec` (JSON text or a dict) checked by tessera and
    returned as compact JSON text (cached per text)."""
    text = spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True)
    if text not in _normalised:
        normal, warnings = check_hints(text)
        for w in warnings:
            log.warning("tessera: %s", w)
        _normalised[text] = normal
    return _normalised[text]


def hint_dict(spec):
    """`spec` checked and parsed into a dict (a fresh one per call)."""
    return dict(json.loads(normalise(spec)))


def _merge(outer, inner):
    merged = json.loads(outer) if outer else {}
    merged.update(json.loads(inner))
    return json.dumps(merged, separators=(",", ":"), sort_keys=True)


def _constant(fn):
    """`fn` as a constant of a Dynamo trace: its result is computed when
    Dynamo traces the call (its arguments are constants there)."""
    try:
        import torch

        return torch.compiler.assume_constant_result(fn)
    except (ImportError, AttributeError):
        return fn


_normalise_const = _constant(normalise)
_hint_dict_const = _constant(hint_dict)
_merge_const = _constant(_merge)


def hints(spec):
    """A context manager attaching the hints `spec` (JSON text such as
    ``'{"order": "strict"}'`` or a dict) to the ops traced inside it, in
    forward and backward graphs."""
    import torch.fx.traceback as fx_traceback

    text = spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True)
    inner = _normalise_const(text)
    outer = (fx_traceback.current_meta.get("custom") or {}).get("tessera_hints")
    merged = _merge_const(outer, inner) if outer else inner
    return fx_traceback.annotate({"tessera_hints": merged})
