# PyTorch peer of crates/tessera-cuda/examples/rows_rate.rs: same ops, sizes,
# warm-up and count; plus a device-to-device copy as the bandwidth ceiling.
import json, sys, time
import torch

dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[sys.argv[1] if len(sys.argv) > 1 else "bf16"]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 26
x = torch.randn(n // 4096, 4096, device="cuda", dtype=dtype)
y = torch.randn(n // 4096, 4096, device="cuda", dtype=dtype)
b = n * x.element_size()
z = torch.empty_like(x)

def t(op, bytes_, f):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        f()
    torch.cuda.synchronize()
    s = (time.perf_counter() - t0) / reps
    print(json.dumps(dict(who="torch", op=op, dtype=str(dtype).split(".")[-1], ms=round(s * 1e3, 3), gbs=round(bytes_ / s / 1e9))))

t("copy", 2 * b, lambda: z.copy_(x))
t("exp", 2 * b, lambda: x.exp())
t("add", 3 * b, lambda: x + y)
t("chain relu(x*2+y) eager", 3 * b, lambda: torch.relu(x * 2.0 + y))
t("softmax(-1)", 2 * b, lambda: torch.softmax(x, -1))
t("sum(-1)", b, lambda: x.sum(-1))
