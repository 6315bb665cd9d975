# The six matmuls of attention's forward and backward with torch (CPU), the
# counterpart of `cargo run --release -p tessera --example attention_matmuls`:
# one batched call each and one call per slice, wall and process CPU ms.
# python3 scripts/anchors/torch_attention_matmuls.py 64 512 64 20
import sys, time
import torch

bh, n, d, reps = [int(x) for x in (sys.argv[1:5] if len(sys.argv) > 4 else (64, 512, 64, 20))]
torch.manual_seed(0)
q, k, v, do = (torch.randn(bh, n, d) for _ in range(4))
p = torch.randn(bh, n, n)
t = lambda x: x.transpose(-2, -1)
cases = [("S = Q Kt", q, t(k)), ("O = P V", p, v), ("dP = dO Vt", do, t(v)),
         ("dV = Pt dO", t(p), do), ("dQ = dS K", p, k), ("dK = dSt Q", t(p), q)]
for name, a, b in cases:
    flop = 2.0 * bh * a.shape[1] * a.shape[2] * b.shape[2]
    for per_slice in (False, True):
        def run():
            if per_slice:
                for i in range(bh):
                    torch.matmul(a[i:i + 1], b[i:i + 1])
            else:
                torch.matmul(a, b)
        run()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(reps):
            run()
        wall = (time.perf_counter() - t0) / reps
        cpu = (time.process_time() - c0) / reps
        print(f"{name:<12} {'per slice' if per_slice else 'batched':<9} wall {wall*1e3:7.2f} ms  cpu {cpu*1e3:7.2f} ms  {flop/wall/1e9:6.1f} GFLOP/s")
