#!/usr/bin/env bash
# `tigon sft` with kernels on vs --no-kernels on the 1B Llama shape (random weights, the
# built-in tokenizer, rows of exactly 2048 tokens, batch 4), full and LoRA. Device machine, repo root.
# PREP_ONLY=1 writes the model and data to $WORK and stops.
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}
WORK=${WORK:-/tmp/sft-compare}
STEPS=${STEPS:-30}
mkdir -p "$OUT" "$WORK"
python3 - "$WORK" <<'PY'
import json, random, sys
from tigon.bench.e2e import LLAMA_1B
from tigon.train import tiny
from tigon.train.data import load_samples
work = sys.argv[1]
rows = load_samples([str(tiny.BUNDLED_DATASET)], 0)
tok = tiny.build_tokenizer(rows)
tiny.build_model(tok, 0, **LLAMA_1B, max_position_embeddings=8192).save_pretrained(f"{work}/model")
tok.save_pretrained(f"{work}/model")
words = " ".join(m["content"] for s in rows for m in s.messages).split()
rng = random.Random(0)
with open(f"{work}/text.jsonl", "w") as f:
    for _ in range(400):
        f.write(json.dumps({"text": " ".join(rng.choices(words, k=2000))}) + "\n")
PY
[ "${PREP_ONLY:-0}" = 1 ] && exit 0  # only the model and data (for scripts/profile_sft.py)
for tuner in full lora; do
  for kernels in --no-kernels --kernels; do
    name="sft-$tuner$kernels"
    timeout 150 python3 -m tigon.cli sft --model "$WORK/model" --dataset "$WORK/text.jsonl" --tuner $tuner \
      --dtype bf16 --max-length 2048 --batch-size 4 --max-steps "$STEPS" --save-steps 0 --samples 0 \
      --overwrite --output-dir "$WORK/$name" $kernels > "$OUT/$name.log" 2>&1
    echo "$name: $(grep -E '^done:|tigon: applied' "$OUT/$name.log" | tr '\n' ' ')"
    cp "$WORK/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
  done
done
