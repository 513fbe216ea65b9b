#!/usr/bin/env bash
# One device-machine call: gpu-marked tests, op benchmarks at their headline shapes, the linear-CE
# chunk-budget sweep and the end-to-end benchmark. Everything lands in $OUT/results.tar.gz (the
# device tool returns at most 8 files) plus the text logs.
# Usage (device machine, repo root): bash scripts/gpu_check.sh [tests|moetests|ab|ops|opsab|norms|rope|sweep|e2e|small|host|serve|moe|vlm|vlmprof|vlmdata|ppo|unsloth|unslothprof|vlmtests|zoo|newops|tasks|rl|dpo|sft|profile|dpoprof|dpomem|maxctx ...]
# (host: per-call host time of the small ops; small: the host-bound 1x1024 e2e with CUDA-graph replay;
# rl: the GRPO loss against TRL's own log-prob path; dpo: tigon rlhf against TRL's DPOTrainer; dpoprof: where a `tigon rlhf --method dpo` step goes;
# dpomem: what is live at its memory peak; DPO_ARGS: more tigon rlhf options for both)
# GPU_TESTS narrows the tests stage (pytest arguments); MC_ARGS
# are the maxctx stage's arguments to tigon.bench.max_context (its results merge into those already
# recorded in docs/bench/max_context.json); PROFILE_ARGS are scripts/profile_e2e.py's; BENCH_OPS narrows
# the ops stage to those op cases. Wheels carried in .whl/ (the device tool's way to bring packages
# the machine lacks: trl, liger-kernel, ...) are installed to /tmp/site first, with those of the
# other .whl* folders carried (.whl-bnb: bitsandbytes) but .whl-serve: the serving stack (a newer
# transformers among it) goes to its own folder, on the path of the serve stage alone, and .whl-peers:
# Unsloth with the trl and datasets it pins, to another, ahead on the path of the unsloth stage alone.
# GPU_WORKERS runs the tests on that many xdist workers. E2E_IMPLS: the e2e and small stages' --e2e-impls (e.g.
# "eager peer tigon tigon+graphs").
# TIMEOUT_<stage> (seconds) overrides a stage's time limit: keep their sum under the call's limit.
set -uo pipefail
wheels=()
for whl in .whl*/*.whl; do
  case "$whl" in .whl-serve/*|.whl-peers/*|'.whl*/*.whl') ;; *) wheels+=("$whl") ;; esac
