#!/usr/bin/env bash
# tigon on two GPUs of one host (device kind nvidia-h200-x2), repo root: the tests that need two
# GPUs, then `tigon sft` as README's Multi-GPU section launches it (torchrun = DDP, accelerate launch
# with examples/accelerate/fsdp2.yaml = FSDP2), LoRA and full fine-tuning of the 1B Llama shape,
# kernels on and --no-kernels with the same data order: their per-step losses must agree.
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1 TIGON_STRICT=1
OUT=${OUT:-gpu-out}
STEPS=${STEPS:-12}
LAUNCHERS=${LAUNCHERS:-ddp fsdp2}  # a subset, to fit one device call
TUNERS=${TUNERS:-lora full}
RUN_TESTS=${RUN_TESTS:-1}
mkdir -p "$OUT"
nvidia-smi -L
python3 -c 'import torch, accelerate; print("torch", torch.__version__, "accelerate", accelerate.__version__, "gpus", torch.cuda.device_count())'

if [ "$RUN_TESTS" = 1 ]; then
  timeout 240 python3 -m pytest -q -m gpu tests/distributed -p no:cacheprovider > "$OUT/tests-distributed.log" 2>&1
  echo "tests/distributed on GPUs: $(tail -1 "$OUT/tests-distributed.log")"
fi

PREP_ONLY=1 bash scripts/sft_gpu_compare.sh > /dev/null 2>&1  # the 1.2B Llama and data in /tmp/sft-compare
common=(--model /tmp/sft-compare/model --dataset /tmp/sft-compare/text.jsonl --dtype bf16 --max-length 2048
        --batch-size 4 --max-steps "$STEPS" --save-steps 0 --samples 0 --overwrite)
for launcher in $LAUNCHERS; do
  case $launcher in
    ddp) launch=(torchrun --nproc_per_node 2 -m tigon.cli sft) ;;
    fsdp2) launch=(accelerate launch --config_file examples/accelerate/fsdp2.yaml -m tigon.cli sft) ;;
  esac
  for tuner in $TUNERS; do
    for kernels in --kernels --no-kernels; do
      name="$launcher-$tuner$kernels"
      # One log and one metrics file for all runs: the device tool returns only so many files.
      timeout 240 "${launch[@]}" "${common[@]}" --tuner $tuner --output-dir "/tmp/$name" $kernels > "/tmp/$name.log" 2>&1
      echo "$name: rc $? $(grep -E '^done:|tigon: applied|fused LoRA' "/tmp/$name.log" | tr '\n' ' ')"
      { echo "==== $name"; cat "/tmp/$name.log"; } >> "$OUT/sft.log"
      sed "s/^/{\"run\": \"$name\", \"row\": /; s/$/}/" "/tmp/$name/metrics.jsonl" >> "$OUT/metrics.jsonl" 2>/dev/null
    done
  done
done

python3 - "$OUT" <<'PY'
import collections, json, sys
from pathlib import Path
runs = collections.defaultdict(list)
path = Path(sys.argv[1]) / "metrics.jsonl"
for line in path.read_text().splitlines() if path.exists() else []:
    record = json.loads(line)
    if "loss" in record["row"]:
        runs[record["run"]].append(record["row"]["loss"])
for launcher in ("ddp", "fsdp2"):
    for tuner in ("lora", "full"):
        if f"{launcher}-{tuner}--kernels" not in runs and f"{launcher}-{tuner}--no-kernels" not in runs:
            continue
        on, off = runs.get(f"{launcher}-{tuner}--kernels"), runs.get(f"{launcher}-{tuner}--no-kernels")
        if not on or not off:
            print(f"{launcher} {tuner}: missing metrics (kernels {bool(on)}, no-kernels {bool(off)})")
            continue
        diff = max(abs(a - b) for a, b in zip(on, off))
        print(f"{launcher} {tuner}: {len(on)} steps, loss {on[0]:.4f} -> {on[-1]:.4f} (no kernels {off[-1]:.4f}), "
              f"max per-step difference {diff:.4f}")
PY
