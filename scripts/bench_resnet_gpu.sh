#!/usr/bin/env bash
# ResNet on the GPU in one go, every output into OUTDIR:
#   1. the convolution path tests (cuDNN and the direct kernels against the
#      CPU: tests/conv_paths_gpu, tests/conv_gpu), then conv_gpu once more
#      with libcudnn off the library path (the fallback: a warning, no panic);
#   2. tessera bench resnet --device cuda next to resnet_torch.py --device
#      cuda, eager and torch.compile, for each config of CONFIGS
#      ("depth:task:batch:dtype", default: ResNet-50 inference and ResNet-18
#      training, batch 32, f32 and bf16); with CUDA_GRAPHS=1 also
#      `tessera bench resnet --cuda-graphs` and torch.compile's
#      mode="reduce-overhead"; with PROFILE=1 first the GPU time by op of
#      each config's tessera run (TESSERA_CUDA_PROFILE=1) into profile.txt.
# TESTS=0 skips step 1.
#
# usage: TESSERA_BIN_DIR=DIR scripts/bench_resnet_gpu.sh OUTDIR
# DIR holds the tessera binary and tests/ (scripts/gpu-stage.sh makes one).
# cuDNN is looked up in PyTorch's wheels (nvidia.cudnn) unless CUDNN_LIB says.
set -uo pipefail
out=${1:?usage: TESSERA_BIN_DIR=DIR scripts/bench_resnet_gpu.sh OUTDIR}
bin=${TESSERA_BIN_DIR:?set TESSERA_BIN_DIR to the staged binaries}
anchors=${ANCHORS:-$(dirname "$0")/anchors}
mkdir -p "$out"
cudnn=${CUDNN_LIB:-$(python3 -c 'import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], "lib"))' 2>/dev/null)}
base=/usr/local/cuda/lib64
export LD_LIBRARY_PATH=$base:$cudnn
export TESSERA_CUDA_TESTS=1 TESSERA_CACHE_DIR=${TESSERA_CACHE_DIR:-/tmp/tessera-cache}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
steps=${STEPS:-10}
warmup=${WARMUP:-3}
status=0
say() { echo "== $*" | tee -a "$out/summary.txt"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$out/summary.txt"
say "cuDNN from $cudnn: $(ls "$cudnn" 2>/dev/null | grep -m1 'libcudnn.so.')"

if [ "${TESTS:-1}" = 1 ]; then
say "convolution tests"
for t in "$bin"/tests/conv_paths_gpu-* "$bin"/tests/conv_gpu-*; do
  timeout 240 "$t" --test-threads=1 >> "$out/tests.txt" 2>&1 || { say "FAILED: $t"; status=1; }
done
grep -E "^test |^test result|panicked" "$out/tests.txt" | tee -a "$out/summary.txt"

say "conv_gpu without libcudnn on the library path (the fallback)"
if LD_LIBRARY_PATH=$base python3 -c 'import ctypes; ctypes.CDLL("libcudnn.so.9")' 2>/dev/null; then
  say "libcudnn.so.9 is on the default path: the fallback is not exercised"
else
  LD_LIBRARY_PATH=$base timeout 120 "$bin"/tests/conv_gpu-* --test-threads=1 > "$out/fallback.txt" 2>&1 || { say "FAILED: fallback"; status=1; }
  grep -E "cuDNN is unavailable|^test result|panicked" "$out/fallback.txt" | sort | uniq -c | tee -a "$out/summary.txt"
fi
fi

for c in ${CONFIGS:-50:inference:32:bf16 18:train:32:bf16 50:inference:32:f32 18:train:32:f32}; do
  IFS=: read -r depth task batch dtype <<< "$c"
  args=(--depth "$depth" --task "$task" --batch "$batch" --dtype "$dtype" --steps "$steps" --warmup "$warmup" --device cuda)
  say "resnet$depth $task batch $batch $dtype"
  if [ "${PROFILE:-0}" = 1 ]; then
    echo "== $c" >> "$out/profile.txt"
    TESSERA_CUDA_PROFILE=1 timeout 120 "$bin/tessera" bench resnet "${args[@]}" 2>> "$out/profile.txt" > /dev/null
  fi
  graphs=("")
  torch_modes=(eager compile)
  if [ "${CUDA_GRAPHS:-0}" = 1 ]; then graphs+=(--cuda-graphs); torch_modes+=(reduce-overhead); fi
  for g in "${graphs[@]}"; do
    timeout 120 "$bin/tessera" bench resnet "${args[@]}" $g 2>> "$out/bench.err" | tee -a "$out/bench.jsonl" "$out/summary.txt" || { say "FAILED: tessera $c $g"; status=1; }
  done
  for mode in "${torch_modes[@]}"; do
    PYTHONUNBUFFERED=1 timeout 150 python3 "$anchors/resnet_torch.py" "${args[@]}" --mode "$mode" 2>> "$out/bench.err" \
      | tee -a "$out/bench.jsonl" "$out/summary.txt" || { say "FAILED: torch $mode $c"; status=1; }
  done
done
tail -5 "$out/bench.err" >> "$out/summary.txt"
exit $status