done
if [ ${#wheels[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TIGON_STRICT=1
OUT=${OUT:-gpu-out}
RES="$OUT/results"
mkdir -p "$RES"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests ops sweep e2e)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$RES/env.txt"
python3 -m tigon.cli env >> "$RES/env.txt" 2>&1
# Unsloth and the trl/datasets it pins, installed once into their own folder (the unsloth stages put it first on the path).
peer_site() {
  if compgen -G ".whl-peers/*.whl" > /dev/null && [ ! -d /tmp/peer-site ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peer-site .whl-peers/*.whl
  fi
}
for stage in "${stages[@]}"; do
  start=$(date +%s)
  limit_var="TIMEOUT_$stage"
  case "$stage" in
    tests) timeout ${!limit_var:-420} python3 -m pytest -v -rfE -m gpu -p no:cacheprovider ${GPU_WORKERS:+-n $GPU_WORKERS} \
             ${GPU_TESTS:-tests} > "$RES/gpu_tests.txt" 2>&1
           tail -25 "$RES/gpu_tests.txt" ;;
    # Run apart from the rest: a device-side assert leaves its process's CUDA context unusable.
    moetests) timeout ${!limit_var:-420} python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_moe.py \
             tests/patch/test_moe.py > "$RES/gpu_moe_tests.txt" 2>&1
           timeout 120 python3 -m pytest -q -p no:cacheprovider tests/ops/test_kernel_globals.py >> "$RES/gpu_moe_tests.txt" 2>&1
           tail -15 "$RES/gpu_moe_tests.txt" ;;
    ops)   timeout ${!limit_var:-420} python3 -m tigon.cli bench --headline ${BENCH_OPS:+--ops $BENCH_OPS} --out "$RES/ops" > "$RES/ops.txt" 2>&1
           grep -A60 "^op " "$RES/ops.txt" | tail -45 ;;
    norms) timeout ${!limit_var:-420} python3 -m tigon.cli bench --ops rms_norm add_rms_norm layer_norm \
             --sizes 16384x4096 16384x1024 4096x16384 16384x8192 --out "$RES/norms" > "$RES/norms.txt" 2>&1
           tail -25 "$RES/norms.txt" ;;
    sweep) timeout ${!limit_var:-300} python3 -m tigon.cli bench --ops linear_cross_entropy_budget --impls tigon --out "$RES/lce_budget" > "$RES/lce_budget.txt" 2>&1
           tail -9 "$RES/lce_budget.txt" ;;
    e2e)   timeout ${!limit_var:-420} python3 -m tigon.cli bench --e2e ${E2E_IMPLS:+--e2e-impls $E2E_IMPLS} --out "$RES/e2e" > "$RES/e2e.txt" 2>&1
           tail -15 "$RES/e2e.txt" ;;
    small) timeout ${!limit_var:-420} python3 -m tigon.cli bench --e2e 1x1024 --e2e-impls ${E2E_IMPLS:-eager peer tigon tigon+graphs} \
             --out "$RES/e2e_1x1024" > "$RES/e2e_1x1024.txt" 2>&1
           tail -15 "$RES/e2e_1x1024.txt" ;;
    # A change's before and after in one run: the e2e shapes on another tree (BASE_SRC: its src/, e.g.
    # `git archive REV src | tar -x -C .baseline`, carried) and on this one, in turns over two rounds.
    ab)    for round in 1 2; do
             for side in base head; do
               tree=src; [ "$side" = base ] && tree=${BASE_SRC:-.baseline/src}
               PYTHONPATH=$tree:${PYTHONPATH#src:} timeout ${!limit_var:-300} python3 -m tigon.cli bench \
                 --e2e ${AB_SHAPES:-4x2048 1x1024} --e2e-impls ${E2E_IMPLS:-tigon tigon+graphs} \
                 --out "$RES/ab_$side-$round" > "$RES/ab_$side-$round.txt" 2>&1
             done
           done
           python3 scripts/ab_summary.py "$RES" ;;
    # The fused losses' speed on another tree (BASE_SRC, as ab) and this one, in turns over two rounds.
    opsab) for round in 1 2; do
             for side in base head; do
               tree=src; [ "$side" = base ] && tree=${BASE_SRC:-.baseline/src}
               PYTHONPATH=$tree:${PYTHONPATH#src:} timeout ${!limit_var:-150} python3 -m tigon.cli bench --headline \
                 --impls tigon --out "$RES/opsab_$side-$round" --ops ${AB_OPS:-cross_entropy linear_cross_entropy \
                 linear_cross_entropy_options linear_log_probs linear_preference_loss linear_policy_loss \
                 linear_policy_loss_gspo linear_distill_loss} > "$RES/opsab_$side-$round.txt" 2>&1
             done
           done
           python3 scripts/ops_ab_summary.py "$RES" ;;
    host)  timeout ${!limit_var:-300} python3 -m tigon.cli bench --host --out "$RES/host" > "$RES/host.txt" 2>&1
           grep -A40 "^op " "$RES/host.txt" | tail -32 ;;
    serve) if compgen -G ".whl-serve/*.whl" > /dev/null && [ ! -d /tmp/serve-site ]; then
             python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/serve-site .whl-serve/*.whl
           fi
           PYTHONPATH=/tmp/serve-site:$PYTHONPATH timeout ${!limit_var:-300} python3 -m tigon.serve.bench \
             --sequential ${SERVE_SEQUENTIAL:-4} --out "$RES/serve" > "$RES/serve.txt" 2>&1
           tail -6 "$RES/serve.txt" ;;
    moe)   timeout ${!limit_var:-300} python3 -m tigon.bench.moe_e2e --out "$RES/moe" > "$RES/moe_e2e.txt" 2>&1
           tail -9 "$RES/moe_e2e.txt" ;;
    # The preference and policy loss variants: tigon's time of each against plain DPO / GRPO's, then
    # one of each against the peer's fused loss (and eager, torch.compile).
    zoo)   timeout ${!limit_var:-300} python3 -m tigon.cli bench --headline --impls tigon --out "$RES/zoo" --ops \
             linear_preference_loss linear_preference_loss_apo_zero linear_preference_loss_apo_down \
             linear_preference_loss_sppo_hard linear_preference_loss_nca_pair linear_preference_loss_bco_pair \
             linear_preference_loss_exo_pair linear_preference_loss_discopop linear_policy_loss linear_policy_loss_gspo \
             linear_policy_loss_cispo linear_policy_loss_sapo linear_policy_loss_luspo linear_policy_loss_vespo \
             linear_policy_loss_two_sided linear_policy_loss_vllm_is > "$RES/zoo.txt" 2>&1
           timeout ${!limit_var:-300} python3 -m tigon.cli bench --headline --out "$RES/zoo_peer" --ops \
             linear_preference_loss_apo_zero linear_policy_loss_cispo > "$RES/zoo_peer.txt" 2>&1
           grep -A24 "^op " "$RES/zoo.txt" | tail -20; grep -A8 "^op " "$RES/zoo_peer.txt" | tail -8 ;;
    newops) timeout ${!limit_var:-300} python3 -m tigon.cli bench --headline --out "$RES/newops" --ops mrope vision_rope \
             gelu_mlp_tanh info_nce cross_entropy linear_cross_entropy > "$RES/newops.txt" 2>&1
           grep -A16 "^op " "$RES/newops.txt" | tail -14 ;;
    # The new training tasks against their peers: TRL's RewardTrainer, sentence-transformers.
    tasks) timeout ${TIMEOUT_reward:-150} python3 -m tigon.bench.reward --impls peer eager tigon --out "$RES/reward" > "$RES/reward.txt" 2>&1
           tail -6 "$RES/reward.txt"
           timeout ${TIMEOUT_embed:-180} python3 -m tigon.bench.embed_e2e --impls eager tigon peer --steps 6 --warmup 2 \
             --out "$RES/embed" > "$RES/embed.txt" 2>&1
           tail -6 "$RES/embed.txt" ;;
    # PPO's step (scoring and updates): eager, tigon, torch.compile (slowest to start: last); PPO_ARGS: more options.
    ppo)   timeout ${!limit_var:-150} python3 -m tigon.bench.ppo ${PPO_ARGS:-} --out "$RES/ppo" > "$RES/ppo.txt" 2>&1
           tail -8 "$RES/ppo.txt" ;;
    # LoRA against Unsloth (UNSLOTH_ARGS: tigon.bench.e2e options, e.g. the 8B QLoRA case).
    # UNSLOTH_ARGS may hold several runs split by '|': each gets TIMEOUT_unsloth (or 420 s) and its own
    # unsloth-N output.
    unsloth) peer_site
           IFS='|' read -ra unsloth_runs <<< "${UNSLOTH_ARGS:---modes lora --impls peer unsloth tigon}"
           for n in "${!unsloth_runs[@]}"; do
             PYTHONPATH=/tmp/peer-site:$PYTHONPATH timeout ${!limit_var:-420} python3 -m tigon.bench.e2e \
               ${unsloth_runs[$n]} --out "$RES/unsloth-$n" > "$RES/unsloth-$n.txt" 2>&1
             tail -12 "$RES/unsloth-$n.txt"
           done ;;
    # Where Unsloth's LoRA step goes (scripts/profile_e2e.py's report of its step, 1B shape, 4 x 2048).
    unslothprof) peer_site
           PYTHONPATH=/tmp/peer-site:$PYTHONPATH timeout ${!limit_var:-200} python3 scripts/profile_e2e.py lora --unsloth \
             > "$RES/profile_unsloth.txt" 2>&1
           tail -45 "$RES/profile_unsloth.txt" ;;
    vlm)   timeout ${!limit_var:-420} python3 -m tigon.bench.vlm_e2e ${VLM_ARGS:-} --out "$RES/vlm" > "$RES/vlm_e2e.txt" 2>&1
           tail -9 "$RES/vlm_e2e.txt" ;;
    # Where the vision tower's fwd+bwd goes, unpatched and patched (the 2b shape's tower).
    vlmprof) timeout ${!limit_var:-150} python3 scripts/profile_vision_tower.py ${VLMPROF_ARGS:-} > "$RES/vlm_profile.txt" 2>&1
           grep -E "^==|kernel span" "$RES/vlm_profile.txt" ;;
    # Video as frames and VLM packing under this machine's transformers, with its torchvision: the
    # clip batch against transformers' own video processor (a gpu-marked test) among them.
    # (Compiled kernels: `tigon sft` in these tests trains on the GPU, where the interpreter cannot run.)
    vlmdata) timeout ${!limit_var:-200} python3 -m pytest -q -p no:cacheprovider -n 8 \
             tests/train/test_vision_video.py tests/train/test_vision.py -k "video or packed or packs" \
             > "$RES/vlm_data_tests.txt" 2>&1
           tail -15 "$RES/vlm_data_tests.txt" ;;
    # The VLM patch tests under this machine's transformers (its class names), kernels interpreted.
    vlmtests) TRITON_INTERPRET=1 timeout ${!limit_var:-300} python3 -m pytest -q -p no:cacheprovider -n 8 \
             tests/patch/test_vlm.py > "$RES/vlm_tests.txt" 2>&1
           tail -15 "$RES/vlm_tests.txt" ;;
    rl)    timeout ${!limit_var:-200} python3 -m tigon.cli bench --ops linear_policy_loss_trl --impls tigon peer \
             --out "$RES/rl" > "$RES/rl.txt" 2>&1
           grep -A8 "^op " "$RES/rl.txt" ;;
    dpo)   OUT="$RES/dpo" STEPS=${STEPS:-20} WHEELS=.whl bash scripts/rlhf_gpu_compare.sh ;;
    rope)  timeout ${!limit_var:-300} python3 -m tigon.cli bench --ops rope --out "$RES/rope" > "$RES/rope.txt" 2>&1
           tail -12 "$RES/rope.txt" ;;
    sft)   OUT="$RES/sft" bash scripts/sft_gpu_compare.sh ;;
    profile) timeout ${!limit_var:-300} python3 scripts/profile_e2e.py ${PROFILE_ARGS:-full} --trace "$RES/step_trace.json" > "$RES/profile.txt" 2>&1
           gzip -f "$RES/step_trace.json"
           cat "$RES/profile.txt" | tail -70 ;;
    dpoprof|dpomem) WORK=/tmp/rlhf-compare
           PREP_ONLY=1 WORK=$WORK OUT="$RES" WHEELS=.whl bash scripts/rlhf_gpu_compare.sh > /dev/null 2>&1
           tool=profile_sft.py; [ "$stage" = dpomem ] && tool=memory_peak_gpu.py
           log="$RES/$stage${DPO_ARGS:+-$(echo $DPO_ARGS | tr -dc 'a-z-')}.txt"
           timeout ${!limit_var:-240} python3 scripts/$tool rlhf --method dpo --model $WORK/model \
             --dataset $WORK/pairs.jsonl --max-length 1024 --batch-size 4 --max-steps 24 --tuner lora --lora-rank 16 \
             --dtype bf16 --lr 1e-5 --save-steps 0 --samples 0 --overwrite --output-dir $WORK/prof ${DPO_ARGS:-} \
             > "$log" 2>&1
           grep -E -A28 "^profiled|^step wall|^device-to-host|^peak" "$log" | cut -c1-220 ;;
    maxctx) mkdir -p "$RES/mc" && cp -n docs/bench/max_context.json "$RES/mc/" 2>/dev/null
           timeout ${!limit_var:-540} python3 -m tigon.bench.max_context ${MC_ARGS:-} --out "$RES/mc" >> "$RES/mc.txt" 2>&1
           tail -20 "$RES/mc.txt" ;;
    *)     echo "unknown stage $stage" ;;
  esac
  echo "[stage $stage took $(( $(date +%s) - start )) s]"
done
tar -czf "$OUT/results.tar.gz" -C "$OUT" results
