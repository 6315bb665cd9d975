# A copy of ../shared/anchors/gpt_torch.py (scripts/gpu-stage.sh bundles scripts/anchors/):
# PyTorch's side of `tessera bench gpt`; scripts/bench_gpt.sh runs both.
# The same GPT-2-shaped model and step in PyTorch: eager and torch.compile, f32 (no TF32).
# usage: gpt_torch.py DEVICE LAYERS D_MODEL HEADS BATCH SEQ VOCAB STEPS [f32|bf16]
# bf16: torch.autocast(bfloat16) around forward and loss (f32 master weights).
# GPT_TORCH_MODES (default "eager,compile"): the runs, in order; "compile:B"
# is torch.compile with backend B (e.g. compile:tessera, tessera-py's backend;
# its GPU memory comes from PyTorch's allocator, or with
# TESSERA_TORCH_ALLOCATOR=0 from its own, whose peak is then added to peak_mb).
# On CUDA: peak_mb (the most bytes of live tensors), reserved_mb (PyTorch's
# pool at its largest) and device_mb (the GPU memory the process holds after
# the last step: both pools, contexts, workspaces; run one mode per process
# for it to be that mode's).
import os, sys, json, time, math, contextlib
import torch, torch.nn as nn, torch.nn.functional as F
dev = sys.argv[1]; L, D, H, B, T, V, S = map(int, sys.argv[2:9])
DT = sys.argv[9] if len(sys.argv) > 9 else "f32"
amp = (lambda: torch.autocast(dev, dtype=torch.bfloat16)) if DT == "bf16" else contextlib.nullcontext
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
class Block(nn.Module):
    def __init__(s):
        super().__init__(); s.ln1 = nn.LayerNorm(D); s.qkv = nn.Linear(D, 3*D); s.proj = nn.Linear(D, D)
        s.ln2 = nn.LayerNorm(D); s.fc1 = nn.Linear(D, 4*D); s.fc2 = nn.Linear(4*D, D)
    def forward(s, x):
        b, t, _ = x.shape
        q, k, v = s.qkv(s.ln1(x)).split(D, dim=2)
        q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D // H)
        att = att.masked_fill(torch.ones(t, t, device=x.device, dtype=torch.bool).triu(1), float('-inf')).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, D)
        x = x + s.proj(y)
        return x + s.fc2(F.gelu(s.fc1(s.ln2(x))))
class GPT(nn.Module):
    def __init__(s):
        super().__init__(); s.tok = nn.Embedding(V, D); s.pos = nn.Embedding(T, D)
        s.blocks = nn.ModuleList([Block() for _ in range(L)]); s.lnf = nn.LayerNorm(D); s.head = nn.Linear(D, V, bias=False)
    def forward(s, idx):
        x = s.tok(idx) + s.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in s.blocks: x = b(x)
        return s.head(s.lnf(x))
def run(mode):
    torch.manual_seed(0)
    m = GPT().to(dev); opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    ids = torch.randint(0, V, (B, T + 1), device=dev); x, y = ids[:, :-1].contiguous(), ids[:, 1:].reshape(-1)
    backend = mode.split(":")[1] if ":" in mode else "inductor"
    f = m if mode == "eager" else torch.compile(m, backend=backend)
    tessera = __import__("tessera") if backend == "tessera" else None
    if tessera and dev == "cuda": tessera.cuda_reset_peak_memory()
    if dev == "cuda": torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
    else: base = 0
    ts, losses = [], []; t_first = time.perf_counter(); first = 0
    stats = (lambda: tessera.cuda_allocator_stats()) if tessera and dev == "cuda" else (lambda: {})
    for step in range(S + 3):
        if step == 3: lent0 = stats().get("external_allocs", 0)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with amp():
            loss = F.cross_entropy(f(x).view(-1, V).float(), y)
        loss.backward(); opt.step()
        l = loss.item()
        if dev == "cuda": torch.cuda.synchronize()
        if step == 0: first = time.perf_counter() - t_first
        losses.append(l)
        if step >= 3: ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort(); med = ts[len(ts) // 2]
    peak = torch.cuda.max_memory_allocated() / 2**20 if dev == "cuda" else 0
    own = tessera and dev == "cuda" and tessera.cuda_allocator_stats()["allocator"] == "tessera"
    if own: peak += tessera.cuda_memory_stats()[1] / 2**20
    mem = {}
    if dev == "cuda":
        free, total = torch.cuda.mem_get_info()
        mem = dict(reserved_mb=round(torch.cuda.max_memory_reserved() / 2**20), device_mb=round((total - free) / 2**20))
        if tessera: mem.update(tessera_allocator=stats()["allocator"], tessera_blocks_per_step=(stats()["external_allocs"] - lent0) / S)
    print(json.dumps(dict(system="torch", mode=mode, dtype=DT, params=sum(p.numel() for p in m.parameters()), ms_median=round(med, 2),
        tokens_per_s=round(B * T / (med / 1e3)), peak_mb=round(peak), base_mb=round(base / 2**20), first_step_s=round(first, 2),
        loss_first=round(losses[0], 4), loss_last=round(losses[-1], 4), **mem)), flush=True)
for mode in os.environ.get("GPT_TORCH_MODES", "eager,compile").split(","):
    try: run(mode)
    except Exception as e: print(json.dumps(dict(system="torch", mode=mode, error=repr(e)[:200])), flush=True)
