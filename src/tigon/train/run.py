"""`tigon sft`: data -> chat template -> tokens -> model (+LoRA, + tigon kernels) -> Trainer ->
checkpoints. Everything that can be wrong with the settings, data or model is found before the
output directory is touched."""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from tigon.train import tiny
from tigon.train.batching import Collator, TokenDataset, pack
from tigon.train.callbacks import METRICS_FILE, PLOT_FILE, Reporter, read_metrics
from tigon.train.checkpoint import (STAGING_PREFIX, list_checkpoints, publish, resume_checkpoint,
                                    staging_dir)
from tigon.train.config import SFTConfig, SFTError, resolve
from tigon.train.data import Sample, load_samples
from tigon.train.infer import generate
from tigon.train.modeling import (add_lora, apply_kernels, count_parameters, flops_per_token, load_model,
                                  load_tokenizer, pick_dtype, quiet_transformers)
from tigon.train.template import encode_all, ensure_chat_template
from tigon.train.trainer import TigonTrainer

log = logging.getLogger("tigon.train")

FINAL_DIR = "final"
BASE_DIR = "base"  # the built-in model's initial weights, the base of a LoRA adapter trained on it
SAMPLES_FILE = "samples.json"
_OUTPUTS = (FINAL_DIR, BASE_DIR, METRICS_FILE, PLOT_FILE, SAMPLES_FILE)


def _split(samples: list[Sample], fraction: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(fraction * len(samples)))
    if n_eval >= len(samples):
        raise SFTError(f"--eval-split {fraction} leaves no training rows out of {len(samples)}")
    held = set(order[:n_eval])
    return [s for i, s in enumerate(samples) if i not in held], [samples[i] for i in sorted(held)]


def _sharded(args: Any) -> bool:
    """Whether the Trainer will shard the model (FSDP or DeepSpeed, from its arguments or from an
    `accelerate launch` config): generating on rank 0 alone would then wait forever for the others."""
    launched = any(os.environ.get(f"ACCELERATE_USE_{name}", "").lower() in ("1", "true") for name in ("FSDP", "DEEPSPEED"))
    return launched or bool(getattr(args, "fsdp", None)) or bool(getattr(args, "deepspeed", None))


def _rows(tokenizer: Any, samples: list[Sample], cfg: SFTConfig, what: str) -> TokenDataset:
    rows = encode_all(tokenizer, samples, cfg.max_length, what)
    if cfg.packing:
        rows = pack(rows, cfg.max_length, cfg.seed)
    return TokenDataset(rows)


def _prompts(samples: list[Sample], n: int) -> list[list[dict[str, str]] | str]:
    """Up to `n` distinct prompts from the data: each chat up to its first assistant turn, or
    the first words of a text."""
    prompts: list[list[dict[str, str]] | str] = []
    for s in samples:
        if len(prompts) == n:
            break
        if s.messages is not None:
            first = next(i for i, m in enumerate(s.messages) if m["role"] == "assistant")
            prompt: list[dict[str, str]] | str = list(s.messages[:first])
        else:
            prompt = " ".join(s.text.split()[:8])
        if prompt and prompt not in prompts:
            prompts.append(prompt)
    return prompts


def _prompt_text(prompt: list[dict[str, str]] | str) -> str:
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def _check_output_dir(output_dir: Path, cfg: SFTConfig) -> Path | None:
    """The checkpoint to resume from, if any; refuses to mix a new run into an old one."""
    if cfg.resume:
        return resume_checkpoint(output_dir, cfg.resume)
    used = list_checkpoints(output_dir) + [output_dir / n for n in _OUTPUTS if (output_dir / n).exists()]
    if used and not cfg.overwrite:
        raise SFTError(f"{output_dir} already holds a run ({used[0].name}); pass --resume to continue it, "
                       "--overwrite to replace it, or another --output-dir")
    return None


