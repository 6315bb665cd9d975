#!/usr/bin/env bash
# The GPT training-step benchmark, tessera beside PyTorch, in one go (one
# device call): for each dtype, `tessera bench gpt` eager and compiled,
# then scripts/anchors/gpt_torch.py (PyTorch eager and torch.compile), all
# with the same shape, each printing one JSON line on stdout (the lines
# are also collected in OUTDIR/gpt.jsonl; each run's stderr in OUTDIR/).
#
# usage: scripts/bench_gpt.sh [OUTDIR]        (default: bench-gpt-out)
# The shape, by environment (defaults: GPT-2 small, issue 18's):
#   LAYERS=12 D_MODEL=768 HEADS=12 VOCAB=50304 BATCH=8 SEQ=1024 STEPS=10
#   DEVICE=cuda DTYPES="f32 bf16" MODES="eager compiled" TORCH=1 (0: skip PyTorch)
# The MLP is 4 × D_MODEL wide (as gpt_torch.py's); both sides run 3 warmup
# steps before the STEPS timed ones. On a machine without Rust set
# TESSERA_BIN_DIR to a folder holding the `tessera` binary
# (scripts/gpu-stage.sh makes one); otherwise target/release/tessera is
# built here. The CPU smoke size, for instance:
#   DEVICE=cpu LAYERS=4 D_MODEL=256 HEADS=4 VOCAB=1024 SEQ=128 scripts/bench_gpt.sh
set -uo pipefail
out=${1:-bench-gpt-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
L=${LAYERS:-12} D=${D_MODEL:-768} H=${HEADS:-12} V=${VOCAB:-50304}
B=${BATCH:-8} T=${SEQ:-1024} S=${STEPS:-10} DEV=${DEVICE:-cuda}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export TESSERA_CACHE_DIR=${TESSERA_CACHE_DIR:-$out/cache}
if [ -n "${TESSERA_BIN_DIR:-}" ]; then
  tessera=$TESSERA_BIN_DIR/tessera
else
  cargo build --release -p tessera-cli >&2 || exit 1
  tessera=target/release/tessera
fi
status=0
jsonl=$out/gpt.jsonl
: > "$jsonl"
# A failed run still leaves a line: its system, mode, dtype and last error line.
failed() {
  python3 -c 'import json, sys; print(json.dumps(dict(system=sys.argv[1], mode=sys.argv[2], dtype=sys.argv[3], error=sys.argv[4][-300:])))' \
    "$1" "$2" "$3" "$(tail -1 "$4" 2>/dev/null)"
}
echo "bench_gpt: $L layers, d$D, $H heads, vocab $V, batch $B x $T, $S steps on $DEV; load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
[ "$DEV" = cuda ] && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2
for dt in ${DTYPES:-f32 bf16}; do
  for mode in ${MODES:-eager compiled}; do
    err=$out/tessera_${mode}_$dt.err
    line=$("$tessera" bench gpt --layers "$L" --d-model "$D" --heads "$H" --vocab "$V" \
      --batch "$B" --seq "$T" --steps "$S" --warmup 3 --dtype "$dt" --mode "$mode" \
      --device "$DEV" 2> "$err") || { status=1; line=$(failed tessera "$mode" "$dt" "$err"); }
    echo "$line" | tee -a "$jsonl"
  done
  if [ "${TORCH:-1}" = 1 ]; then
    err=$out/torch_$dt.err
    PYTHONUNBUFFERED=1 python3 scripts/anchors/gpt_torch.py "$DEV" "$L" "$D" "$H" "$B" "$T" "$V" "$S" "$dt" \
      2> "$err" | grep '^{' | tee -a "$jsonl"
    [ "${PIPESTATUS[0]}" = 0 ] || { status=1; failed torch "eager+compile" "$dt" "$err" | tee -a "$jsonl"; }
  fi
done
echo "load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
exit $status
