"""`tigon sft`, in stages: plain functions, each handing the next what it made.

    settings      `start`: output directory checked, checkpoint to resume from, seed
    data          `load_data`: samples and evaluation samples
    tokens        `tokenizer_for`, `sft_rows`
    model         `training_arguments`, `build_model` (+ LoRA, + tigon kernels)
    output dir    `start_output`: an old run cleared (or its metrics cut to the checkpoint)
    trainer       `make_reporter`, the Trainer, `fit` (stops cleanly on Ctrl-C / SIGTERM)
    final         `finish`: final/, samples before and after

`run_sft` chains them: its own data and token stages, then `train`, which runs the rest for a
`Job` (the rows, and how to make the Trainer). A run with another objective (`tigon rlhf`)
brings its own rows and Trainer in a Job and shares everything else. Everything that can be wrong
with the settings, data or model is found before the output directory is touched."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from tigon.timing import measure_matmul_rate
from tigon.train import seqpar, tiny
from tigon.train.batching import Collator, TokenDataset, pack
from tigon.train.callbacks import METRICS_FILE, PLOT_FILE, Reporter, read_metrics
from tigon.train.checkpoint import (STAGING_PREFIX, damage, list_checkpoints, publish, remove_path,
                                    removed_on_failure, resume_checkpoint, staging_dir, written_atomically)
from tigon.train.config import Interrupted, SFTConfig, SFTError, resolve
from tigon.train.data import Sample, load_samples
from tigon.train.infer import generate
from tigon.train.modeling import (LABELS_FILE, QUANT_FILE, add_lora, apply_kernels, check_bitsandbytes, check_fp8,
                                  count_parameters, flops_per_token, fp8_checkpoint, is_classifier, load_model, load_tokenizer,
                                  loraplus_optimizer, pick_dtype, prepare_quantized, quantization_config,
                                  quantization_record, quiet_transformers)
from tigon.train.stop import StopOnSignal, signal_name
from tigon.train.template import encode, encode_all, ensure_chat_template
from tigon.train.trainer import TOKEN_ACCURACY, TigonTrainer

log = logging.getLogger("tigon.train")

FINAL_DIR = "final"
BASE_DIR = "base"  # the built-in model's initial weights, the base of a LoRA adapter trained on it
SAMPLES_FILE = "samples.json"
TRACKING_DIR = "runs"  # where the Trainer's TensorBoard integration writes, under the output dir
_OUTPUTS = (FINAL_DIR, BASE_DIR, METRICS_FILE, PLOT_FILE, SAMPLES_FILE, TRACKING_DIR)
_SHOWN_CHARS = 100  # of a sample's prompt and answers in the log (samples.json keeps them whole)

Prompt = list[dict[str, str]] | str


# --- settings ---------------------------------------------------------------------------------

def _check_writable(output_dir: Path) -> None:
    if output_dir.exists() and not output_dir.is_dir():
        raise SFTError(f"--output-dir {output_dir}: is a file, not a directory; choose another --output-dir")
    existing = output_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise SFTError(f"--output-dir {output_dir}: {existing} is a file, not a directory; choose another --output-dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SFTError(f"--output-dir {output_dir}: cannot write in {existing} (permission denied); "
                       "choose another --output-dir")


def _leftovers(output_dir: Path) -> list[Path]:
    """What a run of ours left in `output_dir` besides its checkpoints (staging directories too)."""
    if not output_dir.is_dir():
        return []
    return ([output_dir / n for n in _OUTPUTS if (output_dir / n).exists()]
            + sorted(output_dir.glob(STAGING_PREFIX + "*")))


def _final_damage(output_dir: Path) -> str | None:
    """What is wrong with the run's final/ (see `damage`), if it has one."""
    final = output_dir / FINAL_DIR
    return damage(final) if final.is_dir() else None


def finished(output_dir: Path) -> bool:
    """Whether `output_dir` holds a finished run: its final/, intact."""
    return (output_dir / FINAL_DIR).is_dir() and _final_damage(output_dir) is None


