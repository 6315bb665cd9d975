"""Reference values for crates/tessera/tests/nn.rs and optim.rs, in numpy.

Inputs are `seq(n, a, b) = sin(a*i + b)` so the Rust tests can rebuild them
without fixture files; the printed arrays are pasted into the tests.
Optimizer references follow PyTorch's documented update formulas
(torch.optim.SGD with dampening 0, torch.optim.AdamW without amsgrad).

    python3 scripts/nn_reference.py
"""
import numpy as np

np.set_printoptions(precision=17, floatmode="unique", linewidth=100)


def seq(n, a, b):
    return np.sin(a * np.arange(n) + b)


def show(name, v):
    flat = ", ".join(repr(float(x)) for x in np.asarray(v).ravel())
    print(f"const {name}: &[f64] = &[{flat}];")


def linear():
    x = seq(12, 0.7, 0.1).reshape(2, 2, 3)
    w = (seq(6, 1.3, 0.5) * 0.5).reshape(3, 2)
    b = np.array([0.1, -0.2])
    show("LINEAR_OUT", x @ w + b)


def norms():
    x = (seq(10, 0.9, 0.2) * 2).reshape(2, 5)
    w = seq(5, 0.4, 1.0)
    b = seq(5, 1.1, 0.3) * 0.1
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    show("LAYER_NORM_OUT", (x - mu) / np.sqrt(var + 1e-5) * w + b)
    ms = (x**2).mean(-1, keepdims=True)
    show("RMS_NORM_OUT", x / np.sqrt(ms + 1e-6) * w)


def attention(causal):
    B, T, D, H = 2, 3, 4, 2
    dh = D // H
    x = seq(B * T * D, 0.37, 0.0).reshape(B, T, D)
    proj = {}
    for i, name in enumerate("qkvo"):
        w = (seq(D * D, 0.5 + 0.3 * i, 0.2 * i) * 0.5).reshape(D, D)
        b = seq(D, 0.9 + 0.1 * i, 1.0) * 0.1
        proj[name] = (w, b)

    def lin(name, t):
        w, b = proj[name]
        return t @ w + b

    def heads(t):
        return t.reshape(B, T, H, dh).transpose(0, 2, 1, 3)

    q, k, v = heads(lin("q", x)), heads(lin("k", x)), heads(lin("v", x))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(dh)
    if causal:
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = (p @ v).transpose(0, 2, 1, 3).reshape(B, T, D)
    show("ATTENTION_CAUSAL_OUT" if causal else "ATTENTION_FULL_OUT", lin("o", o))


def cross_entropy():
    logits = (seq(12, 1.1, 0.2) * 2).reshape(4, 3)
    targets = np.array([2, 0, 1, 2])
    logp = logits - logits.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    softmax = np.exp(logp)
    onehot = np.eye(3)[targets]
    show("CE_ALL_LOSS", [-logp[np.arange(4), targets].mean()])
    show("CE_ALL_GRAD", (softmax - onehot) / 4)
    kept = targets != 1
    show("CE_IGNORE_LOSS", [-logp[np.arange(4), targets][kept].mean()])
    show("CE_IGNORE_GRAD", (softmax - onehot) * kept[:, None] / kept.sum())


P0 = np.array([1.0, -2.0, 0.5])
GRADS = [np.array([0.1, -0.3, 2.0]), np.array([-0.2, 0.4, 1.0])]


def sgd(lr=0.1, momentum=0.9, wd=0.01):
    p, buf = P0.copy(), None
    for i, g in enumerate(GRADS):
        d = g + wd * p
        buf = d if buf is None else momentum * buf + d
        p = p - lr * buf
        show(f"SGD_STEP{i + 1}", p)


def adamw(lr=0.01, b1=0.9, b2=0.999, eps=1e-8, wd=0.1):
    p, m, v = P0.copy(), np.zeros(3), np.zeros(3)
    for t, g in enumerate(GRADS, start=1):
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        step_size = lr / (1 - b1**t)
        denom = np.sqrt(v) / np.sqrt(1 - b2**t) + eps
        p = p - step_size * m / denom
        show(f"ADAMW_STEP{t}", p)


linear()
norms()
attention(causal=True)
attention(causal=False)
cross_entropy()
sgd()
adamw()
