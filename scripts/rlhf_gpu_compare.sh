#!/usr/bin/env bash
# `tigon rlhf --method dpo` against TRL's DPOTrainer on the unpatched model, on the 1B Llama
# shape (random weights, the built-in tokenizer), LoRA r=16 all-linear, 4 pairs x 2 x 1024 tokens
# (every sequence exactly 1024 tokens: no padding), bf16, the same pairs, order and seed. Runs:
#   tigon            tigon rlhf (kernels, fused preference loss)
#   tigon-recompute  tigon rlhf --recompute-mlp (the MLPs keep only their inputs for backward)
#   tigon-nokernels  tigon rlhf --no-kernels (the fused loss alone)
#   trl              TRL's DPOTrainer, gradient checkpointing off as in the tigon runs
#   trl-ckpt         TRL's DPOTrainer as TRL configures it by default (checkpointing on)
# and prints tok/s (median after the first logs), peak MiB and the largest per-step loss difference
# to TRL's (scripts/rlhf_compare_summary.py). RUNS names the DPO runs to make (default: all five). Targets: tigon >= 1.6x trl's tok/s, peak <= 0.5x trl's.
# METHOD=grpo or METHOD=gkd instead compares, on the same model, LoRA r=16, bf16 and seed:
#   grpo  8 prompts x 8 completions (GEN_LEN tokens each, default 256; a random model never stops
#         early, so every completion is full length) per step, reward builtin:length, beta 0
#   gkd   the model distilled from itself (TEACHER, default the same model), 4 chats x 1024 tokens,
#         --lmbda 0 (the dataset's answers: no sampling, so the steps are alike)
# running tigon (kernels, fused loss), trl (its trainer; GRPO with its own fused LM head) and
# trl-liger (Liger-Kernel's layer kernels through TRL's use_liger_kernel; its wheel in WHEELS),
# and prints tok/s and peak MiB of each and their ratios to trl's.
# Device machine, repo root. TRL is not installed there: WHEELS=dir of wheels (trl, datasets, dill,
# multiprocess) is installed into $WORK/pylib first. PREP_ONLY=1 writes the model and data and stops.
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}
WORK=${WORK:-/tmp/rlhf-compare}
STEPS=${STEPS:-30}
WHEELS=${WHEELS:-wheels}
mkdir -p "$OUT" "$WORK"
if ! python3 -c "import trl" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target "$WORK/pylib" "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="src:$WORK/pylib"
fi
# The model: sft_gpu_compare.sh's (the same random Llama and built-in tokenizer, in $WORK/model).
[ -f "$WORK/model/config.json" ] || PREP_ONLY=1 WORK="$WORK" OUT="$OUT" bash scripts/sft_gpu_compare.sh || exit 1
python3 - "$WORK" <<'PY'
import json, random, sys
from tigon.train import tiny
from tigon.train.data import load_samples
rows = load_samples([str(tiny.BUNDLED_DATASET)], 0)
words = " ".join(m["content"] for s in rows for m in s.messages).split()
rng = random.Random(0)
with open(f"{sys.argv[1]}/pairs.jsonl", "w") as f:
    for _ in range(200):  # a ~300-token prompt, answers cut to the rest of 1024 tokens
        f.write(json.dumps({"prompt": " ".join(rng.choices(words, k=150)),
                            "chosen": " ".join(rng.choices(words, k=1000)),
                            "rejected": " ".join(rng.choices(words, k=1000))}) + "\n")
with open(f"{sys.argv[1]}/pairs.jsonl") as f, open(f"{sys.argv[1]}/chats.jsonl", "w") as chats:
    for line in f:  # gkd's data: each pair's prompt and chosen answer as a chat
        pair = json.loads(line)
        chats.write(json.dumps({"messages": [{"role": "user", "content": pair["prompt"]},
                                             {"role": "assistant", "content": pair["chosen"]}]}) + "\n")
