"""`tigon rlhf --method dpo|ipo|kto|orpo|simpo|cpo`: preference training on TRL's trainers, the loss
computed by tigon's fused `linear_preference_loss` from the policy's last hidden states and the LM
head's weight, so that no (tokens x vocab) logits exist in forward or backward.

The run is `tigon sft`'s (`tigon.train.run`): the same settings, model stage (LoRA or full, dtype,
tigon's kernels), output directory, checkpoints, --resume, Ctrl-C, progress and final/. What
differs is the data (`tigon.train.preference`) and the Trainer: TRL's `DPOTrainer` for the paired
methods, `KTOTrainer` for KTO, each with its reference handling, metrics (under TRL's names) and
evaluation kept and its loss replaced:

    policy     the model called with a flag that makes it return its backbone's last hidden
               states (through the model's own call, so PEFT, DDP and autocast still wrap it)
    reference  the same call with the LoRA adapter switched off (LoRA), on a frozen copy of the
               initial weights (full fine-tuning), or per-sequence log-prob sums scored once
               before training (--precompute-ref-log-probs, also with `linear_log_probs`);
               SimPO, CPO and ORPO have none
    loss       `linear_preference_loss(hidden, head.weight, target, ...)`: chosen sequences first,
               then their rejected ones (KTO: its answers, their labels and the KL baseline)

With no --model the policy is the built-in tiny Llama after `tigon sft` (demo-out/final from `make
demo` when it is there and is that model, else an sft stage run first into OUTPUT_DIR/sft), and
with no --dataset the bundled preference pairs (right answers chosen, wrong ones rejected).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Any, Iterator

import torch
from accelerate.utils import is_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer
from trl.trainer.dpo_trainer import DataCollatorForPreference
from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference
from transformers import set_seed
from transformers.modeling_outputs import CausalLMOutput

import tigon.functional as TF
from tigon.train import grpo, preference
from tigon.train.batching import NUM_TOKENS
from tigon.train.builtin import builtin_after_sft, builtin_tokenizer
from tigon.train.callbacks import ACCURACY, MARGIN
from tigon.train.config import REFERENCE_METHODS, RLHFConfig, SFTError, resolve_rlhf
from tigon.train.fused import FusedTrainer, checkpointing_off
from tigon.train.modeling import flops_per_token, load_tokenizer
from tigon.train.run import Built, Job, guarded, split_off, start, train, training_arguments
from tigon.train.template import ensure_chat_template
from tigon.train.trainer import TigonTrainer

log = logging.getLogger("tigon.train")

BUNDLED_PREFERENCES = Path(__file__).parent / "data" / "preferences.jsonl"

# The paired methods' metrics, TRL's names; the progress bar shows those with a label.
PAIRED_METRICS = {MARGIN: "margin", ACCURACY: "acc", "rewards/chosen": "", "rewards/rejected": "",
                  "logps/chosen": "", "logps/rejected": "", "nll_loss": "", "logits/chosen": "", "logits/rejected": "",
                  "log_odds_ratio": "", "log_odds_chosen": ""}  # the last two: orpo's
KTO_METRICS = {MARGIN: "margin", "kl": "kl", "rewards/chosen": "", "rewards/rejected": "", "logps/chosen": "",
               "logps/rejected": "", "nll_loss": "", "logits/chosen": "", "logits/rejected": ""}
# TRL's DPOConfig spells the two methods it runs of ours so; the others are scored by tigon alone.
_TRL_LOSS_TYPE = {"ipo": "ipo"}


# --- the policy's hidden states -----------------------------------------------------------------

def _targets(input_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """The token each position predicts (the next one), -100 where it is not an answer's."""
    return input_ids.masked_fill(completion_mask == 0, -100)[:, 1:]


# A batch's keys that are not the model's inputs (TRL's collators' and tigon's).
_NOT_INPUTS = ("input_ids", "attention_mask", "completion_mask", "ref_chosen_logps", "ref_rejected_logps", "ref_logps",
               "ref_KL_logps", "label")


def media(inputs: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A batch's model inputs beside its tokens: a vision-language model's pixels, image grids and
    token types (TRL's vision collators'; none for text). For KTO's KL sequences (`prefix`
    ``KL_``): their own token types, with their prompts' images."""
    own = {k: v for k, v in inputs.items() if not k.startswith("KL_") and k not in _NOT_INPUTS}
    if prefix:
        own.update({k[len(prefix):]: v for k, v in inputs.items()
                    if k.startswith(prefix) and k[len(prefix):] not in _NOT_INPUTS})
    return own


