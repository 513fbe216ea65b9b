"""`tigon rlhf --method gkd`: on-policy knowledge distillation (GKD, Agarwal et al. 2024) on TRL's
GKDTrainer, its generalised-JSD loss computed by tigon's fused `linear_distill_loss` from the
student's and the frozen teacher's last hidden states and LM heads: neither model's (tokens x
vocab) logits exist.

What stays TRL's: the choice per step (a share --lmbda of the steps train on the student's own
samples, the others on the dataset's answers, or with --seq-kd on the teacher's), sampling with
transformers' `generate`, the chat collator (loss on the answers only), logging. The loss is
TRL's `generalized_jsd_loss` as its GKDTrainer calls it: untempered logits (the temperature is
the sampling's), beta from 0 (forward KL) to 1 (reverse KL), the mean over the answer tokens, or
over the accumulation window's count the Trainer passes.

Data: sft's chat formats (the answers are the off-policy steps' targets, the prompts what the
student samples from). With no --model the student is a fresh built-in tiny model and the teacher
(default) the built-in model after sft, on the bundled instructions; another model needs
--teacher, a causal LM with the student's vocabulary.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import set_seed
from trl.experimental.gkd import GKDConfig, GKDTrainer
from trl.experimental.utils import DataCollatorForChatML

import tigon.functional as TF
from tigon.train import tiny
from tigon.train.batching import NUM_TOKENS
from tigon.train.builtin import builtin_after_sft, builtin_tokenizer
from tigon.train.config import RLHFConfig, SFTError
from tigon.train.data import load_samples
from tigon.train.fused import FusedTrainer, checkpointing_off, frozen_patcher
from tigon.train.modeling import flops_per_token, load_model, load_tokenizer
from tigon.train.run import Built, Job, pick_prompts, run_dtype, split_off, start, train, training_arguments
from tigon.train.template import ensure_chat_template, render
from tigon.train.trainer import TigonTrainer

log = logging.getLogger("tigon.train")

METRICS = {"divergence": "jsd"}  # linear_distill_loss's metric, on the progress bar


class TigonGKDTrainer(FusedTrainer, TigonTrainer, GKDTrainer):
    """TRL's GKDTrainer computing its loss with `linear_distill_loss` from both models' hidden
    states (its `compute_loss` replaced, everything else TRL's), with tigon's checkpoints and step
    loop."""

    _HIDDEN_MODELS = ("model", "teacher_model")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        weight, bias = self._head(model)
        student = self._hidden(model, ids, mask).to(weight.dtype)
        self.teacher_model.eval()
        teacher_weight, teacher_bias = self._head(self.teacher_model)
        with torch.no_grad():
            teacher = self._hidden(self.teacher_model, ids, mask).to(teacher_weight.dtype)
        loss, metrics = TF.linear_distill_loss(
            student, weight, teacher, teacher_weight, inputs["labels"][:, 1:], loss="jsd", beta=self.beta,
            student_bias=bias, teacher_bias=teacher_bias, num_items_in_batch=num_items_in_batch,
        )
        for key, value in metrics.items():
            self._add(mode, key, value, 1)
        # tigon passes no compute_metrics: evaluation asks for the loss alone, not the logits.
        return (loss, None) if return_outputs else loss


class _Counted:
    """TRL's chat collator, adding the batch's token count (on the host, before the batch moves
    to the device) that tigon's step loop counts its throughput with. An on-policy step trains
    on the student's samples instead; the count is the dataset batch's."""

    def __init__(self, collator: Any):
        self.collator = collator

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collator(rows)
        batch[NUM_TOKENS] = int(batch["attention_mask"].sum())
        return batch


def trl_arguments(cfg: RLHFConfig, dtype: torch.dtype, has_eval: bool) -> Any:
    """TRL's GKDConfig for `cfg`: tigon's Trainer arguments and GKD's own."""
    extra: dict[str, Any] = dict(
        temperature=cfg.temperature, lmbda=cfg.lmbda, beta=cfg.beta, max_new_tokens=cfg.max_completion_length,
        seq_kd=cfg.seq_kd, disable_dropout=True, max_length=cfg.max_length, **checkpointing_off(GKDConfig),
    )
    return training_arguments(cfg, dtype, has_eval, cls=GKDConfig, **extra)


def _chats(samples: list[Any], what: str) -> list[dict[str, Any]]:
    """TRL's rows (``messages``) of `samples`, each a chat with an answer to distil."""
    for s in samples:
        if s.messages is None or not any(m["role"] == "assistant" for m in s.messages):
            raise SFTError(f"{s.where}: --method gkd distils chats (the teacher scores the answers): a plain text "
                           f"row has no prompt to sample from")
    if not samples:
        raise SFTError(f"{what}: no rows")
    return [{"messages": list(s.messages)} for s in samples]


def _vocab(model: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model).get_text_config().vocab_size


def _teacher(cfg: RLHFConfig, path: str, dtype: torch.dtype) -> torch.nn.Module:
    """The frozen teacher, patched as the student is (less its loss: only its backbone runs)."""
    teacher = load_model(path, dtype).eval().requires_grad_(False)
    patch = frozen_patcher(cfg, "the teacher")
    if patch is not None:
        patch(teacher)
    return teacher


def run(cfg: RLHFConfig) -> Path:
    """`tigon rlhf --method gkd` for a resolved `cfg`; returns the final model's (or adapter's) directory."""
    resume_from = start(cfg)
    samples = load_samples(cfg.dataset or [str(tiny.BUNDLED_DATASET)], cfg.seed)
    eval_samples: list[Any] = []
    if cfg.eval_dataset:
        eval_samples = load_samples(cfg.eval_dataset, cfg.seed)
    elif cfg.eval_split:
        samples, eval_samples = split_off(samples, cfg.eval_split, cfg.seed)
    rows = _chats(samples, "training data")
    eval_rows = _chats(eval_samples, "evaluation data") if eval_samples else None
    # The built-in student speaks the built-in teacher's tokens, whatever the data.
    tokenizer = builtin_tokenizer() if cfg.model is None else load_tokenizer(cfg.model)
    ensure_chat_template(tokenizer)
    # The rendered chat's tokens (transformers 5's apply_chat_template(tokenize=True) returns a
    # BatchEncoding, whose len() counts its keys).
    tokens = sum(len(tokenizer(render(tokenizer, r["messages"], False), add_special_tokens=False).input_ids)
                 for r in rows)
    log.info("tokens: %d training chats, %d tokens, max length %d; on-policy share %g, samples of up to %d tokens",
             len(rows), tokens, cfg.max_length, cfg.lmbda, cfg.max_completion_length)
    if cfg.teacher is not None:
        student_vocab = len(tokenizer) if cfg.model is None else _vocab(cfg.model)
        try:
            teacher_vocab = _vocab(cfg.teacher)
        except (OSError, ValueError):
            raise SFTError(f"--teacher {cfg.teacher}: not a model directory or hub id with a config.json") from None
        if teacher_vocab != student_vocab:
            raise SFTError(f"--teacher {cfg.teacher}: its vocabulary has {teacher_vocab} tokens, the student's "
                           f"{student_vocab}: distillation compares next-token distributions over one vocabulary")
        teacher_path = cfg.teacher
    else:  # everything is checked: the sft stage may write now
        teacher_path = str(builtin_after_sft(cfg, tokenizer, role="teacher"))
        set_seed(cfg.seed)  # as a run that found the sft stage done
    log.info("teacher: %s", teacher_path)
    from datasets import Dataset

    train_data = Dataset.from_list(rows)
    eval_data = Dataset.from_list(eval_rows) if eval_rows else None

    def trainer(built: Built, args: Any) -> TigonGKDTrainer:
        teacher = _teacher(cfg, teacher_path, run_dtype(cfg))
        collator = _Counted(DataCollatorForChatML(tokenizer=tokenizer, max_length=args.max_length))
        return TigonGKDTrainer(model=built.model, teacher_model=teacher, args=args, train_dataset=train_data,
                               eval_dataset=eval_data, processing_class=tokenizer, data_collator=collator,
                               save_limit=cfg.save_limit)

    def flops(model: torch.nn.Module, seq_len: float) -> float:
        # Per trained token: the student's step and the teacher's forward (taken as the student's size).
        return flops_per_token(model, seq_len) + flops_per_token(model, seq_len, backward=False)

    job = Job("rlhf", train_data, tokens, len(rows),
              arguments=lambda dtype: trl_arguments(cfg, dtype, eval_data is not None), trainer=trainer,
              prompts=lambda: pick_prompts(tokenizer, samples, cfg.samples, cfg.max_length),
              metrics=METRICS, flops=flops)
    return train(cfg, resume_from, tokenizer, job)
