"""TRL's own DPOTrainer on the unpatched model: the baseline of scripts/rlhf_gpu_compare.sh.

It trains what `tigon rlhf --method dpo` trains (the same model, the same file of pairs, which TRL
tokenizes itself, the same LoRA and Trainer arguments: tigon's own, taken from
`tigon.train.rlhf`), with tigon's Reporter attached, so that metrics.jsonl has the same fields,
measured the same way (tokens/s between logs, peak GPU memory since the first step).

    python scripts/rlhf_trl_baseline.py --model DIR --dataset pairs.jsonl --output-dir OUT \
        [--max-steps 30] [--batch-size 4] [--max-length 1024] [--lora-rank 16] [--checkpointing]
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
    cfg = resolve_rlhf(RLHFConfig(model=opts.model, tuner="lora", lora_rank=opts.lora_rank, dtype="bf16",
                                  max_length=opts.max_length, batch_size=opts.batch_size, max_steps=opts.max_steps,
                                  lr=opts.lr, save_steps=0, output_dir=str(out)))
    dtype = run_dtype(cfg)
    args = rlhf._arguments(cfg, dtype, False)
    args.max_length = opts.max_length  # TRL truncates here, where tigon's data stage does
    args.precompute_ref_log_probs = False
    args.include_num_input_tokens_seen = "non_padding"  # the Reporter's token count
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


if __name__ == "__main__":
    main()
