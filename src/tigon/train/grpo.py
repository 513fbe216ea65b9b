"""`tigon rlhf --method grpo`: online RL on TRL's GRPOTrainer from reward functions
(`tigon.train.rewards`), its loss replaced by tigon's fused `linear_policy_loss`, computed from the
policy's last hidden states and the LM head's weight: the (completions x tokens x vocab) logits
never exist, in forward or backward.

What stays TRL's: sampling (transformers' `generate`, or vLLM colocated with --use-vllm), the
rewards and their group-normalised advantages, the reference model (beta > 0: the LoRA base with
the adapter switched off, or a frozen copy loaded from the model's path), the old policy's
log-probs when a generation is reused, metrics and logging. Those per-token log-probs (reference,
old policy) go through TRL's fused LM head, which `tigon.patch` (switch ``trl_log_probs``) runs on
`linear_log_probs`. The loss is TRL 1.16's `_compute_loss` for loss types grpo, dapo, dr_grpo,
bnpo, cispo, sapo, luspo and vespo (and gspo: grpo with a sequence-level importance ratio), with
TRL's normalisations, its division by the gradient-accumulation steps, its bias-corrected KL
(`use_bias_correction_kl`) and two-sided clipping (`delta`). With --use-vllm, the fused loss takes
vLLM's sampling log-probs and forms TRL's truncated (or masked) importance-sampling weight itself,
against the old policy's log-probs (which TRL then always computes).

Data: prompts, with whatever other columns the reward functions read (`answer` for
builtin:exact_answer). With no --dataset, the bundled task: 40 "What is 7 plus 5?"-style sums and
differences whose answers (the built-in model's sft data holds some of them) the exact-answer
reward scores; with no --model the policy is the built-in model after sft.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from trl import GRPOConfig, GRPOTrainer

import tigon.functional as TF
from tigon.train.builtin import builtin_after_sft, builtin_tokenizer
from tigon.train.config import RLHFConfig, SFTError
from tigon.train.data import Format, RowError, _text, load_samples, turn_list
from tigon.train.fused import FusedTrainer, checkpointing_off, frozen_patcher
from tigon.train.modeling import flops_per_token, load_tokenizer
from tigon.train.preference import _ids as chat_ids
from tigon.train.rewards import Reward, check_rewards, load_rewards
from tigon.train.run import Built, Job, split_off, start, train, training_arguments
from tigon.train.template import ensure_chat_template
from tigon.train.trainer import TigonTrainer

log = logging.getLogger("tigon.train")

BUNDLED_PROMPTS = Path(__file__).parent / "data" / "arithmetic.jsonl"
# Columns TRL reads itself (images: a vision-language batch), or passes under these names.
_RESERVED = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments",
             "image", "images", "completion")
# A rollout batch's model inputs beside its tokens (TRL's names): a vision-language model's pixels,
# image grids and token types, given to the loss's forward as TRL gives them to its own.
MEDIA = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes", "token_type_ids",
         "mm_token_type_ids", "image_position_ids")
# TRL's metrics of a GRPO step (its names) that the progress bar shows (those with a label) and
# metrics.jsonl records.
METRICS = {"reward": "reward", "reward_std": "", "frac_reward_zero_std": "", "completions/mean_length": "len",
           "completions/clipped_ratio": "", "kl": "kl", "entropy": "", "clip_ratio/region_mean": "",
           "clip_ratio/low_mean": "", "clip_ratio/high_mean": "", "cispo_clip_ratio": "", "vespo/phi_seq_mean": ""}


# --- data ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PromptRow:
    """A prompt (the chat up to the answer) and the row's other columns, for the reward functions."""

    where: str
    prompt: tuple[dict[str, str], ...]
    columns: dict[str, Any]


def _prompt_turns(value: Any, key: str) -> tuple[dict[str, str], ...]:
    if isinstance(value, str):
        return ({"role": "user", "content": _text(value, key)},)
    turns = turn_list(value, key)
    if turns[-1]["role"] == "assistant":
        raise RowError(f"{key} ends with an assistant turn; a GRPO prompt is what the answer follows")
    return tuple(turns)


def _columns(row: dict, taken: tuple[str, ...]) -> dict[str, Any]:
    reserved = [k for k in row if k in _RESERVED]
    if reserved:
        raise RowError(f"column {reserved[0]!r} is a name TRL's GRPOTrainer uses itself: rename it")
    return {k: v for k, v in row.items() if k not in taken}