def _resume_point(output_dir: Path, cfg: SFTConfig) -> Path | None:
    """The checkpoint to resume from (None: train from step 0); refuses to mix a new run into an
    old one, saying what to pass for each kind of old run. A damaged final/ makes the run an
    unfinished one, which --resume completes from its newest checkpoint (replacing final/)."""
    checkpoints = list_checkpoints(output_dir)
    broken = _final_damage(output_dir)
    elsewhere = "or choose another --output-dir"
    if cfg.resume:
        checkpoint = resume_checkpoint(output_dir, cfg.resume)
        if broken is not None:
            if checkpoint is None:
                raise SFTError(f"--resume: {broken}, and no checkpoint is left to write {FINAL_DIR}/ again from: "
                               f"pass --overwrite to train the run again, {elsewhere}")
            log.warning("%s: the run is not complete: --resume completes it from %s", broken, checkpoint.name)
        elif checkpoint is None and not (output_dir / FINAL_DIR).is_dir():  # a finished run: see `already_trained`
            stopped = " (the run there stopped before its first one)" if _leftovers(output_dir) else ""
            log.info("--resume: no checkpoint in %s yet%s: training from step 0", output_dir, stopped)
        return checkpoint
    leftovers = _leftovers(output_dir)
    if cfg.overwrite or not (checkpoints or leftovers):
        return None
    if broken is not None:
        complete = (f"pass --resume to complete it from {checkpoints[-1].name}, --overwrite to replace it" if checkpoints
                    else "pass --overwrite to train it again")
        raise SFTError(f"{output_dir} holds a run that is not complete: {broken}: {complete}, {elsewhere}")
    if (output_dir / FINAL_DIR).is_dir():
        raise SFTError(f"{output_dir} already holds a finished run ({FINAL_DIR}/): pass --overwrite to replace "
                       f"it, --resume with a higher --max-steps or --epochs to train it further, {elsewhere}")
    if checkpoints:
        raise SFTError(f"{output_dir} holds an unfinished run (newest checkpoint: {checkpoints[-1].name}): pass "
                       f"--resume to continue it, --overwrite to replace it, {elsewhere}")
    names = ", ".join(p.name for p in leftovers)
    raise SFTError(f"{output_dir} holds what is left of a run stopped before its first checkpoint ({names}): "
                   f"pass --resume to start it again from step 0 (or --overwrite), {elsewhere}")


def start(cfg: SFTConfig) -> Path | None:
    """The settings stage, for a `cfg` already `resolve`d: checks that the output directory can
    take this run and returns the checkpoint to resume from (None: step 0); seeds everything."""
    from transformers import set_seed

    quiet_transformers()
    output_dir = Path(cfg.output_dir)
    _check_writable(output_dir)
    resume_from = _resume_point(output_dir, cfg)
    set_seed(cfg.seed)
    return resume_from


# --- data -------------------------------------------------------------------------------------

def split_off(samples: list[Any], fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """`samples` less a seeded random `fraction` of them (at least one), and those, for evaluation."""
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(fraction * len(samples)))
    if n_eval >= len(samples):
        raise SFTError(f"--eval-split {fraction} leaves no training rows out of {len(samples)}")
    held = set(order[:n_eval])
    return [s for i, s in enumerate(samples) if i not in held], [samples[i] for i in sorted(held)]


def load_data(cfg: SFTConfig) -> tuple[list[Sample], list[Sample]]:
    """The data stage: the training samples (the bundled ones by default) and the evaluation
    samples (from --eval-dataset or held out by --eval-split; none by default)."""
    samples = load_samples(cfg.dataset or [str(tiny.BUNDLED_DATASET)], cfg.seed)
    if cfg.eval_dataset:
        return samples, load_samples(cfg.eval_dataset, cfg.seed)
    if cfg.eval_split:
        return split_off(samples, cfg.eval_split, cfg.seed)
    return samples, []


# --- tokens -----------------------------------------------------------------------------------

