#!/usr/bin/env bash
# The CUDA check, in one go on a GPU machine, every output into OUTDIR:
#   1. the CUDA test suite (differential tests against the CPU);
#   2. tessera seed-table --device cuda --dtype bf16 --shape 8,32,2048,128 --json;
#   3. PyTorch's seed table from the same run (scripts/anchors/torch_seed_table_gpu.py);
#   4. cuBLASLt bf16 8192³ through tessera next to torch.matmul;
#   5. compute-sanitizer (memcheck, racecheck) over the flash kernels' test.
#
# usage: scripts/gpu-check.sh OUTDIR
# With cargo on the machine the tests and binaries are built here. Without
# (the lent GPU machines have no Rust), set TESSERA_BIN_DIR to a folder of
# prebuilt binaries: tessera, matmul_rate and the test executables under
# tests/ (scripts/gpu-stage.sh makes one).
# Budget switches passed to the PyTorch anchor: ANCHOR_DTYPES,
# ANCHOR_SKIP_SLICED_COMPILE (see the script); SEED_REPS (default 5);
# SANITIZER_TIMEOUT (seconds per tool, default 240).
set -uo pipefail
out=${1:?usage: scripts/gpu-check.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export TESSERA_CUDA_TESTS=1
export TESSERA_CACHE_DIR=${TESSERA_CACHE_DIR:-$out/cache}
status=0
step() { echo "== $1" | tee -a "$out/summary.txt"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt" 2>&1

step "CUDA tests"
if [ -n "${TESSERA_BIN_DIR:-}" ]; then
  bin=$TESSERA_BIN_DIR
  for t in "$bin"/tests/*; do
    "$t" --test-threads=1 >> "$out/tests.txt" 2>&1 || { echo "FAILED: $t" | tee -a "$out/summary.txt"; status=1; }
  done
else
  cargo build --release -p tessera-cli -p tessera-cuda --examples
  bin=target/release
  cargo test --release -p tessera-cuda -- --test-threads=1 > "$out/tests.txt" 2>&1 || status=1
fi
grep -E "^test result|FAILED|panicked" "$out/tests.txt" | tee -a "$out/summary.txt"

step "tessera seed-table (cuda, bf16, 8,32,2048,128)"
"$bin/tessera" seed-table --device cuda --dtype bf16 --shape 8,32,2048,128 --reps "${SEED_REPS:-5}" --json \
  > "$out/seed_table_tessera.jsonl" 2> "$out/seed_table_tessera.err" || status=1
cat "$out/seed_table_tessera.jsonl" | tee -a "$out/summary.txt"
tail -3 "$out/seed_table_tessera.err" >> "$out/summary.txt"

step "matmul 8192^3 bf16: tessera, then torch"
"$bin/matmul_rate" 8192 bf16 2>&1 | tee -a "$out/summary.txt" || status=1
python3 scripts/anchors/torch_matmul.py 8192 bf16 2>&1 | tee -a "$out/summary.txt" || status=1

step "PyTorch seed table (same machine, same run)"
PYTHONUNBUFFERED=1 python3 scripts/anchors/torch_seed_table_gpu.py 8 32 2048 128 \
  > "$out/seed_table_torch.txt" 2>&1 || status=1
grep '^{"scenario' "$out/seed_table_torch.txt" | tee -a "$out/summary.txt"

step "compute-sanitizer on the flash kernels (memcheck, racecheck)"
flash_test=$(ls "$bin"/tests/flash_gpu-* "$bin"/deps/flash_gpu-* 2>/dev/null | grep -v '\.d$' | head -1)
sanitizer=/usr/local/cuda/bin/compute-sanitizer
for tool in memcheck racecheck; do
  if [ -z "$flash_test" ] || [ ! -x "$sanitizer" ]; then
    echo "FAILED: no flash test executable or no compute-sanitizer" | tee -a "$out/summary.txt"; status=1; break
  fi
  timeout "${SANITIZER_TIMEOUT:-240}" "$sanitizer" --tool "$tool" --error-exitcode 1 \
    "$flash_test" --test-threads=1 > "$out/sanitizer_$tool.txt" 2>&1 \
    || { echo "FAILED: $tool (see sanitizer_$tool.txt)" | tee -a "$out/summary.txt"; status=1; }
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^test result" "$out/sanitizer_$tool.txt" | tee -a "$out/summary.txt"
done
exit $status
