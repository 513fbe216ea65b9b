#!/usr/bin/env bash
# QLoRA and DoRA steps, tigon vs PEFT (+ bitsandbytes) eager vs Liger-Kernel on PEFT
# (scripts/qlora_bench.py), and tigon's QLoRA gpu tests. Device machine, repo root.
#   qlora8b  Llama-3-8B shape, nf4 (double quantisation), r=16 all-linear, 4 x 2048 tokens, gradient
#            checkpointing; peak memory over 1k..16k tokens (batch 1). Targets: >= 1.6x PEFT+bnb tok/s,
#            peak <= 10 GB, losses equal within bf16 tolerance.
#   dora1b   the 1B Llama shape (hidden 2048, 16 layers), bf16 base, DoRA r=16 all-linear, 4 x 2048; the same sweep.
#            Targets: >= 1.8x PEFT DoRA tok/s, peak <= 0.5x.
#   int8     the 1B shape on an LLM.int8 base, r=16, 4 x 2048 (no target; a check that it runs)
#   tests    the dequantise / DoRA op tests with compiled kernels, the gpu-marked QLoRA / DoRA tests
# Usage: bash scripts/qlora_gpu_compare.sh [prep|qlora8b|dora1b|int8|tests ...]   (default: all)
#   prep     only write the random 8B and 1B models to $WORK (the others write theirs when missing)
# Wheels the machine lacks: bitsandbytes from $BNB_WHEELS (default .whl-bnb), Liger-Kernel (and others)
# from .whl, installed to /tmp/site. Results: $OUT/qlora-*.json and logs. STEPS sets the timed steps,
# SWEEP= (empty) skips the sweep. IMPLS the implementations (qlora_bench.py's --impls, default all three), INSPECT its --inspect (memory, profile).
set -uo pipefail
OUT=${OUT:-gpu-out}
WORK=${WORK:-/tmp/qlora-bench}
STEPS=${STEPS:-10}
SWEEP=${SWEEP-1024,2048,4096,8192,16384}
mkdir -p "$OUT" "$WORK"
for dir in "${BNB_WHEELS:-.whl-bnb}" .whl; do
  if compgen -G "$dir/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$dir"/*.whl || exit 1
  fi
done
export PYTHONPATH=src:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TIGON_STRICT=1
python3 -c "import bitsandbytes" || { echo "bitsandbytes is not importable: carry its wheel in \$BNB_WHEELS"; exit 1; }
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(prep qlora8b dora1b int8 tests)
bench() {  # name, timeout, then qlora_bench.py arguments
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 scripts/qlora_bench.py --steps "$STEPS" --work "$WORK" --out "$OUT/qlora-$name.json" \
    ${IMPLS:+--impls "$IMPLS"} ${INSPECT:+--inspect $INSPECT} "$@" \
    > "$OUT/qlora-$name.log" 2>&1
  echo "== $name (rc $?)"
  grep -E '^(tigon|peft|liger|  seq|peak|profiled|  )' "$OUT/qlora-$name.log" | cut -c1-220
}
for stage in "${stages[@]}"; do
  case "$stage" in
    prep)    for shape in 8b 1b; do  # the random models alone (an 8B one takes minutes to write)
               python3 scripts/qlora_bench.py --prep-only --shape $shape --seq-sweep "$SWEEP" --work "$WORK" --out /dev/null
             done; ls "$WORK" ;;
    qlora8b) bench qlora8b 580 --shape 8b --quant nf4 --checkpointing --batch 4 --seq 2048 --seq-sweep "$SWEEP" ;;
    dora1b)  bench dora1b 580 --shape 1b --variant dora --batch 4 --seq 2048 --seq-sweep "$SWEEP" ;;
    int8)    bench int8 300 --shape 1b --quant int8 --batch 4 --seq 2048 ;;
    # the op tests run on the GPU (compiled kernels) whenever there is one; the model-level ones are gpu-marked
    tests)   timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_dequantize.py tests/ops/test_dora.py \
               tests/ops/composite/test_lora_quantized_dora.py > "$OUT/qlora-gpu-tests.txt" 2>&1
             timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/train/test_qlora.py \
               tests/patch/test_lora_quantized.py >> "$OUT/qlora-gpu-tests.txt" 2>&1
             grep -E "passed|failed|error" "$OUT/qlora-gpu-tests.txt" | tail -6 ;;
    *) echo "unknown stage $stage: choose from prep qlora8b dora1b int8 tests"; exit 2 ;;
  esac
done
