"""Generates crates/tessera/tests/fixtures/grads.json: values and gradients of
a few composite functions, computed by JAX in float64, on small fixed random
inputs. `crates/tessera/tests/grad_fixtures.rs` rebuilds the same functions
with tessera's Tensor API and compares (and `tests/aot.rs` reuses them).

Each function `f(inputs) -> out` is stored with its inputs, a random
cotangent `cot` of `out`'s shape, `out`, and the gradients of
`sum(f(inputs) * cot)` with respect to the float inputs listed in `wrt`
(`jax.vjp`). Integer inputs (class targets) are stored as JSON integers.

Run once; the output is committed. Re-run only when adding functions:
    python3 scripts/gen_grad_fixtures.py
"""
import json
import math
import os

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

rng = np.random.default_rng(20240611)
IGNORE = -100


def randn(*shape):
    return rng.standard_normal(shape)


def enc(a):
    a = np.asarray(a)
    if np.issubdtype(a.dtype, np.integer):
        data = [int(v) for v in a.ravel()]
    else:
        # repr() of a Python float round-trips exactly.
        data = [float(v) for v in a.ravel()]
    return {"shape": list(a.shape), "data": data}


# --- The functions. Each mirrors one in crates/tessera/tests/common/models.rs.


def sdpa(q, k, v, causal):
    """Scaled dot-product attention over [batch, heads, seq, dim]; the causal
    mask is built from tril(ones) and applied with where(mask, s, -inf)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = jnp.matmul(q, jnp.swapaxes(k, -2, -1)) * scale
    if causal:
        n = q.shape[-2]
        mask = jnp.tril(jnp.ones((n, n))) > 0.5
        s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.matmul(p, v)


def layer_norm(x, w, b):
    """Mean and (biased) variance over the last dim, eps = 1e-5, affine."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    d = x - mean
    var = jnp.mean(d * d, axis=-1, keepdims=True)
    return d / jnp.sqrt(var + 1e-5) * w + b


def cross_entropy(logits, targets):
    """Mean negative log-likelihood over the rows whose target is not IGNORE."""
    lsm = jax.nn.log_softmax(logits, axis=-1)
    keep = targets != IGNORE
    safe = jnp.where(keep, targets, 0)
    picked = jnp.take_along_axis(lsm, safe[:, None], axis=1)[:, 0]
    mask = keep.astype(logits.dtype)
    return -jnp.sum(picked * mask) / jnp.sum(mask)


def mlp(x, w1, b1, w2, b2):
    """Two linear layers with the exact (erf) gelu between them."""
    h = jax.nn.gelu(jnp.matmul(x, w1) + b1, approximate=False)
    return jnp.matmul(h, w2) + b2


def fixture(fn, inputs, wrt):
    """`inputs`: (name, array) pairs; `wrt`: names of the float inputs."""
    names = [n for n, _ in inputs]
    values = dict(inputs)
    idx = [names.index(n) for n in wrt]

    def f(*diff):
        args = dict(values)
        args.update(zip(wrt, diff))
        return fn(*[args[n] for n in names])

    out, vjp = jax.vjp(f, *[values[n] for n in wrt])
    cot = randn(*np.shape(out))
    grads = vjp(jnp.asarray(cot))
    assert len(idx) == len(grads)
    return {
        "inputs": [dict(name=n, **enc(a)) for n, a in inputs],
        "wrt": wrt,
        "cotangent": enc(cot),
        "output": enc(out),
        "grads": {n: enc(g) for n, g in zip(wrt, grads)},
    }


B, H, N, D, DV = 2, 2, 5, 4, 3
fixtures = {}
for causal in (False, True):
    q, k, v = randn(B, H, N, D), randn(B, H, N, D), randn(B, H, N, DV)
    name = "sdpa_causal" if causal else "sdpa"
    fixtures[name] = fixture(
        lambda q, k, v, c=causal: sdpa(q, k, v, c),
        [("q", q), ("k", k), ("v", v)],
        ["q", "k", "v"],
    )

fixtures["layer_norm"] = fixture(
    layer_norm,
    [("x", randn(4, 6) * 2.0 + 0.5), ("w", randn(6)), ("b", randn(6))],
    ["x", "w", "b"],
)

targets = np.array([3, IGNORE, 0, 6, IGNORE, 2], dtype=np.int64)
fixtures["cross_entropy"] = fixture(
    cross_entropy,
    [("logits", randn(6, 7) * 2.0), ("targets", targets)],
    ["logits"],
)

fixtures["mlp"] = fixture(
    mlp,
    [
        ("x", randn(4, 5)),
        ("w1", randn(5, 8) * 0.5),
        ("b1", randn(8) * 0.1),
        ("w2", randn(8, 3) * 0.5),
        ("b2", randn(3) * 0.1),
    ],
    ["x", "w1", "b1", "w2", "b2"],
)

path = os.path.join(
    os.path.dirname(__file__), "..", "crates", "tessera", "tests", "fixtures", "grads.json"
)
with open(path, "w") as f:
    json.dump(fixtures, f, separators=(",", ":"))
    f.write("\n")
print(f"wrote {path} ({os.path.getsize(path)} bytes, {len(fixtures)} functions)")