def _check_same_tokenizer(tokenizer: Any, checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    try:
        saved = AutoTokenizer.from_pretrained(str(checkpoint))
    except (OSError, ValueError):
        return  # a checkpoint without its tokenizer: nothing to compare with
    if saved.get_vocab() != tokenizer.get_vocab():
        raise SFTError(f"--resume {checkpoint}: the built-in model's tokenizer is trained on the data, and this "
                       "--dataset gives another one than the run being resumed: resume with the same --dataset "
                       "(and --seed), or start a new run (--overwrite, or another --output-dir)")


def tokenizer_for(cfg: SFTConfig, samples: list[Sample], resume_from: Path | None) -> Any:
    """The run's tokenizer, with a chat template: the model's, or for the built-in model one
    trained on `samples`, which a resumed run must rebuild exactly."""
    if cfg.model is not None:
        tokenizer = load_tokenizer(cfg.model)
    else:
        tokenizer = tiny.build_tokenizer(samples)
        if resume_from is not None:
            _check_same_tokenizer(tokenizer, resume_from)
    ensure_chat_template(tokenizer)
    return tokenizer


def sft_rows(tokenizer: Any, samples: list[Sample], cfg: SFTConfig, what: str) -> TokenDataset:
    """SFT's token rows: each sample labelled on its assistant turns, truncated, packed if asked."""
    rows = encode_all(tokenizer, samples, cfg.max_length, what)
    if cfg.packing:
        rows = pack(rows, cfg.max_length, cfg.seed)
    return TokenDataset(rows)


def pick_prompts(tokenizer: Any, samples: list[Sample], n: int, max_length: int) -> list[Prompt]:
    """Up to `n` distinct prompts from samples that training sees whole (within `max_length`
    tokens): each chat up to its first assistant turn, or the first words of a text."""
    prompts: list[Prompt] = []
    for s in samples:
        if len(prompts) == n:
            break
        encoded = encode(tokenizer, s, max_length + 1)
        if encoded is None or len(encoded["input_ids"]) > max_length:
            continue
        if s.messages is not None:
            first = next(i for i, m in enumerate(s.messages) if m["role"] == "assistant")
            prompt: Prompt = list(s.messages[:first])
        else:
            prompt = " ".join(s.text.split()[:8])
        if prompt and prompt not in prompts:
            prompts.append(prompt)
    return prompts


# --- model ------------------------------------------------------------------------------------

def run_dtype(cfg: SFTConfig) -> torch.dtype:
    # The built-in model is tiny and trained from scratch: fp32, where bf16 would only lose updates;
    # but an FP8 base computes in what its GEMMs write (auto: bf16 on such a GPU).
    builtin_fp32 = cfg.model is None and cfg.dtype == "auto" and cfg.quant != "fp8"
    return torch.float32 if builtin_fp32 else pick_dtype(cfg.dtype)


def training_arguments(cfg: SFTConfig, dtype: torch.dtype, has_eval: bool, cls: type | None = None,
                       **extra: Any) -> Any:
    """The Trainer's arguments for `cfg`, as `cls` (TrainingArguments; a subclass such as a TRL
    config for other objectives, with its own settings in `extra`)."""
    from transformers import TrainingArguments

    steps = cfg.save_steps or None
    if cfg.sequence_parallel > 1:
        extra.update(seqpar.trainer_arguments(cfg.sequence_parallel))
    args = (cls or TrainingArguments)(
        output_dir=str(cfg.output_dir),
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
        report_to=cfg.report_to,
        disable_tqdm=True,  # tigon's Reporter draws the bar
        neftune_noise_alpha=cfg.neftune_alpha,
        **extra,
    )
    # One process counts its tokens on the host (TigonTrainer); several need the Trainer's
    # count, which gathers every process's on the device.
    args.include_num_input_tokens_seen = "non_padding" if args.world_size > 1 else "no"
    return args


@dataclass
class Built:
    """What the model stage hands on."""

    model: torch.nn.Module  # on the device, LoRA-wrapped if asked, tigon's kernels patched in
    base: torch.nn.Module | None  # the built-in model's initial weights, which its LoRA adapter needs on disk
    use_cache: bool  # the config's own setting, off while training and restored for the final save
    reference: torch.nn.Module | None = None  # a frozen copy of the initial weights, when the Job asks for one
    model_files: dict[str, str] = field(default_factory=dict)  # written beside the model at every save


def _quantized_builtin(model: torch.nn.Module, directory: str, dtype: torch.dtype, quantization: Any,
                       device: torch.device) -> torch.nn.Module:
    """The built-in model, which exists only in memory, quantised the way a model on disk is: written
    to `directory` (LoftQ reads the unquantised weights from there too) and loaded back."""
    name = model.name_or_path
    model.save_pretrained(directory)
    quantized = load_model(directory, dtype, quantization, device)
    quantized.name_or_path = name  # the adapter's base stays the built-in model's directory
    return quantized


def build_model(cfg: SFTConfig, tokenizer: Any, dtype: torch.dtype, args: Any, resume_from: Path | None,
                reference: bool = False, classifier: dict[str, Any] | None = None) -> Built:
    """The model stage: load (or build) the model, quantised if asked, LoRA-wrap it if asked, patch
    in tigon's kernels. With `reference`, also a frozen copy of the weights as loaded (patched too,
    in eval mode). With `classifier` (`classifier_options`), a sequence classifier on the model's
    backbone (its labels also written beside a LoRA adapter, whose base may not hold them)."""
    builtin = cfg.model is None
    quantization = quantization_config(cfg.quant, dtype) if cfg.quant else None
    if cfg.quant == "fp8":
        check_fp8(args.device, dtype)
    elif quantization is not None:
        check_bitsandbytes(cfg.quant, args.device)
    if not builtin and cfg.quant != "fp8" and fp8_checkpoint(cfg.model) is not None:
        raise SFTError(f"{cfg.model} is an FP8 checkpoint (quantization_config fp8): train LoRA on its FP8 weights "
                       "with --quant fp8")
    model = tiny.build_model(tokenizer, cfg.seed, classifier).to(dtype) if builtin else load_model(
        cfg.model, dtype, quantization, args.device, classifier)
    if classifier is not None:  # where its rows end: the last token that is not padding
        model.config.pad_token_id = tokenizer.pad_token_id
    if cfg.sequence_parallel > 1:
        seqpar.check_model(cfg.sequence_parallel, model.config)
        seqpar.prepare_model(model, cfg.packing)
    base_model = None
    if builtin and cfg.tuner == "lora":
        # The adapter needs its base on disk to be loadable, and a resumed run the same base.
        base = Path(cfg.output_dir) / BASE_DIR
        if resume_from is not None and base.is_dir():
            wrong = damage(base)
            if wrong is not None:
                raise SFTError(f"{wrong}: the run's LoRA adapters were trained on this base: delete {base} for "
                               "--resume to build it again from --seed, or pass --overwrite to start over")
            model = load_model(str(base), dtype)
        model.name_or_path = str(base.resolve())
        base_model = copy.deepcopy(model)  # LoRA wraps `model` in place; written out by start_output
    with tempfile.TemporaryDirectory() if builtin and quantization is not None else contextlib.nullcontext() as tmp:
        if tmp is not None:
            model = _quantized_builtin(model, tmp, dtype, quantization, args.device)
        use_cache, model.config.use_cache = model.config.use_cache, False  # see tigon.train.batching
        frozen = copy.deepcopy(model).eval().requires_grad_(False) if reference else None  # before LoRA and patching
        # DDP's search for unused parameters costs a graph walk per step; only routed experts need it.
        args.ddp_find_unused_parameters = any(getattr(model.config, k, None) for k in ("num_local_experts", "num_experts"))
        if quantization is not None and cfg.quant != "fp8":  # FP8 bases are frozen modules already
            prepare_quantized(model, cfg.gradient_checkpointing)
        if cfg.gradient_checkpointing:
            # Non-reentrant checkpointing needs no input that requires grad, so frozen embeddings (LoRA) work.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.tuner == "lora":
            model = add_lora(model, cfg, os.path.join(tmp, "model.safetensors") if tmp is not None else None)
    trainable, total = count_parameters(model)
    log.info("model: %s, %s%s, %s tuning: %.2fM of %.2fM parameters trainable",
             cfg.model or "built-in tiny Llama", str(dtype).replace("torch.", ""),
             f" (base {cfg.quant}{'' if cfg.quant == 'fp8' else ', bitsandbytes'})" if cfg.quant else "", _tuning(cfg), trainable / 1e6, total / 1e6)
    if quantization is None:  # a quantised model is on its device already, and moves no further
        model.to(args.device)
    apply_kernels(model, cfg, fp8_all_gather=_fsdp2(args))  # on its device: --fp8 checks the GPU's FP8
    if frozen is not None:
        apply_kernels(frozen, cfg, role="the frozen reference")
        if quantization is None:
            frozen.to(args.device)
    files = {QUANT_FILE: quantization_record(quantization)} if quantization is not None else {}
    if classifier is not None and cfg.tuner == "lora":
        files[LABELS_FILE] = json.dumps(classifier["id2label"], indent=1) + "\n"
    return Built(model, base_model, use_cache, frozen, files)


def _tuning(cfg: SFTConfig) -> str:
    """What the log calls the run's tuning: full, lora, or the PEFT variant and options."""
    if cfg.tuner != "lora":
        return cfg.tuner
    extras = (["rsLoRA"] if cfg.use_rslora else []) + ([f"{cfg.init_lora_weights} init"] if cfg.init_lora_weights else [])
    extras += [f"LoRA+ x{cfg.loraplus_lr_ratio:g}"] if cfg.loraplus_lr_ratio else []
    name = {"lora": "QLoRA" if cfg.quant else "LoRA", "dora": "QDoRA" if cfg.quant else "DoRA"}[cfg.lora_variant]
    return name + (f" ({', '.join(extras)})" if extras else "")


# --- output directory -------------------------------------------------------------------------

def start_output(output_dir: Path, resume_from: Path | None, built: Built, tokenizer: Any, args: Any) -> None:
    """Make the output directory ready: a new run clears what an old one left (after --overwrite,
    or --resume with no checkpoint yet); a resumed one keeps the metrics up to its checkpoint
    (later lines belong to the run that was stopped). Writes the built-in model's LoRA base."""
    if not args.should_save:
        return
    output_dir.mkdir(parents=True, exist_ok=True)
    for staging in output_dir.glob(STAGING_PREFIX + "*"):
        remove_path(staging)  # a crash's half-written saves (directories, and files), holding disk space
    if resume_from is not None:
        step = json.loads((resume_from / "trainer_state.json").read_text())["global_step"]
        kept = [r for r in read_metrics(output_dir) if r["step"] <= step]
        with written_atomically(output_dir / METRICS_FILE, directory=False) as staging:
            staging.write_text("".join(json.dumps(r) + "\n" for r in kept))
    else:
        for path in list_checkpoints(output_dir) + _leftovers(output_dir):
            remove_path(path)
    base = output_dir / BASE_DIR
    if built.base is not None and not base.is_dir():
        with written_atomically(base) as staging:
            built.base.save_pretrained(staging)
            tokenizer.save_pretrained(staging)


# --- trainer ----------------------------------------------------------------------------------

def _peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """The measured dense-matmul rate of this device, the denominator of MFU. CPUs often run
    half-precision matmuls slower than fp32 (emulated), so there the fp32 rate is the peak."""
    return measure_matmul_rate(device, dtype if device.type == "cuda" else torch.float32)


def make_reporter(output_dir: Path, model: torch.nn.Module, tokens_per_row: float, args: Any,
                  dtype: torch.dtype, job: Job) -> Reporter:
    """The Reporter of a run of `job`, its MFU counted from the model's FLOPs per trained token."""
    return Reporter(output_dir, job.flops(model, tokens_per_row), _peak_flops(args.device, dtype), args.world_size,
                    command=job.command, metrics=job.metrics)


def attach_reporter(trainer: Any, reporter: Reporter) -> None:
    """`reporter` in place of the Trainer's printing, and ahead of the trackers of --report-to,
    so that they log its speed figures too."""
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    trainer.callback_handler.callbacks.insert(0, reporter)


def planned_steps(args: Any, n_rows: int) -> int:
    """The optimizer steps the Trainer plans for `n_rows` rows: --max-steps, or the epochs over
    one process's share of the batches, in steps of gradient accumulation (its own arithmetic)."""
    if args.max_steps > 0:
        return args.max_steps
    batches = math.ceil(n_rows / (args.per_device_train_batch_size * args.world_size))
    return math.ceil(args.num_train_epochs * max(math.ceil(batches / args.gradient_accumulation_steps), 1))


def _checkpoint_step(checkpoint: Path) -> int:
    return json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]


