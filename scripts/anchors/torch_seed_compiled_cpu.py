# The compiled rows of ../shared/anchors/torch_seed_table_cpu.py only (its code,
# its measurement): torch.compile of the seed's sliced and naive attention,
# forward + backward, median of reps. For interleaving with
# `tessera seed-table --only graph` on a machine whose load changes:
#   python3 scripts/anchors/torch_seed_compiled_cpu.py [B H N D [reps]]
import math, sys, json, time
import torch
import torch.nn.functional as F

args = [int(x) for x in sys.argv[1:]]
B, H, N, D = args[:4] if len(args) >= 4 else (4, 16, 512, 64)
REPS = args[4] if len(args) >= 5 else 5
torch.manual_seed(0)

def sdpa_sliced(q, k, v, with_slice):
    bh = q.shape[0] * q.shape[1] if with_slice else 1
    scale = 1 / math.sqrt(q.size(-1))
    Q, K, V = (torch.flatten(t, end_dim=1) for t in (q, k, v))
    outs = []
    for Qi, Ki, Vi in zip(torch.tensor_split(Q, bh), torch.tensor_split(K, bh), torch.tensor_split(V, bh)):
        S = torch.matmul(Qi, Ki.transpose(-2, -1)) * scale
        P = F.softmax(S, dim=-1)
        outs.append(torch.matmul(P, Vi))
    return torch.cat(outs).reshape(q.shape[0], q.shape[1], v.shape[2], v.shape[3])

def measure(name, fn):
    q, k, v = (torch.randn(B, H, N, D, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, N, D)
    def step():
        out = fn(q, k, v); out.backward(g)
        q.grad = k.grad = v.grad = None
    t0 = time.perf_counter(); step(); first = time.perf_counter() - t0
    ts = []
    for _ in range(REPS):
        t0 = time.perf_counter(); step(); ts.append(time.perf_counter() - t0)
    ts.sort()
    print(json.dumps(dict(scenario=name, ms_median=round(1000 * ts[len(ts)//2], 2), first_call_s=round(first, 2))), flush=True)

torch._dynamo.reset()
measure("sliced graph (torch.compile)", torch.compile(lambda q, k, v: sdpa_sliced(q, k, v, True)))
torch._dynamo.reset()
measure("naive graph (torch.compile)", torch.compile(lambda q, k, v: sdpa_sliced(q, k, v, False)))
measure("F.scaled_dot_product_attention", lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
