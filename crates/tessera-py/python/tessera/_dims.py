"""Tensor dims as the converters see them: an ``int``, or a symbolic dim.

Under ``torch.compile(..., dynamic=True)`` (or once Dynamo marks a dim
dynamic) a FakeTensor's size is a ``torch.SymInt`` whose expression is a
sympy expression over torch's size symbols (``s0``, ``s27``, …). tessera's
dims are polynomials with non-negative integer coefficients over named
symbols (docs/IR.md, "Types and symbolic dims"), so such a size becomes a
tessera dim of the same symbols: ``4*s0*s1``. A size outside that algebra
(``s0 - 1``, ``s0 // 2``) is :class:`NotSymbolic`, and so is an op whose
tessera form needs the size as a constant (an ``arange`` end, a divisor):
the backend then runs that node in PyTorch or compiles its partition per
size, and logs why.
"""

from __future__ import annotations

import re

import sympy
import torch


class Unsupported(Exception):
    """A node this converter cannot express in tessera (the message says why)."""


class NotSymbolic(Unsupported):
    """A node that tessera can express only with its dims concrete (the
    message names the dim and why)."""


_SYMBOL = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")


def dim_of(d):
    """A size as the converters keep it: an ``int``, or a sympy expression
    when it is symbolic (a ``torch.SymInt`` or an expression already)."""
    if isinstance(d, torch.SymInt):
        d = d.node.expr
    if isinstance(d, sympy.Basic):
        return int(d) if d.is_number else sympy.expand(d)
    return int(d)


def is_symbolic(d):
    return isinstance(d, sympy.Basic)


def any_symbolic(shape):
    return any(is_symbolic(d) for d in shape)


def dim_str(d):
    """A dim in tessera's spelling: ``16``, ``s0``, ``4*s0*s1+2``."""
    if not is_symbolic(d):
        return str(int(d))
    gens = sorted(d.free_symbols, key=str)
    bad = [str(s) for s in gens if not _SYMBOL.match(str(s))]
    if bad:
        raise NotSymbolic(f"size {d}: symbol(s) {bad} have no tessera spelling")
    try:
        terms = sympy.Poly(d, *gens).terms()
    except sympy.PolynomialError:
        raise NotSymbolic(f"size {d} is not a polynomial in its symbols (tessera's symbolic dims are)") from None
    spelled = []
    for monomial, coeff in terms:
        if not (coeff.is_integer and coeff >= 0):
            raise NotSymbolic(f"size {d} has the coefficient {coeff} (tessera's are non-negative integers)")
        factors = [str(s) for s, k in zip(gens, monomial) for _ in range(k)]
        if coeff != 1 or not factors:
            factors.insert(0, str(int(coeff)))
        spelled.append("*".join(factors))
    return "+".join(spelled)


def symbols_of(shape):
    """The names of the symbols a shape's dims use."""
    return {str(s) for d in shape if is_symbolic(d) for s in d.free_symbols}


def plain_symbols(shape):
    """The names of the dims that are a symbol alone (what a tessera input
    binds when it is called)."""
    return {str(d) for d in shape if is_symbolic(d) and d.is_Symbol}


def concrete(d, what):
    """`d` as an ``int``; a symbolic `d` is :class:`NotSymbolic` naming `what`."""
    if is_symbolic(d):
        raise NotSymbolic(f"{what} is the symbolic size {d}; tessera needs it constant")
    return int(d)


def broadcast(*shapes):
    """NumPy broadcasting of shapes whose dims may be symbolic."""
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        dims = [s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0]
        wide = {d for d in dims if is_symbolic(d) or d != 1}
        if len(wide) > 1:
            raise NotSymbolic(f"broadcasting dims {sorted(map(str, wide))} that are not provably equal")
        out.append(wide.pop() if wide else 1)
    return out