def already_trained(cfg: SFTConfig, resume_from: Path | None, planned: int) -> bool:
    """Whether --resume finds nothing left to train: its checkpoint has reached the planned steps
    (resuming it would train one step too many), or the run finished keeping no checkpoint."""
    if not cfg.resume:
        return False
    if resume_from is None:
        return finished(Path(cfg.output_dir))
    return _checkpoint_step(resume_from) >= planned


def fit(trainer: Any, resume_from: Path | None) -> None:
    """Train (from `resume_from`), then evaluate the last step unless that was done. Ctrl-C or
    SIGTERM ends the run after the step in progress with a checkpoint to resume from (`Interrupted`)."""
    stop = StopOnSignal()
    trainer.add_callback(stop)
    try:
        with stop.catching():
            trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    except BaseException:
        for callback in trainer.callback_handler.callbacks:
            if isinstance(callback, Reporter):
                callback.close()  # so that the error shows on a line of its own
        raise
    finally:
        trainer.remove_callback(stop)
    if stop.signum is not None:
        step = trainer.state.global_step
        saved = Path(trainer.args.output_dir) / f"checkpoint-{step}"
        if saved.is_dir():
            raise Interrupted(f"stopped by {signal_name(stop.signum)} at step {step} of {trainer.state.max_steps}: "
                              f"saved {saved}; rerun the same command with --resume to continue", stop.signum)
        # It came after the last step's save point (during the final evaluation, say): writing
        # final/ is then the quickest complete save there is.
        log.info("%s after the last step: finishing the run (again: quit at once)", signal_name(stop.signum))
    evaluated = {r["step"] for r in trainer.state.log_history if "eval_loss" in r}
    if trainer.eval_dataset is not None and trainer.state.global_step not in evaluated:
        trainer.evaluate()