def _from_prompt(row: dict) -> PromptRow:
    return PromptRow("", _prompt_turns(row["prompt"], "prompt"), _columns(row, ("prompt",)))


def _from_question(row: dict) -> PromptRow:
    return PromptRow("", _prompt_turns(row["question"], "question"), _columns(row, ("question",)))


def _from_messages(row: dict) -> PromptRow:
    """A chat whose last turn is the answer: the turns before it are the prompt, its text the
    `answer` column (unless the row has one)."""
    messages = turn_list(row["messages"], "messages")
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        raise RowError("messages must end with an assistant answer after a prompt")
    columns = _columns(row, ("messages",))
    columns.setdefault("answer", messages[-1]["content"])
    return PromptRow("", _prompt_turns(messages[:-1], "messages"), columns)


FORMATS: list[Format] = [
    ("prompt (+ columns)", ("prompt",), _from_prompt),
    ("question (+ columns)", ("question",), _from_question),
    ("messages ending in the answer", ("messages",), _from_messages),
]


def load_prompts(specs: list[str], seed: int) -> list[PromptRow]:
    return load_samples(specs, seed, FORMATS)


def prompt_rows(tokenizer: Any, items: list[PromptRow], max_length: int, what: str
                ) -> tuple[list[dict[str, Any]], list[int]]:
    """TRL's dataset rows (``prompt`` as messages, then every column any row has, None where a
    row lacks it) of the prompts shorter than `max_length` tokens (templated), the others dropped
    with a count; and each kept prompt's token count."""
    names = sorted({k for item in items for k in item.columns})
    rows, lengths = [], []
    for item in items:
        n = len(chat_ids(tokenizer, item.prompt, item.where, True))
        if n < max_length:
            rows.append({"prompt": list(item.prompt), **{k: item.columns.get(k) for k in names}})
            lengths.append(n)
    if len(rows) < len(items):
        log.warning("%s: %d of %d prompts are --max-length %d tokens or longer: dropped", what,
                    len(items) - len(rows), len(items), max_length)
    if not rows:
        raise SFTError(f"{what}: no prompt is shorter than --max-length {max_length} tokens")
    return rows, lengths


def _trial_completions(tokenizer: Any, rows: list[dict[str, Any]]) -> tuple[list[Any], list[list[int]]]:
    """Completions to try the reward functions on: each row's answer when it has one, else a word."""
    texts = [str(row["answer"]) if row.get("answer") is not None else "Yes." for row in rows]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] or [tokenizer.eos_token_id] for t in texts]
    return [[{"role": "assistant", "content": t}] for t in texts], ids


# --- the trainer --------------------------------------------------------------------------------

