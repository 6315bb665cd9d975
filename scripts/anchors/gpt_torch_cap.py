# PyTorch eager under a memory cap: the largest batch of gpt_torch.py's model
# and step (forward, cross-entropy, backward, AdamW) that trains in CAP_MB of
# GPU memory, found by trying batch 1, 2, 3, … until one runs out of memory.
# The cap is PyTorch's own: torch.cuda.set_per_process_memory_fraction, so the
# caching allocator refuses what would pass it. Issue 20's peer: tessera must
# train a batch at least 2x this under the same cap.
# usage: gpt_torch_cap.py LAYERS D_MODEL HEADS SEQ VOCAB CAP_MB STEPS [f32|bf16] [MAX_BATCH]
import os, sys, json, time, math, contextlib, gc
import torch, torch.nn as nn, torch.nn.functional as F

L, D, H, T, V, CAP, S = map(int, sys.argv[1:8])
DT = sys.argv[8] if len(sys.argv) > 8 else "f32"
MAX_BATCH = int(sys.argv[9]) if len(sys.argv) > 9 else 64
dev = "cuda"
amp = (lambda: torch.autocast(dev, dtype=torch.bfloat16)) if DT == "bf16" else contextlib.nullcontext
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


# gpt_torch.py's model classes, read from its source (that script runs on
# import): the same Block and GPT, over the globals L, D, H, T, V set above.
_src = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt_torch.py")).read()
exec(_src[_src.index("class Block(nn.Module):"):_src.index("def run(mode):")])


def trains(batch):
    """ms per step (median of S after 1) and peak MiB, or None when the cap refuses it."""
    torch.manual_seed(0)
    m = opt = None
    try:
        m = GPT().to(dev); opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        ids = torch.randint(0, V, (batch, T + 1), device=dev); x, y = ids[:, :-1].contiguous(), ids[:, 1:].reshape(-1)
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        ts = []
        for step in range(S + 1):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with amp():
                loss = F.cross_entropy(m(x).view(-1, V).float(), y)
            loss.backward(); opt.step(); loss.item(); torch.cuda.synchronize()
            if step >= 1: ts.append((time.perf_counter() - t0) * 1e3)
        ts.sort()
        return ts[len(ts) // 2], torch.cuda.max_memory_allocated() / 2**20
    except torch.OutOfMemoryError:
        return None
    finally:
        del m, opt
        gc.collect(); torch.cuda.empty_cache()


total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(CAP * 2**20 / total)
best = None
for batch in range(1, MAX_BATCH + 1):
    got = trains(batch)
    if got is None:
        break
    best = (batch, *got)
line = dict(system="torch", mode="eager", dtype=DT, cap_mb=CAP, layers=L, d_model=D, seq=T, vocab=V)
if best is None:
    line.update(max_batch=0)
else:
    b, ms, peak = best
    line.update(max_batch=b, ms_median=round(ms, 2), tokens_per_s=round(b * T / (ms / 1e3)), peak_mb=round(peak),
                us_per_token=round(ms / (b * T) * 1e3, 4))
print(json.dumps(line), flush=True)