# --- final model and samples ------------------------------------------------------------------

def _prompt_text(prompt: Prompt) -> str:
    # A chat's last message; another kind of prompt (one with images) says itself what it is.
    return prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)


def _shown(text: str) -> str:
    """`text` for the log, cut to a readable length."""
    return repr(text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 1] + "…")


def answer(built: Built, tokenizer: Any, prompts: list[Prompt], cfg: SFTConfig, job: Job | None = None) -> list[str]:
    if job is not None and job.answer is not None:
        return [job.answer(built.model, p) for p in prompts]
    return [generate(built.model, tokenizer, p, cfg.max_new_tokens) for p in prompts]


def finish(trainer: Any, built: Built, tokenizer: Any, cfg: SFTConfig, prompts: list[Prompt],
           before: list[str], job: Job | None = None) -> Path:
    """The final stage: final/ (written atomically, gathered from every process), the samples'
    answers after training next to those before, and where to go from here."""
    output_dir = Path(cfg.output_dir)
    built.model.config.use_cache = built.use_cache
    final = output_dir / FINAL_DIR
    staging = final.with_name(STAGING_PREFIX + FINAL_DIR)
    if trainer.is_world_process_zero():
        staging_dir(final)
    trainer.accelerator.wait_for_everyone()
    with removed_on_failure(staging, final):
        trainer.save_model(str(staging))  # every process: sharded models gather here
    trainer.accelerator.wait_for_everyone()
    if trainer.is_world_process_zero():
        with removed_on_failure(staging, final):
            publish(staging, final)
        after = answer(built, tokenizer, prompts, cfg, job)
        record = [{"prompt": _prompt_text(p), "before": b, "after": a} for p, b, a in zip(prompts, before, after)]
        with written_atomically(output_dir / SAMPLES_FILE, directory=False) as staging:
            staging.write_text(json.dumps(record, indent=1) + "\n")
        for r in record:
            log.info("sample: %s\n  before: %s\n  after:  %s", _shown(r["prompt"]), _shown(r["before"]),
                     _shown(r["after"]))
        what = "LoRA adapter" if cfg.tuner == "lora" else "model"
        use = job.try_with or ("tigon infer {} --prompt TEXT" if is_classifier(built.model) else "tigon chat {}")
        log.info("%s: %s  (%s%s)", what, final, use.format(final),
                 f"; tigon merge {final} --output {output_dir / 'merged'}" if cfg.tuner == "lora" else "")
    return final


