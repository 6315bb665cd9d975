#!/usr/bin/env bash
# Data-parallel scaling in one call on a 4-GPU machine (issue 23; BENCHMARKS
# run G40): the tessera-cuda GPU tests in DIR/tests (nccl_gpu on 4 GPUs, the
# others on GPU 0), `tessera bench gpt` (GPT-2 small bf16, --no-retrace) on
# 1, 2 and 4 GPUs alternated, with --zero and --cuda-graphs, PyTorch DDP on
# 1, 2 and 4 GPUs (scripts/anchors/gpt_ddp_torch.py), then a 4-GPU
# TESSERA_CUDA_TIMELINE summarised by scripts/timeline_summary.py.
#
# usage: OUT=OUTDIR DIR/gpu-dp-scaling.sh, with DIR holding `tessera`,
# `timeline_summary.py` and tests/ (stage them as scripts/gpu-stage.sh does,
# the tests built with `cargo test --release -p tessera-cuda --features nccl
# --no-run`), run from the repository root. DP_RUNS (runs separated by `;`)
# replaces the list of bench runs, TIMELINE_ARGS the timeline's
# (default `--gpus 4`), DDP=0 skips PyTorch DDP.
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))')
links=$(mktemp -d); ln -sf "$nccl/libnccl.so.2" "$links/libnccl.so"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$links:$nccl:${LD_LIBRARY_PATH:-}
export TESSERA_CACHE_DIR=/tmp/tcache
d=$(dirname "$0"); b=$d/tessera
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
for t in $d/tests/*; do
  echo "== $(basename $t)" >> "$out/tests.txt"
  case $t in *nccl_gpu*) vis=0,1,2,3;; *) vis=0;; esac
  TESSERA_CUDA_TESTS=1 CUDA_VISIBLE_DEVICES=$vis timeout 200 "$t" --test-threads=1 >> "$out/tests.txt" 2>&1 || echo "FAILED: $t" | tee -a "$out/summary.txt"
done
grep -E "^== |^test result|FAILED|panicked" "$out/tests.txt" | tee -a "$out/summary.txt"
runs=${DP_RUNS:-"--gpus 1;--gpus 4;--gpus 4 --zero;--gpus 1 --cuda-graphs;--gpus 4 --cuda-graphs;--gpus 2;--gpus 2 --cuda-graphs;--gpus 1;--gpus 4;--gpus 2"}
IFS=';' read -ra bench_runs <<< "$runs"
for args in "${bench_runs[@]}"; do
  echo "== $args" | tee -a "$out/summary.txt"
  timeout 100 "$b" bench gpt --device cuda --dtype bf16 --steps 8 --no-retrace $args 2>>"$out/err.txt" | tee -a "$out/bench.jsonl" \
   | python3 -c 'import json,sys
for l in sys.stdin:
    if l.startswith("{"):
        d=json.loads(l); print("ms", d["ms_median"], "host", d["host_ms_median"], "tok/s", d["tokens_per_s"], "peak", d["peak_mb"], "graphs", d["cuda_graph_replays"], d["cuda_graph_fallbacks"], "loss", d["loss_last"])' | tee -a "$out/summary.txt"
done
for n in $([ "${DDP:-1}" = 0 ] || echo 1 2 4); do
  echo "== torchrun DDP $n" | tee -a "$out/summary.txt"
  timeout 100 torchrun --standalone --nproc_per_node $n scripts/anchors/gpt_ddp_torch.py 12 768 12 8 1024 50304 8 bf16 2>>"$out/torch.err" | tee -a "$out/summary.txt"
done
tl_args=${TIMELINE_ARGS:---gpus 4}
echo "== $tl_args timeline" | tee -a "$out/summary.txt"
TESSERA_CUDA_TIMELINE=$out/tl4 timeout 120 "$b" bench gpt --device cuda --dtype bf16 --steps 6 --no-retrace $tl_args > /dev/null 2>"$out/errtl.txt"
python3 $d/timeline_summary.py $out/tl4 6 2>&1 | head -12 | tee -a "$out/summary.txt"
rm -rf $out/tl4
