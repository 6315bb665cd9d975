"""Generates crates/tessera/tests/fixtures/ops.json: op cases with inputs and
the expected outputs computed by numpy (float64 where the op is float, so the
reference is independent of tessera's kernels and of its precision).

Run once; the output is committed. Re-run only when adding cases:
    python3 scripts/gen_op_fixtures.py
"""
import json, math, os
import numpy as np

rng = np.random.default_rng(1234)
cases = []


def enc(a):
    a = np.asarray(a)
    if a.dtype == np.bool_:
        data = [bool(v) for v in a.ravel()]
    elif np.issubdtype(a.dtype, np.integer):
        data = [int(v) for v in a.ravel()]
    else:
        data = [float(v) if np.isfinite(v) else str(v) for v in a.ravel()]
    return {"shape": list(a.shape), "data": data}


def bf16_round(a):
    """Rounds float64 values to bfloat16 (round to nearest even), back in float64."""
    b = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


ROUND = {"f32": lambda a: a.astype(np.float32).astype(np.float64),
         "f16": lambda a: a.astype(np.float16).astype(np.float64),
         "bf16": bf16_round, "f64": lambda a: a}


def case(op, inputs, expected, dtype="f32", tol=1e-5, **attrs):
    """`expected` is a function of the inputs after rounding them to `dtype`
    (what tessera actually receives), or a ready array."""
    inputs = [np.asarray(x) for x in inputs]
    if dtype in ROUND:
        inputs = [ROUND[dtype](x) if x.dtype == np.float64 else x for x in inputs]
    if callable(expected):
        expected = expected(*inputs)
    cases.append({
        "op": op, "dtype": dtype, "tol": tol, "attrs": attrs,
        "inputs": [enc(x) for x in inputs],
        "expected": enc(expected),
    })


def randn(*shape):
    return rng.standard_normal(shape)


erf = np.vectorize(math.erf)
x = randn(3, 5) * 2
pos = np.abs(randn(3, 5)) + 0.1
unary = {
    "neg": (x, lambda v: -v), "abs": (x, np.abs), "exp": (x, np.exp), "log": (pos, np.log),
    "sqrt": (pos, np.sqrt), "rsqrt": (pos, lambda v: 1 / np.sqrt(v)), "reciprocal": (pos, lambda v: 1 / v),
    "sin": (x, np.sin), "cos": (x, np.cos), "tanh": (x, np.tanh),
    "sigmoid": (x, lambda v: 1 / (1 + np.exp(-v))), "relu": (x, lambda v: np.maximum(v, 0)),
    "gelu": (x, lambda v: 0.5 * v * (1 + erf(v / math.sqrt(2)))),
    "gelu_tanh": (x, lambda v: 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))),
    "silu": (x, lambda v: v / (1 + np.exp(-v))),
}
# Tolerances are relative (|got - want| <= tol * max(1, |want|)): one rounding
# of the output to the dtype plus f32 arithmetic inside.
HALF_TOL = {"f32": 2e-6, "f64": 1e-12, "f16": 1e-3, "bf16": 8e-3}
for name, (inp, f) in unary.items():
    for dtype, tol in HALF_TOL.items():
        case(name, [inp], f, dtype=dtype, tol=tol)

a, b = randn(4, 1, 3), randn(5, 1)
apos, bsmall = np.abs(a) + 0.5, randn(5, 1) * 0.5
binary = {
    "add": (a, b, np.add), "sub": (a, b, np.subtract), "mul": (a, b, np.multiply), "div": (a, b, np.divide),
    "pow": (apos, bsmall, np.power), "maximum": (a, b, np.maximum), "minimum": (a, b, np.minimum),
}
for name, (p, q, f) in binary.items():
    for dtype in ("f32", "f64", "bf16"):
        case(name, [p, q], f, dtype=dtype, tol=HALF_TOL[dtype] * 4)
ia, ib = rng.integers(-20, 20, (3, 4)), rng.integers(1, 7, (4,)) * rng.choice([-1, 1], (4,))
case("add", [ia, ib], ia + ib, dtype="i64", tol=0)
case("mul", [ia, ib], ia * ib, dtype="i32", tol=0)
case("div", [ia, ib], np.trunc(ia / ib).astype(np.int64), dtype="i64", tol=0)
ca, cb = np.round(randn(3, 4)), np.round(randn(4))
for name, f in (("eq", np.equal), ("ne", np.not_equal), ("lt", np.less), ("le", np.less_equal),
                ("gt", np.greater), ("ge", np.greater_equal)):
    case(name, [ca, cb], f, dtype="f32", tol=0)
cond = randn(4, 1) > 0
case("where", [cond, randn(4, 3), randn(3)], np.where, dtype="f32", tol=0)

r = randn(3, 4, 5)
for dims in ([1], [0, 2], [2], [0, 1, 2]):
    for keep in (False, True):
        for name, f in (("sum", np.sum), ("mean", np.mean), ("max", np.max), ("min", np.min), ("prod", np.prod)):
            case(name, [r], lambda v: f(v, axis=tuple(dims), keepdims=keep), dtype="f32", tol=1e-5,
                 dims=dims, keepdim=keep)