# --- the whole run ----------------------------------------------------------------------------

def _sharded(args: Any) -> bool:
    """Whether the Trainer will shard the model (FSDP or DeepSpeed, from its arguments or from an
    `accelerate launch` config): generating on rank 0 alone would then wait forever for the others."""
    launched = any(os.environ.get(f"ACCELERATE_USE_{name}", "").lower() in ("1", "true") for name in ("FSDP", "DEEPSPEED"))
    return launched or bool(getattr(args, "fsdp", None)) or bool(getattr(args, "deepspeed", None))


def _fsdp2(args: Any) -> bool:
    """Whether the Trainer will shard the model with FSDP2 (``fully_shard``): `accelerate launch`
    with ``fsdp_version: 2``, or the Trainer's own fsdp arguments asking for version 2."""
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        return os.environ.get("FSDP_VERSION", "1") == "2"
    options = getattr(args, "fsdp_config", None) or {}
    return bool(getattr(args, "fsdp", None)) and str(options.get("version", options.get("fsdp_version", 1))) == "2"


def _stopped_line(output_dir: Path) -> str:
    """What a Ctrl-C outside the training loop (while loading, or saving final/) leaves to go on from."""
    checkpoints = list_checkpoints(output_dir)
    if checkpoints:
        return f"interrupted; newest checkpoint: {checkpoints[-1]} (--resume continues from it)"
    return "interrupted; no checkpoint saved"


