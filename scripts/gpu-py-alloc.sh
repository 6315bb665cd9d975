#!/usr/bin/env bash
# tessera's CUDA memory from PyTorch's caching allocator (issue 19) on a GPU
# machine without Rust (the device tool's machines). Stage on the dev
# machine with --stage: the wheel and pytest (as scripts/gpu-py-check.sh
# --stage does) and the tessera-cuda test executables external_alloc_gpu
# and executor, into .gpu/. Then run with no argument from the repository
# root on the device; results go to $OUT (or /tmp/out):
#
# - gpt-*.txt: the GPT-2-small f32 training step (BENCHMARKS G31's command),
#   one process per run so that device_mb is that run's: torch.compile
#   (Inductor); backend="tessera" on PyTorch's allocator; backend="tessera"
#   on its own (TESSERA_TORCH_ALLOCATOR=0, the allocator of G31);
# - py-cuda-tests.txt: the CUDA pytest cases;
# - rust-gpu-tests.txt: the two tessera-cuda test executables.
#
# Each part is bounded so that the whole fits one 600 s device call.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--stage" ]; then
  scripts/gpu-py-check.sh --stage || exit 1
  rm -rf .gpu/alloc-tests && mkdir -p .gpu/alloc-tests
  cargo test --release -p tessera-cuda --test external_alloc_gpu --test executor --no-run \
      --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])' \
    | while read -r exe; do cp "$exe" .gpu/alloc-tests/; done
  strip .gpu/alloc-tests/* 2>/dev/null || true
  du -sh .gpu/wheel .gpu/pywheels .gpu/alloc-tests
  exit
fi
out=${OUT:-/tmp/out}
mkdir -p "$out"
PIP_BREAK_SYSTEM_PACKAGES=1 python -m pip install -q --no-deps .gpu/pywheels/*.whl .gpu/wheel/*.whl
python -c "import tessera, torch; print(tessera.cuda_describe(), 'torch', torch.__version__)" | tee "$out/device.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$out/device.txt" 2>&1
shape="cuda 12 768 12 8 1024 50304 6 f32"
run_gpt() { # name, mode, extra environment
  env GPT_TORCH_MODES="$2" $3 timeout 120 python scripts/anchors/gpt_torch.py $shape 2>&1 \
    | tee "$out/gpt-$1.txt" | grep '^{'
}
run_gpt inductor compile ""
run_gpt tessera compile:tessera ""
run_gpt tessera-own-allocator compile:tessera TESSERA_TORCH_ALLOCATOR=0
(cd crates/tessera-py && TESSERA_CUDA_TESTS=1 timeout 240 python -m pytest -q -p no:cacheprovider tests/test_cuda.py) 2>&1 \
  | tee "$out/py-cuda-tests.txt" | tail -25
for t in .gpu/alloc-tests/*; do
  echo "== $t"
  TESSERA_CUDA_TESTS=1 timeout 60 "$t" --test-threads=1 2>&1 | tail -8
done 2>&1 | tee "$out/rust-gpu-tests.txt"
