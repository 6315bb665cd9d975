# torch.matmul rate at N×N×N (default 8192, bf16), as the peer of
# `matmul_rate` (crates/tessera-cuda/examples): same warm-up, same count.
import json, sys, time
import torch

n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[sys.argv[2] if len(sys.argv) > 2 else "bf16"]
torch.backends.cuda.matmul.allow_tf32 = False
a = torch.randn(n, n, device="cuda", dtype=dtype)
b = torch.randn(n, n, device="cuda", dtype=dtype)
for _ in range(3):
    a @ b
torch.cuda.synchronize()
reps = 20
t0 = time.perf_counter()
for _ in range(reps):
    a @ b
torch.cuda.synchronize()
s = (time.perf_counter() - t0) / reps
print(json.dumps(dict(who="torch.matmul", n=n, dtype=str(dtype).split(".")[-1], ms=round(s * 1e3, 3), tflops=round(2 * n**3 / s / 1e12, 1))))