def guarded(cfg: SFTConfig, body: Callable[[], Path]) -> Path:
    """Run `body` (a whole run of `cfg`) with the thread count the model wants, a Ctrl-C outside
    training turned into `Interrupted` saying what there is to resume from."""
    threads = torch.get_num_threads()
    if cfg.model is None and not torch.cuda.is_available():
        # The built-in model's matrices are too small to gain from threads, and with more threads
        # than idle cores OpenMP's spinning made each step 16x slower (a busy 2-core machine).
        torch.set_num_threads(1)
    try:
        return body()
    except KeyboardInterrupt:
        raise Interrupted(_stopped_line(Path(cfg.output_dir))) from None
    finally:
        torch.set_num_threads(threads)


def run_sft(cfg: SFTConfig, given: set[str] = frozenset()) -> Path:
    """Fine-tune as `cfg` says; returns the directory of the final model (or adapter). Raises
    `Interrupted` when stopped by Ctrl-C or SIGTERM (during training, after saving a checkpoint)."""
    if cfg.task == "classification":
        from tigon.train import classify

        return guarded(cfg, lambda: classify.run(classify.resolve_classification(cfg, given)))
    if cfg.labels is not None:
        raise SFTError("--labels: only for --task classification")
    return guarded(cfg, lambda: _run(resolve(cfg, given)))


@dataclass
class Job:
    """What an objective brings to the stages it shares (`train`): its rows and its Trainer."""

    command: str  # the command running it, named on the progress bar and the loss plot
    rows: Any  # the training rows (one per Trainer sample)
    tokens: int  # the tokens they hold
    sequences: int  # the sequences they hold (a preference pair is two): tokens / sequences is the MFU's length
    arguments: Callable[[torch.dtype], Any]  # the Trainer's arguments, for the run's weight dtype
    trainer: Callable[[Built, Any], Any]  # the Trainer, for the model stage's output and those arguments
    prompts: Callable[[], list[Prompt]]  # candidate prompts answered before and after training
    reference: bool = False  # the model stage keeps a frozen copy of the initial weights
    metrics: dict[str, str] = field(default_factory=dict)  # log keys the Reporter records: their bar labels
    flops: Callable[[torch.nn.Module, float], float] = flops_per_token  # per trained token, of a sequence length
    samples: int | None = None  # the Trainer's samples per epoch, when not one per row (GRPO: its completions)
    # The model stage, for models `build_model` does not make (vision-language ones), and how the
    # model answers a prompt (default: a chat's reply, `generate`).
    build: Callable[[torch.dtype, Any, Path | None], Built] | None = None
    answer: Callable[[torch.nn.Module, Any], str] | None = None
    classifier: dict[str, Any] | None = None  # a sequence classifier's config keywords (`classifier_options`)
    try_with: str | None = None  # the finish line's command for the saved model ({}: its path); None: chat or infer


