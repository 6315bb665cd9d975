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

#: The prefix of the FX node meta keys (in ``meta["custom"]``) that hold
#: one hint each: ``tessera_hint.order`` = ``"strict"``. One key per hint
#: makes nested blocks merge, the inner value winning, through
#: ``annotate``'s own update of ``meta["custom"]``.
PREFIX = "tessera_hint."

_normalised = {}


def normalise(spec):
    """The hint object `spec` (JSON text, a dict, or a tuple of (key,
    value) pairs) checked by tessera: its (key, value) pairs, sorted
    (cached per spec)."""
    if isinstance(spec, dict):
        spec = tuple(sorted(spec.items()))
    if spec not in _normalised:
        text = spec if isinstance(spec, str) else json.dumps(dict(spec))
        normal, warnings = check_hints(text)
        for w in warnings:
            log.warning("tessera: %s", w)
        _normalised[spec] = tuple(sorted(json.loads(normal).items()))
    return _normalised[spec]


def hint_dict(spec):
    """`spec` checked, as a dict."""
    return dict(normalise(spec))


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


def hints(spec):
    """A context manager attaching the hints `spec` (JSON text such as
    ``'{"order": "strict"}'`` or a dict) to the ops traced inside it, in
    forward and backward graphs."""
    import torch.fx.traceback as fx_traceback

    key = spec if isinstance(spec, str) else tuple(sorted(spec.items()))
    return fx_traceback.annotate({PREFIX + k: v for k, v in _normalise_const(key)})


def hints_of(meta):
    """The hints an FX node's meta carries, as compact JSON text (None
    without any)."""
    custom = meta.get("custom") or {}
    found = {k[len(PREFIX) :]: v for k, v in custom.items() if isinstance(k, str) and k.startswith(PREFIX)}
    if not found:
        return None
    return json.dumps(found, separators=(",", ":"), sort_keys=True)
