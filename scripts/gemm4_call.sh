# The device call for the fused 4-bit GEMM (bash scripts/gemm4_call.sh; ~6 min): GPU tests first
# (every tunable tile bit for bit, register and memory code lookups, the reduction in parts, later
# calls skipping the autotuner), then the fused GEMM against dequantise + cuBLAS at Llama-3's
# shapes (SHAPES: 8b or 70b), the autotuner's picks printed. SKIP_TESTS=1 runs the benchmark only.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/bnb .whl-peers/bitsandbytes-*.whl
export PYTHONPATH=src:/tmp/bnb
nvidia-smi --query-gpu=name --format=csv,noheader
if python3 -c "import xdist" 2>/dev/null; then N="-n 8"; else N=""; fi
if [ -z "$SKIP_TESTS" ]; then
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider $N tests/ops/test_gemm_4bit.py > $OUT/tests.txt 2>&1; tail -4 $OUT/tests.txt
fi
TRITON_PRINT_AUTOTUNING=1 timeout ${BENCH_S:-330} python3 -m tigon.bench.gemm_4bit --shapes ${SHAPES:-8b} --tokens ${TOKENS:-1 16 64 128 256} --impls fused tigon-dequant bnb-dequant bf16-gemm --out $OUT > $OUT/bench.txt 2>&1
grep -v "^Triton autotuning\|^best config\|^Autotuning\|^with key\|^finished after" $OUT/bench.txt | tail -44
grep "best config" $OUT/bench.txt | sed 's/, num_ctas.*//' | sort | uniq -c | sort -rn | head -12
