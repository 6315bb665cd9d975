# PyTorch DDP anchor of `tessera bench gpt --gpus N`: the GPT-2-shaped model of
# gpt_torch.py (its classes, read from it), trained
# data-parallel with DistributedDataParallel (NCCL, 25 MB buckets, gradients
# all-reduced during the backward), AdamW lr 1e-3, random tokens, no TF32.
# usage: torchrun --standalone --nproc_per_node N gpt_ddp_torch.py LAYERS D_MODEL HEADS BATCH SEQ VOCAB STEPS [f32|bf16] [eager|compile]
# BATCH is per GPU (global batch = N x BATCH). Rank 0 prints one JSON line:
# ms/step (median of the timed steps), tokens/s of all GPUs, peak memory per GPU (the largest).
import os, sys, json, time, math, contextlib
import torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
L, D, H, B, T, V, S = map(int, sys.argv[1:8])
DT = sys.argv[8] if len(sys.argv) > 8 else "f32"
MODE = sys.argv[9] if len(sys.argv) > 9 else "eager"
dev = "cuda"
amp = (lambda: torch.autocast(dev, dtype=torch.bfloat16)) if DT == "bf16" else contextlib.nullcontext
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
# gpt_torch.py's model classes, read from its source (that script runs on
# import): the same Block and GPT, over the globals L, D, H, T, V set above.
_src = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt_torch.py")).read()
exec(_src[_src.index("class Block(nn.Module):"):_src.index("def run(mode):")])
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
local = int(os.environ.get("LOCAL_RANK", rank))
torch.cuda.set_device(local)
torch.manual_seed(0)
m = GPT().to(dev)
ddp = DDP(m, device_ids=[local], bucket_cap_mb=25)
f = ddp if MODE == "eager" else torch.compile(ddp)
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
g = torch.Generator(device=dev); g.manual_seed(1 + rank)
ids = torch.randint(0, V, (B, T + 1), device=dev, generator=g); x, y = ids[:, :-1].contiguous(), ids[:, 1:].reshape(-1)
torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
ts, losses = [], []
for step in range(S + 3):
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    with amp():
        loss = F.cross_entropy(f(x).view(-1, V).float(), y)
    loss.backward(); opt.step()
    l = loss.detach().clone(); dist.all_reduce(l, op=dist.ReduceOp.AVG); l = l.item()
    torch.cuda.synchronize()
    losses.append(l)
    if step >= 3: ts.append((time.perf_counter() - t0) * 1e3)
ts.sort(); med = ts[len(ts) // 2]
peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**20], device=dev); dist.all_reduce(peak, op=dist.ReduceOp.MAX)
if rank == 0:
    print(json.dumps(dict(system="torch-ddp", mode=MODE, dtype=DT, gpus=world, params=sum(p.numel() for p in m.parameters()),
        batch_per_gpu=B, ms_median=round(med, 2), tokens_per_s=round(world * B * T / (med / 1e3)),
        peak_mb_per_gpu=round(peak.item()), base_mb=round(base / 2**20),
        loss_first=round(losses[0], 4), loss_last=round(losses[-1], 4))), flush=True)
dist.destroy_process_group()
