# PyTorch's peer of `executor_bench` (crates/tessera-cuda/examples): the
# same functions, milliseconds per synchronised call, median of REPS after
# 3 warm-ups, eager and replayed from a torch.cuda.CUDAGraph (static
# inputs, as `mode=reduce-overhead` does; no torch.compile).
import json, sys, time
import torch
import torch.nn.functional as F

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
torch.backends.cuda.matmul.allow_tf32 = False


def mlp(x, w, b):
    h = F.gelu(x @ w + b)
    g = torch.tanh(torch.softmax(h, 0) * 2.0) + 1.0
    p = torch.softmax(g.t(), -1)
    return p.reshape(-1), (torch.exp(g) - 1.0).sum(0)


def sliced(q, k, v, slices=16):
    scale = 1.0 / q.shape[3] ** 0.5
    qs, ks, vs = (t.flatten(0, 1).tensor_split(slices, 0) for t in (q, k, v))
    outs = [torch.softmax(qi @ ki.transpose(-2, -1) * scale, -1) @ vi for qi, ki, vi in zip(qs, ks, vs)]
    return torch.cat(outs, 0).reshape(q.shape[0], q.shape[1], v.shape[2], v.shape[3])


def timed(call, n):
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    ms = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - t) * 1e3)
    return sorted(ms)[n // 2]


def bench(name, f, inputs, n):
    print(json.dumps(dict(who="torch", case=name, mode="eager", ms_per_call=round(timed(lambda: f(*inputs), n), 4))))
    static = [t.clone() for t in inputs]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            f(*static)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = f(*static)

    def replay():
        for dst, src in zip(static, inputs):
            dst.copy_(src)
        graph.replay()
        return [o.clone() for o in outs]

    print(json.dumps(dict(who="torch", case=name, mode="cuda-graph", ms_per_call=round(timed(replay, n), 4))))


def bandwidth(n=1 << 26, reps=20):
    # The peer of executor_bench's pointwise rows: a + b, exp(a), a copy.
    for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        a, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
        dst = torch.empty_like(a)
        size = n * a.element_size()
        add, exp, copy = timed(lambda: a + b, reps), timed(lambda: torch.exp(a), reps), timed(lambda: dst.copy_(a), reps)
        print(json.dumps(dict(who="torch", case=f"pointwise {name} 2^26", add_ms=round(add, 4), add_gbs=round(3 * size / add / 1e6),
                              exp_ms=round(exp, 4), exp_gbs=round(2 * size / exp / 1e6), copy_ms=round(copy, 4), copy_gbs=round(2 * size / copy / 1e6))))


bandwidth()
g = torch.Generator(device="cuda").manual_seed(0)
mk = lambda *s, dtype=torch.float32: torch.randn(*s, device="cuda", dtype=dtype, generator=g)
bench("mlp f32 64x128x96", mlp, [mk(64, 128), mk(128, 96), mk(96)], reps)
bench("sliced attention bf16 4x16x1024x64 /16", sliced, [mk(4, 16, 1024, 64, dtype=torch.bfloat16) for _ in range(3)], reps // 4)