case("sum", [r], lambda v: np.sum(v, axis=1), dtype="bf16", tol=8e-3, dims=[1], keepdim=False)
ri = rng.integers(-9, 9, (3, 4))
case("sum", [ri], ri.sum(axis=0), dtype="i64", tol=0, dims=[0], keepdim=False)
tie = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, -1.0, 2.0, -1.0]])
for name, f in (("argmax", np.argmax), ("argmin", np.argmin)):
    case(name, [tie], lambda v: f(v, axis=1), dtype="f32", tol=0, dim=1, keepdim=False)
    case(name, [r], lambda v: f(v, axis=0), dtype="f32", tol=0, dim=0, keepdim=False)

s = randn(3, 7) * 3
s[1] += 1000.0  # overflows exp() without max subtraction


def softmax(v, axis):
    e = np.exp(v - v.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def log_softmax(v, axis):
    z = v - v.max(axis=axis, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=axis, keepdims=True))


for dim in (1, 0):
    case("softmax", [s], lambda v: softmax(v, dim), dtype="f32", tol=1e-6, dim=dim)
    case("log_softmax", [s], lambda v: log_softmax(v, dim), dtype="f32", tol=1e-6, dim=dim)
    case("softmax", [s], lambda v: softmax(v, dim), dtype="bf16", tol=8e-3, dim=dim)

for sa, sb in (((2, 1, 3, 4), (5, 4, 6)), ((3, 4), (4,)), ((4,), (4,)), ((4,), (2, 4, 5)),
               ((7, 33), (33, 5)), ((1, 129), (129, 2)), ((2, 3, 8), (8, 1))):
    ma, mb = randn(*sa), randn(*sb)
    # K up to 129: accumulated error grows like sqrt(K) roundings of the output scale.
    for dtype, tol in (("f32", 1e-5), ("f64", 1e-12), ("f16", 4e-3), ("bf16", 2e-2)):
        case("matmul", [ma, mb], np.matmul, dtype=dtype, tol=tol)
mi, mj = rng.integers(-5, 5, (3, 4)), rng.integers(-5, 5, (4, 2))
case("matmul", [mi, mj], mi @ mj, dtype="i64", tol=0)

t = randn(2, 3, 4)
case("permute", [t], lambda v: np.transpose(v, (2, 0, 1)), tol=0, perm=[2, 0, 1])
case("transpose", [t], lambda v: np.swapaxes(v, 0, 2), tol=0, a=0, b=2)
case("slice", [t], lambda v: v[:, :, 1:4:2], tol=0, dim=2, start=1, end=4, step=2)
case("slice", [t], lambda v: v[:, -2:, :], tol=0, dim=1, start=-2, end=3, step=1)
case("reshape", [t], lambda v: v.reshape(4, 6), tol=0, shape=[4, -1])
case("flatten", [t], lambda v: v.reshape(2, 12), tol=0, start=1, end=2)
case("unsqueeze", [t], lambda v: v[:, None], tol=0, dim=1)
case("expand", [randn(3, 1)], lambda v: np.broadcast_to(v, (2, 3, 4)), tol=0, shape=[2, 3, 4])
case("cat", [randn(2, 3), randn(2, 5)], lambda p, q: np.concatenate([p, q], axis=1), tol=0, dim=1)
case("stack", [randn(2, 3), randn(2, 3)], lambda p, q: np.stack([p, q], axis=1), tol=0, dim=1)
m = randn(2, 4, 5)
for k in (0, 1, -1, -2):
    case("tril", [m], lambda v: np.tril(v, k), tol=0, diagonal=k)
    case("triu", [m], lambda v: np.triu(v, k), tol=0, diagonal=k)
tab = randn(6, 3)
case("index_select", [tab, np.array([5, 0, 2, 2])], lambda v, i: v[i], tol=0, dim=0)
case("gather", [randn(3, 4), rng.integers(0, 3, (2, 4))], lambda v, i: np.take_along_axis(v, i, axis=0), tol=0, dim=0)
case("embedding", [tab, np.array([[1, 4], [0, 5], [3, 3]])], lambda v, i: v[i], tol=0)
cf = np.array([-2.7, -0.5, 0.0, 0.5, 2.7, 3.0])
case("cast", [cf], lambda v: np.trunc(v).astype(np.int64), dtype="f32", tol=0, to="i64")
case("cast", [cf], lambda v: v != 0, dtype="f32", tol=0, to="bool")

path = os.path.join(os.path.dirname(__file__), "..", "crates", "tessera", "tests", "fixtures", "ops.json")
with open(path, "w") as f:
    json.dump({"generator": "scripts/gen_op_fixtures.py", "numpy": np.__version__, "cases": cases}, f, separators=(",", ":"))
print(len(cases), "cases ->", os.path.normpath(path), os.path.getsize(path), "bytes")
