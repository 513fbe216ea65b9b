#!/usr/bin/env bash
# One device-machine call: the gpu-marked tests, then the benchmarks, results under $OUT.
# Usage (on the device machine, from the repo root): bash scripts/gpu_check.sh [ops...]
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1 TIGON_STRICT=1
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -m tigon.cli env | tee -a "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -m gpu -x tests 2>&1 | tail -30 | tee "$OUT/gpu_tests.txt"
if [ $# -gt 0 ]; then ops=(--ops "$@"); else ops=(); fi
python3 -m tigon.cli bench "${ops[@]}" --out "$OUT" 2>&1 | tail -60
