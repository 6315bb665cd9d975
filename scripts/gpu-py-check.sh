#!/usr/bin/env bash
# tessera-py on a GPU machine without Rust (the device tool's machines):
# installs the abi3 wheel built here and pytest, then runs the CUDA pytest
# cases, the seed table from PyTorch code on CUDA (tessera vs Inductor) and
# the GPT-2-small training step under eager, Inductor and tessera.
#
# Stage on the dev machine first (--stage), then run with no argument from
# the repository root on the GPU machine; results go to $OUT (or /tmp/out).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--stage" ]; then
  venv=${TMPDIR:-/tmp}/tessera-py-venv
  rm -rf .gpu/wheel .gpu/pywheels
  (cd crates/tessera-py && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" \
    maturin build --release --compatibility linux -o ../../.gpu/wheel)
  "$venv/bin/pip" download -q pytest --only-binary=:all: -d .gpu/pywheels
  exit
fi
out=${OUT:-/tmp/out}
mkdir -p "$out"
PIP_BREAK_SYSTEM_PACKAGES=1 python -m pip install -q --no-deps .gpu/pywheels/*.whl .gpu/wheel/*.whl
python -c "import tessera, torch; print(tessera.cuda_describe(), 'torch', torch.__version__)" | tee "$out/py-device.txt"
# Each part bounded, so one that hangs leaves the others their time.
(cd crates/tessera-py && TESSERA_CUDA_TESTS=1 timeout 300 python -m pytest -q -p no:cacheprovider tests/test_cuda.py) 2>&1 \
  | tee "$out/py-cuda-tests.txt" | tail -25
GPT_TORCH_MODES=${GPT_MODES:-eager,compile,compile:tessera} timeout 300 \
  python scripts/anchors/gpt_torch.py cuda 12 768 12 8 1024 50304 6 f32 2>&1 \
  | tee "$out/py-gpt2-step.txt" | grep '^{'
# One JSON line per scenario as it finishes.
timeout 300 python -m tessera.seed_table --device cuda --shape "${SEED_SHAPE:-4,16,1024,64}" --reps 5 --json 2>&1 \
  | tee "$out/py-seed-table-cuda.txt" | grep '^{'
