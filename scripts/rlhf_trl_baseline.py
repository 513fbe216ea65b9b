"""TRL's own trainers on the unpatched model: the baselines of scripts/rlhf_gpu_compare.sh.

It trains what `tigon rlhf --method dpo|grpo|gkd` trains (the same model, the same data file,
which TRL tokenizes itself, the same LoRA and Trainer arguments: tigon's own, taken from
`tigon.train.rlhf`, `.grpo` and `.gkd`), on TRL's DPOTrainer, GRPOTrainer (its own fused LM head
for the log-probs) or GKDTrainer, optionally with Liger-Kernel's layer kernels (--liger: TRL's
use_liger_kernel), with tigon's Reporter attached, so that metrics.jsonl has the same fields,
measured the same way (tokens/s between logs, peak GPU memory since the first step).

    python scripts/rlhf_trl_baseline.py --model DIR --dataset FILE.jsonl --output-dir OUT \
        [--method dpo|grpo|gkd] [--max-steps 30] [--batch-size 4] [--max-length 1024] [--lora-rank 16]
        [--checkpointing] [--liger] [grpo: --num-generations 8 --max-completion-length 256 --grad-accum 1]
        [gkd: --teacher DIR --lmbda 0]

grpo's data: prompt rows; its reward builtin:length (any prompt). gkd's: messages rows (chats).
"""

import argparse
import dataclasses
import json
import logging
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--checkpointing", action="store_true", help="TRL's default: gradient checkpointing on")
    parser.add_argument("--method", choices=["dpo", "grpo", "gkd"], default="dpo")
    parser.add_argument("--liger", action="store_true", help="Liger-Kernel's layer kernels (TRL's use_liger_kernel)")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=256)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--teacher")
    parser.add_argument("--lmbda", type=float, default=0.0)
    opts = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
    from trl import DPOTrainer

    from tigon.train import rlhf
    from tigon.train.config import RLHFConfig, resolve_rlhf
    from tigon.train.modeling import flops_per_token
    from tigon.timing import measure_matmul_rate
    from tigon.train.callbacks import Reporter
    from tigon.train.run import attach_reporter, run_dtype
    from tigon.train.template import ensure_chat_template

    out = Path(opts.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    per_method = {"grpo": dict(num_generations=opts.num_generations, max_completion_length=opts.max_completion_length,
                               grad_accum=opts.grad_accum, reward_funcs=["builtin:length"]),
                  "gkd": dict(teacher=opts.teacher, lmbda=opts.lmbda, grad_accum=opts.grad_accum)}.get(opts.method, {})
    cfg = resolve_rlhf(RLHFConfig(model=opts.model, tuner="lora", lora_rank=opts.lora_rank, dtype="bf16",
                                  max_length=opts.max_length, batch_size=opts.batch_size, max_steps=opts.max_steps,
                                  lr=opts.lr, save_steps=0, output_dir=str(out), method=opts.method, **per_method))
    dtype = run_dtype(cfg)
    if opts.method != "dpo":
        return other_method(opts, cfg, dtype, out)
    args = rlhf.trl_arguments(cfg, dtype, False)
    args.max_length = opts.max_length  # TRL truncates here, where tigon's data stage does
    args.precompute_ref_log_probs = False
    args.include_num_input_tokens_seen = "non_padding"  # the Reporter's token count
    args.use_liger_kernel = opts.liger
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        if hasattr(args, name):
            setattr(args, name, opts.checkpointing)
    if opts.checkpointing:
        args.gradient_checkpointing_kwargs = {"use_reentrant": False}

    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    ensure_chat_template(tokenizer)
    rows = [json.loads(line) for line in Path(opts.dataset).read_text().splitlines() if line.strip()]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                               "chosen": [{"role": "assistant", "content": r["chosen"]}],
                               "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows])
    set_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(opts.model, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    peft = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, peft_config=peft)
    # TRL's own token rows (its collator then cuts each sequence to --max-length).
    lengths = [min(len(r["prompt_ids"]) + len(r[k]), opts.max_length)
               for r in trainer.train_dataset for k in ("chosen_ids", "rejected_ids")]
    tokens = sum(lengths)
    # The policy's step and the reference's forward, counted as tigon rlhf counts them (its MFU).
    seq = tokens / len(lengths)
    flops = flops_per_token(trainer.model, seq) + flops_per_token(trainer.model, seq, backward=False)
    attach_reporter(trainer, Reporter(out, flops, measure_matmul_rate(args.device, dtype), args.world_size,
                                      command="trl-dpo", metrics=rlhf.PAIRED_METRICS))
    trainer.train()
    print(json.dumps({"peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
                      "settings": {k: v for k, v in dataclasses.asdict(cfg).items() if k in (
                          "lr", "batch_size", "max_length", "lora_rank", "lora_alpha", "beta", "seed")}}))


def other_method(opts, cfg, dtype, out) -> None:
    """GRPO or GKD on TRL's own trainer, with tigon's arguments for `cfg` and its Reporter."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    from tigon.timing import measure_matmul_rate
    from tigon.train.callbacks import Reporter
    from tigon.train.modeling import flops_per_token
    from tigon.train.run import attach_reporter
    from tigon.train.template import ensure_chat_template

    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    ensure_chat_template(tokenizer)
    rows = [json.loads(line) for line in Path(opts.dataset).read_text().splitlines() if line.strip()]
    set_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(opts.model, dtype=dtype, attn_implementation="sdpa")
    peft = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    if opts.method == "grpo":
        from trl import GRPOTrainer

        from tigon.train import grpo, rewards

        args = grpo.trl_arguments(cfg, dtype, False)
        fns = [r.fn for r in rewards.load_rewards(cfg.reward_funcs, cfg.format_regex, cfg.max_completion_length)]
        data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows])
        make = lambda: GRPOTrainer(model=model, reward_funcs=fns, args=args, train_dataset=data,  # noqa: E731
                                   processing_class=tokenizer, peft_config=peft)
        metrics, seq = grpo.METRICS, opts.max_length / 2 + cfg.max_completion_length
    else:
        from trl.experimental.gkd import GKDTrainer

        from tigon.train import gkd

        args = gkd.trl_arguments(cfg, dtype, False)
        teacher = AutoModelForCausalLM.from_pretrained(opts.teacher, dtype=dtype, attn_implementation="sdpa")
        data = Dataset.from_list([{"messages": r["messages"]} for r in rows])
        make = lambda: GKDTrainer(model=model, teacher_model=teacher, args=args, train_dataset=data,  # noqa: E731
                                  processing_class=tokenizer, peft_config=peft)
        metrics, seq = {}, opts.max_length
        args.include_num_input_tokens_seen = "non_padding"  # GRPO counts its own tokens
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        if hasattr(args, name):
            setattr(args, name, opts.checkpointing)
    args.use_liger_kernel = opts.liger
    trainer = make()
    flops = flops_per_token(trainer.model, seq) + flops_per_token(trainer.model, seq, backward=False)
    attach_reporter(trainer, Reporter(out, flops, measure_matmul_rate(args.device, dtype), args.world_size,
                                      command=f"trl-{opts.method}", metrics=metrics))
    trainer.train()
    print(json.dumps({"peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}))


if __name__ == "__main__":
    main()