class OnlineFused(FusedTrainer):
    """Mixed in before TRL's GRPOTrainer or RLOOTrainer (after FusedTrainer's place):
    `patch_reference` patches TRL's reference model (a frozen copy it loads itself), and the MoE
    load-balancing loss, which the fused loss cannot add, is switched off with a warning."""

    def __init__(self, *, patch_reference: Any = None, **kwargs: Any):
        super().__init__(**kwargs)
        if self.ref_model is not None and patch_reference is not None:
            patch_reference(self.accelerator.unwrap_model(self.ref_model))
        if self.aux_loss_enabled:
            log.warning("the MoE load-balancing loss is left out (the fused loss takes the hidden states "
                        "alone, not the router's logits)")
            self.aux_loss_enabled = False

    def _completion_hidden(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """`model`'s last hidden states at the positions that predict a rollout batch's completion
        tokens, ``(completions, tokens, hidden)``."""
        prompt_ids = batch["prompt_ids"]
        input_ids = torch.cat([prompt_ids, batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        return self._hidden(model, input_ids, attention_mask)[:, prompt_ids.shape[1] - 1:]


class TigonGRPOTrainer(OnlineFused, TigonTrainer, GRPOTrainer):
    """TRL's GRPOTrainer computing its loss with `linear_policy_loss` from the policy's hidden
    states (TRL's `_compute_loss` replaced, everything else TRL's), with tigon's checkpoints and
    step loop."""

    def _policy_loss_type(self) -> str:
        if self.importance_sampling_level == "sequence" and self.loss_type == "grpo":
            return "gspo"
        return self.loss_type

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        completion_mask = inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        weight, bias = self._head(model)
        # Position i predicts token i + 1: the completion's tokens come from the positions before them.
        media = {k: inputs[k] for k in MEDIA if inputs.get(k) is not None}
        hidden = self._hidden(model, input_ids, attention_mask, **media)[:, prompt_ids.shape[1] - 1:].to(weight.dtype)
        loss_type = self._policy_loss_type()
        options: dict[str, Any] = {}
        if self.use_vllm and self.vllm_importance_sampling_correction:
            options.update(
                sampling_log_probs=inputs["sampling_per_token_logps"],
                importance_sampling_mode=self.vllm_importance_sampling_mode,
                importance_sampling_clip_min=self.vllm_importance_sampling_clip_min,
                importance_sampling_clip_max=self.vllm_importance_sampling_clip_max,
            )
        if loss_type in ("dapo", "cispo", "vespo"):  # TRL's normaliser: the generation batch's tokens, per window
            items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                items = items * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            options["num_items_in_batch"] = items
        elif loss_type == "dr_grpo":
            options["max_completion_length"] = self.max_completion_length
        if loss_type not in ("cispo", "sapo", "vespo"):  # the clipped losses
            options["delta"] = self.args.delta
        args = self.args
        loss, metrics = TF.linear_policy_loss(
            hidden, weight, completion_ids, inputs.get("old_per_token_logps"), inputs["advantages"],
            ref_log_probs=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None, beta=self.beta,
            epsilon=self.epsilon_low, epsilon_high=self.epsilon_high, loss_type=loss_type,
            importance_level=self.importance_sampling_level, temperature=self.temperature, mask=mask, bias=bias,
            kl_bias_correction=args.use_bias_correction_kl, sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_gamma=(args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg), **options,
        )
        if loss_type not in ("dapo", "cispo", "vespo") and mode == "train":  # TRL divides these by the steps itself
            loss = loss / self.current_gradient_accumulation_steps
        for key, value in metrics.items():
            self._add(mode, key, value, 1)
        return loss


# --- the run ------------------------------------------------------------------------------------

def _vllm_correction(cfg: RLHFConfig) -> dict[str, Any]:
    """TRL's vllm_importance_sampling_* arguments for `cfg` (its default mode, token_truncate for vespo)."""
    mode = cfg.vllm_importance_sampling_mode or ("token_truncate" if cfg.loss_type == "vespo" else "sequence_mask")
    return dict(vllm_importance_sampling_correction=mode != "none",
                vllm_importance_sampling_mode="sequence_mask" if mode == "none" else mode,
                vllm_importance_sampling_clip_min=cfg.vllm_importance_sampling_clip_min,
                vllm_importance_sampling_clip_max=cfg.vllm_importance_sampling_clip_max)


def trl_arguments(cfg: RLHFConfig, dtype: torch.dtype, has_eval: bool, **more: Any) -> Any:
    """TRL's GRPOConfig for `cfg`: tigon's Trainer arguments, GRPO's own and `more`."""
    gspo = cfg.loss_type == "gspo"
    extra: dict[str, Any] = dict(
        num_generations=cfg.num_generations, max_completion_length=cfg.max_completion_length,
        temperature=cfg.temperature, beta=cfg.beta, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
        loss_type="grpo" if gspo else cfg.loss_type,
        importance_sampling_level="sequence" if cfg.loss_type in ("gspo", "luspo") else "token",
        delta=cfg.delta, sapo_temperature_pos=cfg.sapo_temperature_pos, sapo_temperature_neg=cfg.sapo_temperature_neg,
        vespo_k_pos=cfg.vespo_k_pos, vespo_lambda_pos=cfg.vespo_lambda_pos, vespo_k_neg=cfg.vespo_k_neg,
        vespo_lambda_neg=cfg.vespo_lambda_neg, **_vllm_correction(cfg),
        use_vllm=cfg.use_vllm, vllm_mode="colocate", disable_dropout=True, log_completions=False,
        **checkpointing_off(GRPOConfig), **more,
    )
    return training_arguments(cfg, dtype, has_eval, cls=GRPOConfig, **extra)


@dataclass(frozen=True)
class Method:
    """What an online method run by :func:`run` brings: its Trainer (built as TigonGRPOTrainer is,
    plus `trainer_options(cfg)`), its TRL arguments, the metrics it logs, how many optimizer
    batches one generation batch holds (`mini_batches(cfg)`) and how many times each is trained
    on (`passes(cfg)`)."""

    trainer: type
    arguments: Callable[[RLHFConfig, torch.dtype, bool], Any]
    metrics: dict[str, str]
    trainer_options: Callable[[RLHFConfig], dict[str, Any]] = lambda cfg: {}
    mini_batches: Callable[[RLHFConfig], int] = lambda cfg: 1
    passes: Callable[[RLHFConfig], int] = lambda cfg: 1
    extra_rewards: Callable[[RLHFConfig], list[Reward]] = lambda cfg: []  # scored besides --reward-funcs'


def _completions(rows: int, cfg: RLHFConfig, mini_batches: int) -> int:
    """The completions the Trainer trains on per epoch: each prompt `num_generations` times, in
    generation batches of whole groups (TRL's sampler leaves out the prompts that fill none)."""
    prompts_per_batch = max(1, cfg.batch_size * cfg.grad_accum * mini_batches // cfg.num_generations)
    return rows // prompts_per_batch * prompts_per_batch * cfg.num_generations


def run(cfg: RLHFConfig, method: Method | None = None) -> Path:
    """`tigon rlhf --method grpo` (or another `method` on its machinery) for a resolved `cfg`;
    returns the final model's (or adapter's) directory."""
    method = method or GRPO
    resume_from = start(cfg)
    extra = method.extra_rewards(cfg)
    rewards = [] if extra and not cfg.reward_funcs else load_rewards(cfg.reward_funcs, cfg.format_regex,
                                                                      cfg.max_completion_length)
    rewards += extra
    items = load_prompts(cfg.dataset or [str(BUNDLED_PROMPTS)], cfg.seed)
    eval_items: list[PromptRow] = []
    if cfg.eval_dataset:
        eval_items = load_prompts(cfg.eval_dataset, cfg.seed)
    elif cfg.eval_split:
        items, eval_items = split_off(items, cfg.eval_split, cfg.seed)
    builtin = cfg.model is None
    tokenizer = builtin_tokenizer() if builtin else load_tokenizer(cfg.model)
    ensure_chat_template(tokenizer)
    rows, lengths = prompt_rows(tokenizer, items, cfg.max_length, "training data")
    eval_rows = prompt_rows(tokenizer, eval_items, cfg.max_length, "evaluation data")[0] if eval_items else None
    trial = rows[:2]
    check_rewards(rewards, trial, *_trial_completions(tokenizer, trial))
    log.info("tokens: %d training prompts, %d prompt tokens, %d completions of up to %d tokens each", len(rows),
             sum(lengths), cfg.num_generations, cfg.max_completion_length)
    log.info("rewards: %s", ", ".join(r.spec for r in rewards))
    if builtin:  # everything is checked: the sft stage may write now
        cfg = dataclasses.replace(cfg, model=str(builtin_after_sft(cfg, tokenizer)))
        from transformers import set_seed

        set_seed(cfg.seed)
    from datasets import Dataset

    train_data = Dataset.from_list(rows)
    eval_data = Dataset.from_list(eval_rows) if eval_rows else None

    def trainer(built: Built, args: Any) -> TigonGRPOTrainer:
        return method.trainer(model=built.model, reward_funcs=[r.fn for r in rewards], args=args,
                              train_dataset=train_data, eval_dataset=eval_data, processing_class=tokenizer,
                              save_limit=cfg.save_limit, patch_reference=frozen_patcher(cfg, "the frozen reference"),
                              **method.trainer_options(cfg))

    def flops(model: torch.nn.Module, seq_len: float) -> float:
        # Per trained token: the policy's step, its sampling (a forward per token, counted as one
        # pass over the sequence) and, with beta, the reference's forward.
        forwards = 1 + (1 if cfg.beta else 0)
        return flops_per_token(model, seq_len) + forwards * flops_per_token(model, seq_len, backward=False)

    completions = _completions(len(rows), cfg, method.mini_batches(cfg))
    mean_prompt = sum(lengths) / len(lengths)
    metrics = {**method.metrics, **{f"rewards/{r.name}/mean": "" for r in rewards}}
    job = Job("rlhf", train_data, round((mean_prompt + cfg.max_completion_length) * completions), completions,
              arguments=lambda dtype: method.arguments(cfg, dtype, eval_data is not None), trainer=trainer,
              prompts=lambda: [row["prompt"] for row in rows[:cfg.samples]], metrics=metrics, flops=flops,
              samples=completions * method.passes(cfg))
    return train(cfg, resume_from, tokenizer, job)


def reward_model_rewards(cfg: RLHFConfig) -> list[Reward]:
    """--reward-model's scores as a reward function (:func:`tigon.train.reward.model_reward`), if given."""
    from tigon.train.reward import model_reward

    return [model_reward(cfg.reward_model)] if cfg.reward_model else []


GRPO = Method(TigonGRPOTrainer, trl_arguments, METRICS, extra_rewards=reward_model_rewards)
