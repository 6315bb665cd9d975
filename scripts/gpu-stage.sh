#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh needs on a GPU machine without Rust and
# copies it into DIR (default /work/main/.gpu/cuda): the tessera binary
# (with `tessera bench gpt`), matmul_rate, the tessera-cuda test executables
# (under tests/), and the scripts. Then, on the device:
# TESSERA_BIN_DIR=DIR scripts/gpu-check.sh OUT, or
# TESSERA_BIN_DIR=DIR scripts/bench_gpt.sh OUT (GPT step, tessera and PyTorch), or
# TESSERA_BIN_DIR=DIR scripts/bench_resnet_gpu.sh OUT (conv tests, ResNet)
set -euo pipefail
dir=${1:-/work/main/.gpu/cuda}
cd "$(dirname "$0")/.."
cargo build --release -p tessera-cli
cargo build --release -p tessera-cuda --examples
mkdir -p "$dir/tests" "$dir/scripts/anchors"
rm -f "$dir"/tests/*
cp target/release/tessera target/release/examples/matmul_rate "$dir/"
cargo test --release -p tessera-cuda --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] not in (["bin"], ["example"]):
        print(m["executable"])' \
  | while read -r exe; do cp "$exe" "$dir/tests/"; done
strip "$dir/tessera" "$dir/matmul_rate" "$dir"/tests/* 2>/dev/null || true
cp scripts/gpu-check.sh scripts/bench_gpt.sh scripts/bench_resnet_gpu.sh "$dir/scripts/"
cp scripts/anchors/*.py "$dir/scripts/anchors/"
du -sh "$dir"
