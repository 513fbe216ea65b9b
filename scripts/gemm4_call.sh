# The device call for the fused 4-bit GEMM (bash scripts/gemm4_call.sh; ~9 min): the fused GEMM
# against dequantise + cuBLAS at Llama-3's shapes (SHAPES: 8b or 70b) first, so that every tuning
# is printed (tests tune some keys too, and Triton's disk cache would hide those picks), then the
# GPU tests (every tunable tile bit for bit, register and memory code lookups, the reduction in
# parts, later calls skipping the autotuner), then torch.compile of dequantise + matmul beside the
# fused GEMM at a few and at a training batch's tokens, then the QLoRA offload test in bf16.
# SKIP_TESTS=1 runs the first benchmark only.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/bnb .whl-peers/bitsandbytes-*.whl
export PYTHONPATH=src:/tmp/bnb
nvidia-smi --query-gpu=name --format=csv,noheader
if python3 -c "import xdist" 2>/dev/null; then N="-n 8"; else N=""; fi
TRITON_PRINT_AUTOTUNING=1 timeout ${BENCH_S:-270} python3 -m tigon.bench.gemm_4bit --shapes ${SHAPES:-8b} --tokens ${TOKENS:-1 16 64 128 256} --impls fused tigon-dequant bnb-dequant bf16-gemm --out $OUT > $OUT/bench.txt 2>&1
grep -v "^Triton autotuning\|^best config\|^Autotuning\|^with key\|^finished after" $OUT/bench.txt | tail -44
grep -B1 "best config" $OUT/bench.txt | grep -v "^--" | sed 's/, num_ctas.*//' > $OUT/picks.txt
grep "best config" $OUT/bench.txt | sed 's/, num_ctas.*//' | sort | uniq -c | sort -rn | head -12
if [ -z "$SKIP_TESTS" ]; then
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider $N tests/ops/test_gemm_4bit.py > $OUT/tests.txt 2>&1; tail -4 $OUT/tests.txt
  timeout 90 python3 -m tigon.bench.gemm_4bit --shapes 4096x4096 14336x4096 --tokens 16 2048 --impls fused compile bnb-dequant > $OUT/compile.txt 2>&1; tail -9 $OUT/compile.txt
  timeout 70 python3 -m pytest -q -m gpu -p no:cacheprovider tests/patch/test_lora_quantized.py -k offload_and_tiled_mlp_on_a_4bit_base_in_bf16 > $OUT/offload.txt 2>&1; tail -3 $OUT/offload.txt
fi