def _clear_old_run(output_dir: Path, resume_from: Path | None) -> None:
    if resume_from is not None:
        # Keep the metrics up to the checkpoint; later lines belong to the interrupted run.
        step = json.loads((resume_from / "trainer_state.json").read_text())["global_step"]
        kept = [r for r in read_metrics(output_dir) if r["step"] <= step]
        (output_dir / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in kept))
        return
    for path in list_checkpoints(output_dir) + [output_dir / n for n in _OUTPUTS]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _training_arguments(cfg: SFTConfig, output_dir: Path, dtype: torch.dtype, has_eval: bool) -> Any:
    from transformers import TrainingArguments

    steps = cfg.save_steps or None
    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=cfg.batch_size,
        per_device_eval_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        learning_rate=cfg.lr,
        num_train_epochs=cfg.epochs,
        max_steps=cfg.max_steps,
        lr_scheduler_type="cosine",
        warmup_steps=int(cfg.warmup) if cfg.warmup >= 1 else cfg.warmup,
        weight_decay=cfg.weight_decay,
        logging_steps=cfg.logging_steps,
        save_strategy="steps" if steps else "no",
        save_steps=steps or 500,
        eval_strategy="steps" if has_eval and steps else "no",
        eval_steps=steps,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        dataloader_pin_memory=torch.cuda.is_available(),
        # Said explicitly, CPU-only machines also run `torchrun` jobs as one distributed (gloo) job.
        use_cpu=not torch.cuda.is_available() and not torch.backends.mps.is_available(),
        seed=cfg.seed,
        data_seed=cfg.seed,
        # Between logs the step loop never waits for the GPU (see tigon.train.trainer): a NaN
        # loss is logged as NaN rather than filtered out, and batches go to the GPU asynchronously.
        logging_nan_inf_filter=False,
        accelerator_config={"non_blocking": torch.cuda.is_available()},
        remove_unused_columns=False,
        report_to="none",
        disable_tqdm=True,  # tigon's Reporter draws the bar
    )
    # One process counts its tokens on the host (TigonTrainer); several need the Trainer's
    # count, which gathers every process's on the device.
    args.include_num_input_tokens_seen = "non_padding" if args.world_size > 1 else "no"
    return args


def _peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """The measured dense-matmul rate of this device, the denominator of MFU. CPUs often run
    half-precision matmuls slower than fp32 (emulated), so there the fp32 rate is the peak."""
    from tigon.bench.harness import measure_matmul_rate

    return measure_matmul_rate(device, dtype if device.type == "cuda" else torch.float32)


