"""The multi-tensor ops of torch.optim's foreach paths (``aten._foreach_*``)
under torch.compile(backend="tessera") against eager PyTorch: each
decomposed overload on its own, with lists mixing shapes, dtypes (f32 with
bf16) and 0-d tensors, and none of them falling back to PyTorch."""

import pytest
import tessera
import torch
from tessera._foreach import DECOMPOSITIONS
from test_backend import tessera_graphs
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
F32, BF16 = torch.float32, torch.bfloat16

# One list's shapes and dtypes: a matrix, a bf16 vector, a 0-d tensor.
LAYOUT = [((3, 4), F32), ((5,), BF16), ((), F32)]


def tensors(low=None):
    """A list of LAYOUT's tensors: normal values, or uniform in [low, low + 1)."""
    if low is None:
        return [torch.randn(s).to(d) for s, d in LAYOUT]
    return [(torch.rand(s) + low).to(d) for s, d in LAYOUT]


def positive():
    return tensors(low=0.5)


SCALARS = [0.5, -2.0, 3.0]  # one per list element
UNARY = ("abs", "neg", "exp", "log", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tanh", "sigmoid", "sign")


def _unary(name):
    op = getattr(torch, f"_foreach_{name}")
    return lambda xs: op(xs)


def cases():
    """(id, the overload it calls, the function, its argument lists)."""
    out = []

    def case(id, overload, fn, *args):
        out.append(pytest.param(overload, fn, args, id=id))

    for name in UNARY:
        inputs = positive() if name in ("log", "sqrt", "rsqrt", "reciprocal") else tensors()
        case(name, getattr(aten, f"_foreach_{name}").default, _unary(name), inputs)
    t = torch.tensor(0.75)
    for name in ("add", "sub", "mul", "div"):
        op, fe = getattr(aten, f"_foreach_{name}"), getattr(torch, f"_foreach_{name}")
        alpha = {"alpha": 0.5} if name in ("add", "sub") else {}
        other = positive() if name == "div" else tensors()
        case(f"{name}.Scalar", op.Scalar, lambda xs, fe=fe: fe(xs, 1.5), tensors())
        case(f"{name}.List", op.List, lambda xs, ys, fe=fe, kw=alpha: fe(xs, ys, **kw), tensors(), other)
        case(f"{name}.ScalarList", op.ScalarList, lambda xs, fe=fe: fe(xs, SCALARS), tensors())
        if name != "sub":
            kw = {"alpha": 0.5} if name == "add" else {}
            case(f"{name}.Tensor", op.Tensor, lambda xs, s, fe=fe, kw=kw: fe(xs, s, **kw), tensors(), t)
    for name in ("maximum", "minimum", "clamp_min", "clamp_max"):
        op, fe = getattr(aten, f"_foreach_{name}"), getattr(torch, f"_foreach_{name}")
        case(f"{name}.Scalar", op.Scalar, lambda xs, fe=fe: fe(xs, 0.25), tensors())
        case(f"{name}.List", op.List, lambda xs, ys, fe=fe: fe(xs, ys), tensors(), tensors())
        case(f"{name}.ScalarList", op.ScalarList, lambda xs, fe=fe: fe(xs, SCALARS), tensors())
    p = aten._foreach_pow
    case("pow.List", p.List, lambda xs, ys: torch._foreach_pow(xs, ys), positive(), tensors())
    case("pow.Scalar", p.Scalar, lambda xs: torch._foreach_pow(xs, 2.5), positive())
    case("pow.ScalarList", p.ScalarList, lambda xs: torch._foreach_pow(xs, SCALARS), positive())
    case("pow.ScalarAndTensor", p.ScalarAndTensor, lambda xs: torch._foreach_pow(0.9, xs), tensors())
    for name in ("addcmul", "addcdiv"):
        op, fe = getattr(aten, f"_foreach_{name}"), getattr(torch, f"_foreach_{name}")
        args = (tensors(), tensors(), positive())
        case(f"{name}.Scalar", op.Scalar, lambda a, b, c, fe=fe: fe(a, b, c, value=-0.3), *args)
        case(f"{name}.ScalarList", op.ScalarList, lambda a, b, c, fe=fe: fe(a, b, c, SCALARS), *args)
        case(f"{name}.Tensor", op.Tensor, lambda a, b, c, s, fe=fe: fe(a, b, c, s), *args, torch.tensor(SCALARS))
    lerp = aten._foreach_lerp
    case("lerp.List", lerp.List, lambda a, b, w: torch._foreach_lerp(a, b, w), tensors(), tensors(), tensors())
    case("lerp.Scalar", lerp.Scalar, lambda a, b: torch._foreach_lerp(a, b, 0.1), tensors(), tensors())
    case(
        "lerp.ScalarList",
        lerp.ScalarList,
        lambda a, b: torch._foreach_lerp(a, b, [0.1, 0.9, 0.6]),
        tensors(),
        tensors(),
    )
    case("copy", aten._foreach_copy.default, lambda a, b: aten._foreach_copy.default(a, b), tensors(), tensors())
    case("zero", aten._foreach_zero.default, lambda a: aten._foreach_zero.default(a), tensors())
    case("clone", aten._foreach_clone.default, lambda a: aten._foreach_clone.default(a), tensors())
    case("norm2", aten._foreach_norm.Scalar, lambda a: torch._foreach_norm(a), tensors())
    case("norm_inf", aten._foreach_norm.Scalar, lambda a: torch._foreach_norm(a, float("inf")), tensors())
    return out


CASES = cases()


class _Overloads(TorchDispatchMode):
    """Records the ops eager PyTorch dispatches."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func)
        return func(*args, **(kwargs or {}))


def clone_args(args):
    return [[t.clone() for t in a] if isinstance(a, list) else a.clone() for a in args]


@pytest.mark.parametrize("overload, fn, args", CASES)
def test_foreach_overload_matches_eager(overload, fn, args, fallbacks):
    with _Overloads() as mode:
        want = fn(*clone_args(args))
    assert overload in mode.seen, f"the case calls {overload}, not {sorted(map(str, mode.seen))}"
    got = torch.compile(fn, backend="tessera")(*clone_args(args))
    assert [(g.dtype, g.shape) for g in got] == [(w.dtype, w.shape) for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert fallbacks() == [], fallbacks()
    assert tessera_graphs(), "the graph ran on tessera"


def test_every_decomposed_overload_has_a_case():
    tested = {c.values[0] for c in CASES}
    assert set(DECOMPOSITIONS) == tested, sorted(map(str, set(DECOMPOSITIONS) ^ tested))


def test_in_place_updates_write_their_lists(fallbacks):
    """The in-place forms torch.optim calls (functionalized by AOTAutograd
    into list-valued nodes whose elements are written back)."""

    def update(params, grads, avgs, step):
        torch._foreach_add_(step, 1)
        torch._foreach_lerp_(avgs, grads, 0.1)
        torch._foreach_mul_(params, 0.99)
        bias = torch._foreach_pow(0.9, step)
        torch._foreach_sub_(bias, 1)
        torch._foreach_addcdiv_(
            params, avgs, torch._foreach_add(torch._foreach_sqrt(torch._foreach_abs(avgs)), 1e-3), [-0.1, -0.2, -0.3]
        )
        torch._foreach_div_(params, bias)
        torch._foreach_maximum_(avgs, torch._foreach_neg(grads))

    inputs = [tensors(), tensors(), tensors(), [torch.tensor(3.0) for _ in LAYOUT]]
    want, got = clone_args(inputs), clone_args(inputs)
    update(*want)
    compiled = torch.compile(update, backend="tessera")
    compiled(*got)
    for gs, ws in zip(got, want):
        for g, w in zip(gs, ws):
            torch.testing.assert_close(g, w)
    assert fallbacks() == [], fallbacks()
    assert tessera_graphs()


def test_an_op_without_a_decomposition_runs_in_pytorch_as_one_node(fallbacks):
    xs = tensors()
    got = torch.compile(lambda xs: torch._foreach_exp(torch._foreach_erf(xs)), backend="tessera")(xs)
    for g, w in zip(got, torch._foreach_exp(torch._foreach_erf(xs))):
        torch.testing.assert_close(g, w)
    assert [line for line in fallbacks() if "_foreach_erf" in line], fallbacks()
    assert tessera_graphs(), "the exps run on tessera"


def test_lists_of_different_lengths_are_refused_naming_the_op():
    # Dynamo's fake-tensor run refuses them first under torch.compile; the
    # decompositions check too, as a direct call may reach them.
    xs = tensors()
    with pytest.raises(tessera.TesseraError, match=r"aten\.add\.Tensor.*differ in length \(\[2, 3\]\)"):
        DECOMPOSITIONS[aten._foreach_add.List](xs, xs[:2])
    with pytest.raises(tessera.TesseraError, match=r"_foreach_addcdiv\.Tensor: scalars of shape \[2\] for 3 tensors"):
        DECOMPOSITIONS[aten._foreach_addcdiv.Tensor](xs, xs, xs, torch.ones(2))
