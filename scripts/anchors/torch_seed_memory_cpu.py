# The seed table's PyTorch side (../shared/anchors/torch_seed_table_cpu.py)
# with each row's exact peak too: the profiler's individual allocation
# records ("[memory]" kineto events, one per alloc/free, timestamped) summed
# in time order. The anchor's own method (per-op self memory sorted by op
# start) books an autograd node's frees before its kernel's allocations and
# undercounts (BENCHMARKS.md, run C31).
# The seed experiment (naive / sliced eager / sliced graph / SDPA) with PyTorch on
# this CPU, at a CPU-sized shape. Time = forward + backward, median of reps.
# Peak = bytes of tensors allocated by the step beyond inputs (traced with the
# CPU allocator's profiler), in MB.
import math, sys, json, time
import torch
import torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity

B, H, N, D = [int(x) for x in (sys.argv[1:5] if len(sys.argv) > 4 else (4, 16, 512, 64))]
torch.manual_seed(0)
res = []

def exact_peak(step):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    recs=[e for e in prof.profiler.kineto_results.events() if e.name()=="[memory]" and e.device_type()==torch.autograd.DeviceType.CPU]
    recs.sort(key=lambda e:(e.start_ns(), e.correlation_id() if hasattr(e,'correlation_id') else 0))
    cur=peak=0
    for e in recs:
        cur+=e.nbytes(); peak=max(peak,cur)
    return peak/2**20, len(recs)

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

def peak_mb(step):
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # walk allocation events in order to get the running peak
    cur = peak = 0
    evs = sorted([e for e in prof.events() if e.self_cpu_memory_usage != 0], key=lambda e: e.time_range.start)
    for e in evs:
        cur += e.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak / 2**20

def measure(name, fn, reps=5):
    q, k, v = (torch.randn(B, H, N, D, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, N, D)
    def step():
        out = fn(q, k, v); out.backward(g)
        q.grad = k.grad = v.grad = None
    t0 = time.perf_counter(); step(); first = time.perf_counter() - t0
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); step(); ts.append(time.perf_counter() - t0)
    ts.sort()
    try:
        pk = round(peak_mb(step), 1)
    except Exception as ex:
        pk = repr(ex)[:80]
    io = 4 * q.numel() * q.element_size() / 2**20  # output + three gradients
    ex = round(exact_peak(step)[0], 1)
    r = dict(exact_peak_mb=ex, exact_working_mb=round(ex - io, 1), scenario=name, peak_mb=pk, working_mb=(round(pk - io, 1) if isinstance(pk, float) else None), ms_median=round(1000 * ts[len(ts)//2], 2), first_call_s=round(first, 2))
    res.append(r); print(json.dumps(r), flush=True)

measure("naive eager", lambda q, k, v: sdpa_sliced(q, k, v, False))
measure("sliced eager", lambda q, k, v: sdpa_sliced(q, k, v, True))
torch._dynamo.reset()
measure("sliced graph (torch.compile)", torch.compile(lambda q, k, v: sdpa_sliced(q, k, v, True)))
torch._dynamo.reset()
measure("naive graph (torch.compile)", torch.compile(lambda q, k, v: sdpa_sliced(q, k, v, False)))
from torch._dynamo.utils import counters
print(json.dumps({k: dict(v) for k, v in counters.items() if k == "inductor"}))
measure("F.scaled_dot_product_attention", lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
a = torch.randn(2048, 2048); b = torch.randn(2048, 2048)
for _ in range(2): a @ b
t0 = time.perf_counter()
for _ in range(5): a @ b
dt = (time.perf_counter() - t0) / 5
print(json.dumps(dict(matmul_2048_f32_gflops=round(2 * 2048**3 / dt / 1e9, 1))))
print("fwd GFLOP", 4*B*H*N*N*D/1e9, "fwd+bwd GFLOP", 3.5*4*B*H*N*N*D/1e9)