def run_sft(cfg: SFTConfig, given: set[str] = frozenset()) -> Path:
    """Fine-tune as `cfg` says; returns the directory of the final model (or adapter)."""
    threads = torch.get_num_threads()
    if cfg.model is None and not torch.cuda.is_available():
        # The built-in model's matrices are too small to gain from threads, and with more threads
        # than idle cores OpenMP's spinning made each step 16x slower (a busy 2-core machine).
        torch.set_num_threads(1)
    try:
        return _run(cfg, given)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: SFTConfig, given: set[str]) -> Path:
    from transformers import PrinterCallback, set_seed

    cfg = resolve(cfg, given)
    quiet_transformers()
    output_dir = Path(cfg.output_dir)
    resume_from = _check_output_dir(output_dir, cfg)
    set_seed(cfg.seed)

    builtin = cfg.model is None
    samples = load_samples(cfg.dataset or [str(tiny.BUNDLED_DATASET)], cfg.seed)
    if cfg.eval_dataset:
        eval_samples = load_samples(cfg.eval_dataset, cfg.seed)
    elif cfg.eval_split:
        samples, eval_samples = _split(samples, cfg.eval_split, cfg.seed)
    else:
        eval_samples = []
    tokenizer = tiny.build_tokenizer(samples) if builtin else load_tokenizer(cfg.model)
    ensure_chat_template(tokenizer)
    train_data = _rows(tokenizer, samples, cfg, "training data")
    eval_data = _rows(tokenizer, eval_samples, cfg, "evaluation data") if eval_samples else None
    log.info("tokens: %d training rows%s, %d tokens, max length %d", len(train_data),
             " (packed)" if cfg.packing else "", train_data.num_tokens(), cfg.max_length)

    # The built-in model is tiny and trained from scratch: fp32, where bf16 would only lose updates.
    dtype = torch.float32 if builtin and cfg.dtype == "auto" else pick_dtype(cfg.dtype)
    args = _training_arguments(cfg, output_dir, dtype, eval_data is not None)
    model = tiny.build_model(tokenizer, cfg.seed).to(dtype) if builtin else load_model(cfg.model, dtype)
    base_model = None
    if builtin and cfg.tuner == "lora":
        # The adapter needs its base on disk to be loadable, and a resumed run the same base.
        base = output_dir / BASE_DIR
        if resume_from is not None and base.is_dir():
            model = load_model(str(base), dtype)
        model.name_or_path = str(base.resolve())
        base_model = copy.deepcopy(model)  # LoRA wraps `model` in place; written out below
    use_cache, model.config.use_cache = model.config.use_cache, False  # see tigon.train.batching
    # DDP's search for unused parameters costs a graph walk per step; only routed experts need it.
    args.ddp_find_unused_parameters = any(getattr(model.config, k, None) for k in ("num_local_experts", "num_experts"))
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing needs no input that requires grad, so frozen embeddings (LoRA) work.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.tuner == "lora":
        model = add_lora(model, cfg)
    trainable, total = count_parameters(model)
    log.info("model: %s, %s, %s tuning: %.2fM of %.2fM parameters trainable",
             cfg.model or "built-in tiny Llama", str(dtype).replace("torch.", ""), cfg.tuner,
             trainable / 1e6, total / 1e6)
    apply_kernels(model, cfg)
    model.to(args.device)

    if cfg.samples and _sharded(args):
        log.info("samples: skipped under FSDP/DeepSpeed (a sharded model generates only with every rank); "
                 "try the saved model with `tigon chat`")
    prompts = _prompts(samples, cfg.samples) if args.process_index == 0 and not _sharded(args) else []
    before = [generate(model, tokenizer, p, cfg.max_new_tokens) for p in prompts]
    for prompt, reply in zip(prompts, before):
        log.info("before training: %r -> %r", _prompt_text(prompt), reply)

    if args.should_save:
        output_dir.mkdir(parents=True, exist_ok=True)
        _clear_old_run(output_dir, resume_from)
        if base_model is not None and not (output_dir / BASE_DIR).is_dir():
            staging = staging_dir(output_dir / BASE_DIR)
            base_model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            publish(staging, output_dir / BASE_DIR)

    mean_row = train_data.num_tokens() / len(train_data)
    reporter = Reporter(output_dir, flops_per_token(model, mean_row), _peak_flops(args.device, dtype),
                        args.world_size)
    trainer = TigonTrainer(model=model, args=args, train_dataset=train_data, eval_dataset=eval_data,
                            data_collator=Collator(tokenizer.pad_token_id), processing_class=tokenizer,
                            callbacks=[reporter], save_limit=cfg.save_limit)
    trainer.remove_callback(PrinterCallback)
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    evaluated = {r["step"] for r in trainer.state.log_history if "eval_loss" in r}
    if eval_data is not None and trainer.state.global_step not in evaluated:
        trainer.evaluate()

    model.config.use_cache = use_cache
    final = output_dir / FINAL_DIR
    staging = final.with_name(STAGING_PREFIX + FINAL_DIR)
    if trainer.is_world_process_zero():
        staging_dir(final)
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(str(staging))  # every process: sharded models gather here
    trainer.accelerator.wait_for_everyone()
    if trainer.is_world_process_zero():
        publish(staging, final)
        after = [generate(model, tokenizer, p, cfg.max_new_tokens) for p in prompts]
        record = [{"prompt": _prompt_text(p), "before": b, "after": a} for p, b, a in zip(prompts, before, after)]
        (output_dir / SAMPLES_FILE).write_text(json.dumps(record, indent=1) + "\n")
        for r in record:
            log.info("sample: %r\n  before: %r\n  after:  %r", r["prompt"], r["before"], r["after"])
        what = "LoRA adapter" if cfg.tuner == "lora" else "model"
        log.info("%s: %s  (tigon chat %s%s)", what, final, final,
                 f"; tigon merge {final} --output {output_dir / 'merged'}" if cfg.tuner == "lora" else "")
    return final