def _up_to_answer_end(completion_mask: torch.Tensor) -> torch.Tensor:
    """1 on every token up to each row's last answer token (prompt and answer), 0 on the padding
    after it: TRL's ORPO labels, whether or not the batch kept its attention mask."""
    return completion_mask.flip(1).cummax(1).values.flip(1)


class _FusedPreference(FusedTrainer):
    """What both preference trainers share: the hidden states of the policy and of its reference,
    and KTO's reward margin from its chosen and rejected rewards."""

    _adapter_layers: list[BaseTunerLayer] | None = None  # the PEFT policy's adapter layers, found once

    def __init__(self, *, method: str, loss: dict[str, Any], nll_on_prompt: bool = False, **kwargs: Any):
        self.method = method  # tigon rlhf's --method
        self.loss_options = loss  # linear_preference_loss's method (dpo's: its --loss-type) and constants
        self.nll_on_prompt = nll_on_prompt  # the chosen NLL over prompt and answer (TRL's ORPO)
        super().__init__(**kwargs)

    def _reference_model(self) -> torch.nn.Module:
        return self.ref_model if self.ref_model is not None else self.model

    @contextlib.contextmanager
    def _as_reference(self, model: torch.nn.Module) -> Iterator[None]:
        """`model` scoring as the reference: a PEFT policy with its adapter switched off.

        Layer by layer, as PEFT's ``disable_adapter()`` does it, but over the adapter layers found
        once: PEFT's context manager first walks every module for the model's adapter status (tens
        of milliseconds of host time per step, for a 16-layer 1B Llama), which a LoRA
        step, bound by its host, pays in full."""
        unwrapped = self.accelerator.unwrap_model(model)
        with torch.no_grad():
            if self.ref_model is None and is_peft_model(unwrapped):
                if self._adapter_layers is None:
                    self._adapter_layers = [m for m in unwrapped.modules() if isinstance(m, BaseTunerLayer)]
                enabled = [layer for layer in self._adapter_layers if not layer.disable_adapters]
                for layer in enabled:
                    layer.enable_adapters(False)
                try:
                    yield
                finally:
                    for layer in enabled:
                        layer.enable_adapters(True)
            else:
                yield

    def _reference_states(self, model: torch.nn.Module, input_ids: torch.Tensor,
                          attention_mask: torch.Tensor | None, **inputs: Any) -> dict[str, torch.Tensor | None]:
        """The reference's hidden states and head, as linear_preference_loss takes them."""
        with self._as_reference(model):
            hidden = self._hidden(model, input_ids, attention_mask, **inputs)
        weight, bias = self._head(model)
        return {"ref_hidden": hidden.to(weight.dtype), "ref_weight": weight.detach(),
                "ref_bias": None if bias is None else bias.detach()}

    def _log_prob_sums(self, states: dict[str, torch.Tensor | None], target: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return TF.linear_log_probs(states["ref_hidden"], states["ref_weight"], target, states["ref_bias"]).sum(-1)

    def _add_logits_means(self, mode: str, m: dict[str, torch.Tensor]) -> None:
        self._add(mode, "logits/chosen", m["chosen_logits_mean"], 1)
        self._add(mode, "logits/rejected", m["rejected_logits_mean"], 1)

    def _averages(self, mode: str) -> dict[str, float]:
        values = super()._averages(mode)
        if MARGIN not in values and "rewards/chosen" in values and "rewards/rejected" in values:
            values[MARGIN] = values["rewards/chosen"] - values["rewards/rejected"]  # KTO's
        return values

    def _returned(self, loss: torch.Tensor, return_outputs: bool) -> Any:
        # tigon passes no compute_metrics, so evaluation asks for the loss alone; the logits that
        # TRL's metrics would take are the very thing never built.
        return (loss, CausalLMOutput(loss=loss)) if return_outputs else loss


class TigonDPOTrainer(_FusedPreference, TigonTrainer, DPOTrainer):
    """TRL's DPOTrainer scoring its loss with `linear_preference_loss`, for the paired methods
    (dpo, ipo, simpo, cpo, orpo), on rows tokenized by `tigon.train.preference`, with tigon's
    checkpoints and step loop (`TigonTrainer`). A full fine-tune by a method without a reference
    (simpo, cpo, orpo) runs with ``precompute_ref_log_probs`` set, which keeps TRL from loading a
    reference model, and precomputes nothing (TRL hashes the weights once, for its cache key)."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset  # tokenized already

    def _precompute_ref_logps(self, dataset, name, batch_size):
        if self.method not in REFERENCE_METHODS:
            return dataset
        return super()._precompute_ref_logps(dataset, name, batch_size)

    def compute_ref_log_probs(self, model, inputs):
        states = self._reference_states(model, inputs["input_ids"], inputs.get("attention_mask"), **media(inputs))
        return self._log_prob_sums(states, _targets(inputs["input_ids"], inputs["completion_mask"])).chunk(2)

    def _compute_loss(self, model, inputs, return_outputs):
        mode = "train" if self.model.training else "eval"
        input_ids, attention_mask = inputs["input_ids"], inputs.get("attention_mask")
        target = _targets(input_ids, inputs["completion_mask"])
        weight, bias = self._head(model)
        hidden = self._hidden(model, input_ids, attention_mask, **media(inputs)).to(weight.dtype)
        reference: dict[str, Any] = {}
        if self.method in REFERENCE_METHODS:
            if self.precompute_ref_logps:
                reference["ref_log_probs"] = torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]])
            else:
                reference = self._reference_states(self._reference_model(), input_ids, attention_mask, **media(inputs))
        if self.nll_on_prompt:
            pairs = target.shape[0] // 2
            reference["nll_target"] = _targets(input_ids[:pairs], _up_to_answer_end(inputs["completion_mask"][:pairs]))
        loss, m = TF.linear_preference_loss(hidden, weight, target, bias, **self.loss_options, **reference)
        pairs = target.shape[0] // 2
        for key, values in (("rewards/chosen", m["chosen_rewards"]), ("rewards/rejected", m["rejected_rewards"]),
                            (MARGIN, m["margin"]), (ACCURACY, m["accuracy"]), ("logps/chosen", m["chosen_logps"]),
                            ("logps/rejected", m["rejected_logps"])):
            self._add(mode, key, values.sum(), pairs)
        if "log_odds_ratio" in m:  # TRL's ORPO names: the mean log sig(log odds) and the mean log odds
            self._add(mode, "log_odds_ratio", torch.nn.functional.logsigmoid(m["log_odds_ratio"]).sum(), pairs)
            self._add(mode, "log_odds_chosen", m["log_odds_ratio"].sum(), pairs)
        self._add_logits_means(mode, m)
        self._add(mode, "nll_loss", m["chosen_nll"], 1)
        return self._returned(loss, return_outputs)


def kl_answers(answers: list[Any], batch_size: int) -> list[Any]:
    """KTO's KL sequences' answers: each answer goes to the next prompt of its batch (the last to
    the first), batch by batch as the sequential sampler will read them."""
    moved: list[Any] = []
    for start in range(0, len(answers), batch_size):
        batch = answers[start:start + batch_size]
        moved += batch[-1:] + batch[:-1]
    return moved


class TigonKTOTrainer(_FusedPreference, TigonTrainer, KTOTrainer):
    """TRL's KTOTrainer scoring its loss with `linear_preference_loss` (method kto). The KL
    baseline is TRL's: the policy's and the reference's log-prob sums of each prompt with the
    answer of the previous row of its batch, averaged over the batch (and the processes) and
    floored at 0, without gradient."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        # Rows with images (tigon.train.vision_rlhf) are tokenized by TRL's vision collator, which
        # pairs each prompt with the next row's answer itself.
        if not self.calculate_KL or "completion_ids" not in getattr(dataset, "column_names", ()):
            return dataset
        return dataset.add_column("KL_completion_ids", kl_answers(list(dataset["completion_ids"]),
                                                                  args.per_device_train_batch_size))

    def _kl_inputs(self, inputs: dict[str, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, dict[str, Any]]:
        ids = inputs["KL_input_ids"]
        return ids, inputs.get("KL_attention_mask"), _targets(ids, inputs["KL_completion_mask"]), media(inputs, "KL_")

    def compute_ref_log_probs(self, model, inputs):
        states = self._reference_states(model, inputs["input_ids"], inputs.get("attention_mask"), **media(inputs))
        logps = self._log_prob_sums(states, _targets(inputs["input_ids"], inputs["completion_mask"]))
        if not self.calculate_KL:
            return logps, None
        kl_ids, kl_mask, kl_target, kl_media = self._kl_inputs(inputs)
        return logps, self._log_prob_sums(self._reference_states(model, kl_ids, kl_mask, **kl_media), kl_target)

    def _compute_loss(self, model, inputs, return_outputs):
        mode = "train" if self.model.training else "eval"
        input_ids, attention_mask = inputs["input_ids"], inputs.get("attention_mask")
        target = _targets(input_ids, inputs["completion_mask"])
        labels = inputs["label"].bool()
        weight, bias = self._head(model)
        reference: dict[str, Any] = {}
        if self.precompute_ref_logps:
            reference["ref_log_probs"] = inputs["ref_logps"]
        else:
            reference = self._reference_states(self._reference_model(), input_ids, attention_mask, **media(inputs))
        kl = None
        if self.calculate_KL:
            kl_ids, kl_mask, kl_target, kl_media = self._kl_inputs(inputs)
            with torch.no_grad():
                policy = TF.linear_log_probs(self._hidden(model, kl_ids, kl_mask, **kl_media).to(weight.dtype), weight,
                                             kl_target, bias).sum(-1)
            if self.precompute_ref_logps:
                ref = inputs["ref_KL_logps"]
            else:
                ref = self._log_prob_sums(self._reference_states(self._reference_model(), kl_ids, kl_mask, **kl_media),
                                          kl_target)
            ratios = policy - ref
            if self.loss_options.get("average_log_probs"):  # the baseline on the answers' own scale
                ratios = ratios / (kl_target != -100).sum(-1).clamp(min=1)
            kl = ratios.mean()
            if self.accelerator.num_processes > 1:
                kl = self.accelerator.reduce(kl, "mean")
            kl = kl.clamp(min=0)
        hidden = self._hidden(model, input_ids, attention_mask, **media(inputs)).to(weight.dtype)
        loss, m = TF.linear_preference_loss(hidden, weight, target, bias, labels=labels,
                                            kl_baseline=kl if kl is not None else 0.0, **self.loss_options,
                                            **reference)
        desirable = labels.float()
        for name, values in (("rewards", m["rewards"]), ("logps", m["logps"])):
            self._add(mode, f"{name}/chosen", (values * desirable).sum(), desirable.sum())
            self._add(mode, f"{name}/rejected", (values * (1 - desirable)).sum(), (1 - desirable).sum())
        self._add(mode, "kl", m["kl"], 1)
        self._add_logits_means(mode, m)
        self._add(mode, "nll_loss", m["chosen_nll"], 1)
        return self._returned(loss, return_outputs)


class PreferenceCollator:
    """TRL's collator for the method, less the attention masks of unpadded sequences (as sft's
    collator: without one the model runs plain causal attention and skips checking an all-ones
    mask on the device, which waits for it), and the batch's token count on the host
    (`NUM_TOKENS`) for the progress bar's tokens/s.

    `widths` (``--cuda-graphs``) pads every batch to one shape: the sequences to ``widths[""]``
    tokens, KTO's KL sequences to ``widths["KL_"]``, so that each step replays the same graphs,
    and drops every attention mask. TRL pads on the right, after each sequence's last token, which
    causal attention never lets a real token see, and the completion masks leave it unscored; a
    mask would make the captured step build and apply the full causal mask, several times slower
    (`tigon.train.batching.Collator` does the same for sft)."""

    _PADDED = ("input_ids", "completion_mask")

    def __init__(self, pad_token_id: int, kto: bool, widths: dict[str, int] | None = None):
        self.collate = (DataCollatorForUnpairedPreference if kto else DataCollatorForPreference)(pad_token_id)
        self.pad_token_id = pad_token_id
        self.widths = widths

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collate(features)
        if self.widths is None:
            for key in ("attention_mask", "KL_attention_mask"):
                if key in batch and bool(batch[key].all()):  # a host tensor: no device to wait for
                    del batch[key]
        else:
            for prefix, width in self.widths.items():
                batch.pop(prefix + "attention_mask", None)
                for key in (prefix + name for name in self._PADDED):
                    if key in batch:
                        batch[key] = self._padded(batch[key], width, key)
        batch[NUM_TOKENS] = sum(preference.sequence_tokens(f)[0] for f in features)
        return batch

    def _padded(self, rows: torch.Tensor, width: int, key: str) -> torch.Tensor:
        if rows.shape[1] > width:
            raise ValueError(f"{key}: a row of {rows.shape[1]} tokens does not fit the collator's width {width}")
        value = self.pad_token_id if key.endswith("input_ids") else 0
        return torch.nn.functional.pad(rows, (0, width - rows.shape[1]), value=value)


# --- the run ------------------------------------------------------------------------------------

def loss_options(cfg: RLHFConfig) -> dict[str, Any]:
    """`linear_preference_loss`'s keywords for the run's method (dpo's: its loss type's)."""
    method = cfg.loss_type if cfg.method == "dpo" and cfg.loss_type != "sigmoid" else cfg.method
    options: dict[str, Any] = {"method": method, "beta": cfg.beta, "nll_weight": cfg.nll_weight}
    if cfg.label_smoothing:
        options["label_smoothing"] = cfg.label_smoothing
    if cfg.average_log_probs:
        options["average_log_probs"] = True
    if method == "discopop":
        options["tau"] = cfg.discopop_tau
    if cfg.method == "simpo":
        options["gamma"] = cfg.simpo_gamma
    if cfg.method == "kto":
        options.update(desirable_weight=cfg.desirable_weight, undesirable_weight=cfg.undesirable_weight)
    return options


def trl_arguments(cfg: RLHFConfig, dtype: torch.dtype, has_eval: bool) -> Any:
    """TRL's DPOConfig (KTOConfig for kto) for `cfg`: tigon's Trainer arguments and the method's own."""
    kto = cfg.method == "kto"
    cls = KTOConfig if kto else DPOConfig
    extra: dict[str, Any] = {
        "beta": cfg.beta, **checkpointing_off(cls),
        "max_length": None, "pad_to_multiple_of": None,  # tigon's data stage truncates; the collator pads
        # A full fine-tune with no reference method: set, it keeps TRL from loading a reference.
        "precompute_ref_log_probs": cfg.precompute_ref_log_probs or (cfg.method not in REFERENCE_METHODS
                                                                     and cfg.tuner == "full"),
    }
    if kto:
        extra.update(desirable_weight=cfg.desirable_weight, undesirable_weight=cfg.undesirable_weight)
    else:
        extra.update(loss_type=[_TRL_LOSS_TYPE.get(cfg.method, "sigmoid")], label_smoothing=cfg.label_smoothing)
    return training_arguments(cfg, dtype, has_eval, cls=cls, **extra)


def graph_widths(cfg: RLHFConfig, datasets: list[list[dict[str, Any]]]) -> dict[str, int]:
    """The collator's widths under --cuda-graphs (:class:`PreferenceCollator`): --max-length, which
    every prompt + answer fits, and for KTO the longest of its KL sequences (a prompt with another
    row's answer), said in the log."""
    widths = {"": cfg.max_length}
    if cfg.method == "kto":
        widths["KL_"] = max(len(row["prompt_ids"]) + len(answer) for rows in datasets if rows
                            for row, answer in zip(rows, kl_answers([r["completion_ids"] for r in rows],
                                                                    cfg.batch_size)))
    log.info("--cuda-graphs: every sequence padded to %d tokens%s (one shape for every batch)", cfg.max_length,
             f", every KL sequence to {widths['KL_']}" if "KL_" in widths else "")
    return widths


def _dataset(rows: list[dict[str, Any]]) -> Any:
    from datasets import Dataset

    return Dataset.from_list(rows)


def run_rlhf(cfg: RLHFConfig, given: set[str] = frozenset()) -> Path:
    """Preference-train as `cfg` says; returns the directory of the final model (or adapter).
    Raises `Interrupted` when stopped by Ctrl-C or SIGTERM (during training, after saving a checkpoint)."""
    return guarded(cfg, lambda: _run(resolve_rlhf(cfg, given)))


def load_split(cfg: RLHFConfig) -> tuple[list[Any], list[Any]]:
    """The preference rows to train on (the bundled pairs by default) and those to evaluate on
    (--eval-dataset, or held out by --eval-split; none by default)."""
    items = preference.load_preferences(cfg.dataset or [str(BUNDLED_PREFERENCES)], cfg.seed, cfg.method)
    if cfg.eval_dataset:
        return items, preference.load_preferences(cfg.eval_dataset, cfg.seed, cfg.method)
    if cfg.eval_split:
        return split_off(items, cfg.eval_split, cfg.seed)
    return items, []


def _run(cfg: RLHFConfig) -> Path:
    from tigon.train.vision_run import check_text_run, wants_vision

    if wants_vision(cfg):
        from tigon.train import vision_rlhf

        return vision_rlhf.run(cfg)
    check_text_run(cfg)
    if cfg.method == "grpo":
        return grpo.run(cfg)
    if cfg.method == "rm":
        from tigon.train import reward

        return reward.run(cfg)
    if cfg.method in ("ppo", "rloo"):
        from tigon.train import ppo, rloo

        return (ppo if cfg.method == "ppo" else rloo).run(cfg)
    if cfg.method == "gkd":
        try:  # TRL's experimental package, imported only for this method
            from tigon.train import gkd
        except ImportError as err:
            raise SFTError(f"--method gkd runs on TRL's GKDTrainer (trl.experimental.gkd), which this TRL lacks: "
                           f"{err}") from None
        return gkd.run(cfg)
    resume_from = start(cfg)
    items, eval_items = load_split(cfg)
    builtin = cfg.model is None
    tokenizer = builtin_tokenizer() if builtin else load_tokenizer(cfg.model)
    ensure_chat_template(tokenizer)

    def rows(of: list[Any], what: str) -> list[dict[str, Any]]:
        encoded = preference.encode_all(tokenizer, of, cfg.max_length, cfg.max_prompt_length, what)
        return preference.shuffled(encoded, cfg.seed) if cfg.method == "kto" else encoded

    train_rows = rows(items, "training data")
    eval_rows = rows(eval_items, "evaluation data") if eval_items else None
    tokens, sequences = (sum(c) for c in zip(*map(preference.sequence_tokens, train_rows)))
    log.info("tokens: %d training %s, %d tokens, max length %d", len(train_rows),
             "answers" if cfg.method == "kto" else "pairs", tokens, cfg.max_length)
    if builtin:  # everything is checked: the sft stage may write now
        cfg = dataclasses.replace(cfg, model=str(builtin_after_sft(cfg, tokenizer)))
        set_seed(cfg.seed)  # as a run that found the sft stage done (its LoRA adapter starts the same)

    train_data, eval_data = _dataset(train_rows), (_dataset(eval_rows) if eval_rows else None)
    kto = cfg.method == "kto"
    reference = cfg.method in REFERENCE_METHODS and not cfg.precompute_ref_log_probs

    widths = graph_widths(cfg, [train_rows, eval_rows or []]) if cfg.cuda_graphs else None

    def trainer(built: Built, args: Any) -> Any:
        cls = TigonKTOTrainer if kto else TigonDPOTrainer
        return cls(model=built.model, ref_model=built.reference, args=args, train_dataset=train_data,
                   eval_dataset=eval_data, processing_class=tokenizer,
                   data_collator=PreferenceCollator(tokenizer.pad_token_id, kto, widths), save_limit=cfg.save_limit,
                   method=cfg.method, loss=loss_options(cfg), nll_on_prompt=cfg.nll_on_prompt,
                   cuda_graphs=cfg.cuda_graphs)

    def flops(model: torch.nn.Module, seq_len: float) -> float:
        # Per trained token: the policy's training step, plus the forwards without gradient that
        # come with it: the reference's, and for KTO both models' on the KL sequences.
        forwards = (1 if reference else 0) + (2 if kto else 0)
        return flops_per_token(model, seq_len) + forwards * flops_per_token(model, seq_len, backward=False)

    job = Job("rlhf", train_data, tokens, sequences,
              arguments=lambda dtype: trl_arguments(cfg, dtype, eval_data is not None), trainer=trainer,
              prompts=lambda: preference.pick_prompts(tokenizer, items, cfg.samples, cfg.max_length,
                                                      cfg.max_prompt_length),
              reference=reference and cfg.tuner == "full", metrics=KTO_METRICS if kto else PAIRED_METRICS,
              flops=flops)
    return train(cfg, resume_from, tokenizer, job)