def train(cfg: SFTConfig, resume_from: Path | None, tokenizer: Any, job: Job) -> Path:
    """The stages from the model on, for `job`: model, output directory, Trainer, training and
    final/ (or, for a finished run resumed, only what is missing of it)."""
    output_dir = Path(cfg.output_dir)
    dtype = run_dtype(cfg)
    args = job.arguments(dtype)
    planned = planned_steps(args, len(job.rows) if job.samples is None else job.samples)
    complete = already_trained(cfg, resume_from, planned)
    if complete:
        done = f"step {_checkpoint_step(resume_from)} of {planned}" if resume_from else "no checkpoint kept"
        if finished(output_dir):
            log.info("%s: the run is complete (%s) and its model is in %s: nothing to do (to train further, "
                     "--resume with a higher --max-steps or --epochs)", output_dir, done, output_dir / FINAL_DIR)
            return output_dir / FINAL_DIR
        log.info("%s: the run is complete (%s) but has no intact %s/: writing it from %s", output_dir, done,
                 FINAL_DIR, resume_from.name)

    built = (job.build(dtype, args, resume_from) if job.build is not None
             else build_model(cfg, tokenizer, dtype, args, resume_from, reference=job.reference, classifier=job.classifier))
    if cfg.samples and _sharded(args):
        log.info("samples: skipped under FSDP/DeepSpeed (a sharded model generates only with every rank); "
                 "try the saved model with `tigon chat`")
    main_only = args.process_index == 0 and not _sharded(args)
    prompts = job.prompts() if main_only else []
    before = answer(built, tokenizer, prompts, cfg, job)
    for prompt, reply in zip(prompts, before):
        log.info("before training: %s -> %s", _shown(_prompt_text(prompt)), _shown(reply))

    start_output(output_dir, resume_from, built, tokenizer, args)
    reporter = make_reporter(output_dir, built.model, job.tokens / job.sequences, args, dtype, job)
    trainer = job.trainer(built, args)
    trainer.model_files = built.model_files
    if cfg.loraplus_lr_ratio:
        # The Trainer makes its optimizer only when it has none; this one keeps its scheduler.
        trainer.optimizer = loraplus_optimizer(built.model, args, cfg.loraplus_lr_ratio)
    attach_reporter(trainer, reporter)
    if complete:
        trainer._load_from_checkpoint(str(resume_from))
    else:
        fit(trainer, resume_from)
    return finish(trainer, built, tokenizer, cfg, prompts, before, job)


def _run(cfg: SFTConfig) -> Path:
    from tigon.train.vision_run import check_text_run, run_vision, wants_vision

    if wants_vision(cfg):
        return run_vision(cfg)
    check_text_run(cfg)
    resume_from = start(cfg)
    samples, eval_samples = load_data(cfg)
    tokenizer = tokenizer_for(cfg, samples, resume_from)
    train_data = sft_rows(tokenizer, samples, cfg, "training data")
    eval_data = sft_rows(tokenizer, eval_samples, cfg, "evaluation data") if eval_samples else None
    log.info("tokens: %d training rows%s, %d tokens, max length %d", len(train_data),
             " (packed)" if cfg.packing else "", train_data.num_tokens(), cfg.max_length)
    if cfg.cuda_graphs:
        fill = train_data.num_tokens() / (len(train_data) * cfg.max_length)
        log.info("--cuda-graphs: every batch padded to %d tokens a row (one shape; a last, smaller batch of an "
                 "epoch is a second one); rows are %.0f%% full%s", cfg.max_length, 100 * fill,
                 "" if cfg.packing or fill > 0.8 else ": --packing would fill them")
    if cfg.sequence_parallel > 1:
        log.info("--sequence-parallel %d: each batch padded to a multiple of %d tokens, cut into %d shards",
                 cfg.sequence_parallel, cfg.sequence_parallel, cfg.sequence_parallel)

    def trainer(built: Built, args: Any) -> TigonTrainer:
        return TigonTrainer(model=built.model, args=args, train_dataset=train_data, eval_dataset=eval_data,
                            data_collator=Collator(tokenizer.pad_token_id, cfg.max_length if cfg.cuda_graphs else None,
                                                   cfg.sequence_parallel),
                            processing_class=tokenizer, save_limit=cfg.save_limit,
                            cuda_graphs=cfg.cuda_graphs, token_accuracy=True)

    job = Job("sft", train_data, train_data.num_tokens(), len(train_data),
              arguments=lambda dtype: training_arguments(cfg, dtype, eval_data is not None), trainer=trainer,
              prompts=lambda: pick_prompts(tokenizer, samples, cfg.samples, cfg.max_length),
              metrics={TOKEN_ACCURACY: "acc"})
    return train(cfg, resume_from, tokenizer, job)
