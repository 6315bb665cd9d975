#!/usr/bin/env bash
# Data parallel over NCCL on a machine with 2 (or 4) GPUs (issue 23), every
# output into OUTDIR:
#   1. the NCCL tests (crates/tessera-cuda/tests/nccl_gpu.rs: collectives,
#      2-GPU training == 1-GPU with the global batch, with and without ZeRO-1);
#   2. tessera bench gpt --device cuda --dtype bf16 --gpus 1, then for N in
#      GPU_COUNTS (default: 2, and 4 on a machine with 4 or more) --gpus N and
#      --gpus N --zero (GPT-2 small, the bench's defaults, batch 8 per GPU);
#   3. PyTorch DDP (scripts/anchors/gpt_ddp_torch.py, torchrun) on 1 and N GPUs;
#   4. tessera train --device cuda (the reversal task, TRAIN_STEPS steps) on
#      1 GPU, then --gpus 2 and --gpus 2 --zero: the losses' worst relative
#      gap to the 1-GPU run (the global batch split over the GPUs).
#
# usage: scripts/gpu-dp-check.sh OUTDIR
# Binaries: TESSERA_BIN_DIR (default .gpu/pack, or .gpu/pack.tar.xz unpacked
# there) with `tessera` and tests/nccl_gpu; make it on the dev machine with
#   scripts/gpu-dp-check.sh --stage
# STEPS (timed steps, default 6).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--stage" ]; then
  set -e
  dir=.gpu/pack
  cargo build --release -p tessera-cli
  exe=$(cargo test --release -p tessera-cuda --features nccl --test nccl_gpu --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "nccl_gpu":
        print(m["executable"])')
  rm -rf "$dir"; mkdir -p "$dir/tests"
  cp "${CARGO_TARGET_DIR:-target}/release/tessera" "$dir/"
  cp "$exe" "$dir/tests/nccl_gpu"
  strip "$dir/tessera" "$dir/tests/nccl_gpu" 2>/dev/null || true
  tar cJf .gpu/pack.tar.xz -C .gpu pack
  du -sh .gpu/pack.tar.xz
  exit 0
fi
out=${1:?usage: scripts/gpu-dp-check.sh OUTDIR}
mkdir -p "$out"
bin=${TESSERA_BIN_DIR:-.gpu/pack}
[ -x "$bin/tessera" ] || tar xJf .gpu/pack.tar.xz -C .gpu
steps=${STEPS:-6}
# NVLink multicast stays off (shared hosts: see the device machines' KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null \
  || dirname "$(find / -name 'libnccl.so.2' 2>/dev/null | head -1)")
# cudarc loads `libnccl.so` (or .so.1/.9–.13), not `libnccl.so.2`, the
# name the pip wheel ships: a link of that name next to nothing else.
links=$(mktemp -d)
ln -sf "$nccl/libnccl.so.2" "$links/libnccl.so"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$links:$nccl:${LD_LIBRARY_PATH:-}
export TESSERA_CUDA_TESTS=1 TESSERA_CACHE_DIR=${TESSERA_CACHE_DIR:-$out/cache}
status=0
step() { echo "== $1" | tee -a "$out/summary.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
echo "libnccl: $nccl" | tee -a "$out/summary.txt"

# Per-part time limits (seconds) keep one call of the device tool under 300 s.
step "NCCL tests"
timeout "${T_TESTS:-90}" "$bin/tests/nccl_gpu" --test-threads=1 > "$out/tests.txt" 2>&1 || status=1
grep -E "^test |^test result|panicked" "$out/tests.txt" | tee -a "$out/summary.txt"

bench() {
  step "tessera bench gpt --device cuda --dtype bf16 --steps $steps $*"
  timeout "${T_BENCH:-70}" "$bin/tessera" bench gpt --device cuda --dtype bf16 --steps "$steps" "$@" \
    2>> "$out/bench.err" | tee -a "$out/summary.txt" || status=1
}
ddp() {
  step "torchrun --nproc_per_node $1 gpt_ddp_torch.py 12 768 12 8 1024 50304 $steps bf16"
  timeout "${T_TORCH:-60}" torchrun --standalone --nproc_per_node "$1" scripts/anchors/gpt_ddp_torch.py \
    12 768 12 8 1024 50304 "$steps" bf16 2>> "$out/torch.err" | tee -a "$out/summary.txt" || status=1
}
train() {
  step "tessera train --device cuda --steps $train_steps $*"
  timeout "${T_TRAIN:-90}" "$bin/tessera" train --device cuda --steps "$train_steps" \
    --eval-every "$train_steps" "$@" 2>> "$out/train.err" | grep -E "^(final|wall time|data parallel)" | tee -a "$out/summary.txt" || status=1
}
# The worst relative loss gap of OUTDIR/train-$1 to OUTDIR/train-1.
gap() {
  python3 - "$out/train-1/summary.json" "$out/train-$1/summary.json" <<'PY' | tee -a "$out/summary.txt"
import json, sys
a, b = (json.load(open(p))["losses"] for p in sys.argv[1:])
print(f"train {sys.argv[2].split('/')[-2]} vs 1 GPU: worst relative loss gap "
      f"{max(abs(x - y) / abs(x) for x, y in zip(a, b)):.2e} over {len(a)} steps")
PY
}
gpus=$(nvidia-smi -L | wc -l)
counts=${GPU_COUNTS:-$( [ "$gpus" -ge 4 ] && echo "2 4" || echo 2 )}
train_steps=${TRAIN_STEPS:-200}
bench --gpus 1
ddp 1
for n in $counts; do
  bench --gpus "$n"
  ddp "$n"
  bench --gpus "$n" --zero
done
train --out-dir "$out/train-1"
train --gpus 2 --out-dir "$out/train-2"
train --gpus 2 --zero --out-dir "$out/train-2zero"
gap 2
gap 2zero
tail -5 "$out/bench.err" "$out/torch.err" "$out/train.err" > "$out/errors_tail.txt" 2>&1
exit $status