PY
[ "${PREP_ONLY:-0}" = 1 ] && exit 0
METHOD=${METHOD:-dpo}
if [ "$METHOD" != dpo ]; then
  GEN_LEN=${GEN_LEN:-256}
  TEACHER=${TEACHER:-$WORK/model}
  if [ "$METHOD" = grpo ]; then
    # 16 completions per device step, 4 accumulated: one generation batch of 8 prompts x 8 per step.
    DATA=$WORK/pairs.jsonl
    OWN=(--num-generations 8 --max-completion-length "$GEN_LEN" --grad-accum 4 --batch-size 16 --max-length 512)
    TIGON=(--reward-funcs builtin:length --beta 0)
  else
    DATA=$WORK/chats.jsonl
    OWN=(--teacher "$TEACHER" --lmbda 0 --batch-size 4 --max-length 1024)
    TIGON=()
  fi
  COMMON=(--model "$WORK/model" --dataset "$DATA" --max-steps "$STEPS" --lora-rank 16 --lr 1e-5)
  timeout 600 python3 -m tigon.cli rlhf --method "$METHOD" "${COMMON[@]}" "${OWN[@]}" "${TIGON[@]}" --tuner lora \
    --dtype bf16 --save-steps 0 --samples 0 --overwrite --output-dir "$WORK/$METHOD-tigon" > "$OUT/$METHOD-tigon.log" 2>&1
  echo "tigon: $(grep -E '^done:|tigon: applied' "$OUT/$METHOD-tigon.log" | tr '\n' ' ')"
  cp "$WORK/$METHOD-tigon/metrics.jsonl" "$OUT/$METHOD-tigon.metrics.jsonl" 2>/dev/null
  for liger in "" --liger; do
    name=trl${liger:+-liger}
    timeout 600 python3 scripts/rlhf_trl_baseline.py --method "$METHOD" "${COMMON[@]}" "${OWN[@]}" $liger \
      --output-dir "$WORK/$METHOD-$name" > "$OUT/$METHOD-$name.log" 2>&1
    echo "$name: $(grep -E '^done:' "$OUT/$METHOD-$name.log")"
    cp "$WORK/$METHOD-$name/metrics.jsonl" "$OUT/$METHOD-$name.metrics.jsonl" 2>/dev/null
  done
  python3 scripts/rlhf_compare_summary.py "$OUT" "$METHOD" tigon trl trl-liger
  exit 0
fi
COMMON=(--model "$WORK/model" --dataset "$WORK/pairs.jsonl" --max-length 1024 --batch-size 4 --max-steps "$STEPS")
RUNS=" ${RUNS:-tigon tigon-recompute tigon-nokernels trl trl-ckpt} "  # the DPO runs to make
for kernels in --kernels --recompute-mlp --no-kernels; do
  case "$kernels" in --kernels) name=tigon ;; --recompute-mlp) name=tigon-recompute ;; *) name=tigon-nokernels ;; esac
  [[ "$RUNS" == *" $name "* ]] || continue
  timeout 300 python3 -m tigon.cli rlhf --method dpo "${COMMON[@]}" --tuner lora --lora-rank 16 --dtype bf16 \
    --lr 1e-5 --save-steps 0 --samples 0 --overwrite --output-dir "$WORK/$name" $kernels > "$OUT/rlhf-$name.log" 2>&1
  echo "$name: $(grep -E '^done:|tigon: applied' "$OUT/rlhf-$name.log" | tr '\n' ' ')"
  cp "$WORK/$name/metrics.jsonl" "$OUT/rlhf-$name.metrics.jsonl" 2>/dev/null
done
for ckpt in "" --checkpointing; do
  name=trl${ckpt:+-ckpt}
  [[ "$RUNS" == *" $name "* ]] || continue
  timeout 300 python3 scripts/rlhf_trl_baseline.py "${COMMON[@]}" --lora-rank 16 --lr 1e-5 $ckpt \
    --output-dir "$WORK/$name" > "$OUT/rlhf-$name.log" 2>&1
  echo "$name: $(grep -E '^done:' "$OUT/rlhf-$name.log")"
  cp "$WORK/$name/metrics.jsonl" "$OUT/rlhf-$name.metrics.jsonl" 2>/dev/null
done
python3 scripts/rlhf_compare_summary.py "$OUT" rlhf tigon tigon-recompute tigon-nokernels trl trl-ckpt
