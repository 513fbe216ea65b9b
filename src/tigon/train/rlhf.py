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
import functools
import logging
import types
from pathlib import Path
from typing import Any, Iterator

import torch
from accelerate.utils import is_peft_model
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer
from trl.trainer.dpo_trainer import DataCollatorForPreference
from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference
from transformers import set_seed
from transformers.modeling_outputs import CausalLMOutput

import tigon.functional as TF
from tigon.train import preference, tiny
from tigon.train.batching import NUM_TOKENS
from tigon.train.callbacks import ACCURACY, MARGIN
from tigon.train.config import REFERENCE_METHODS, RLHFConfig, SFTConfig, SFTError, resolve_rlhf
from tigon.train.data import load_samples
from tigon.train.modeling import flops_per_token, load_tokenizer
from tigon.train.run import FINAL_DIR, Built, Job, guarded, run_sft, split_off, start, train, training_arguments
from tigon.train.template import ensure_chat_template
from tigon.train.trainer import TigonTrainer

log = logging.getLogger("tigon.train")

BUNDLED_PREFERENCES = Path(__file__).parent / "data" / "preferences.jsonl"
DEMO_SFT = Path("demo-out") / FINAL_DIR  # where `make demo` leaves the built-in model after sft
SFT_DIR = "sft"  # the embedded default's sft stage, inside the output directory
SFT_STAGE_STEPS = -1  # the sft stage's --max-steps (-1: its epochs); tests shorten it

# The paired methods' metrics, TRL's names; the progress bar shows those with a label.
PAIRED_METRICS = {MARGIN: "margin", ACCURACY: "acc", "rewards/chosen": "", "rewards/rejected": "",
                  "logps/chosen": "", "logps/rejected": "", "nll_loss": ""}
KTO_METRICS = {MARGIN: "margin", "kl": "kl", "rewards/chosen": "", "rewards/rejected": "", "logps/chosen": "",
               "logps/rejected": "", "nll_loss": ""}
# TRL's DPOConfig spells the two methods it runs of ours so; the others are scored by tigon alone.
_TRL_LOSS_TYPE = {"ipo": "ipo"}


# --- the policy's hidden states -----------------------------------------------------------------

HIDDEN = "tigon_last_hidden_state"  # the keyword that makes a model return its last hidden states
_NOT_FOR_THE_BACKBONE = ("labels", "return_dict", "output_attentions", "output_hidden_states", "use_cache")


def add_hidden_output(model: torch.nn.Module) -> None:
    """Make `model` (a causal LM, or a PEFT model around one) return its backbone's last hidden
    states, ``(batch, tokens, hidden)``, when called with ``HIDDEN=True``, and nothing else: no
    LM head, no logits. Otherwise its forward is what it was. The flag passes through the call of
    every wrapper (PEFT, DDP, accelerate's autocast), which the backbone called directly would skip."""
    causal = model.get_base_model() if is_peft_model(model) else model
    if getattr(causal, "_tigon_hidden_output", False):
        return
    forward = causal.forward

    # The class's signature, which `generate` checks its keywords against.
    @functools.wraps(type(causal).forward)
    def hidden_or_forward(self, *args, **kwargs):
        if not kwargs.pop(HIDDEN, False):
            return forward(*args, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if v is not None and k not in _NOT_FOR_THE_BACKBONE}
        return self.base_model(*args, use_cache=False, **kwargs).last_hidden_state

    causal.forward = types.MethodType(hidden_or_forward, causal)
    causal._tigon_hidden_output = True


def _targets(input_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """The token each position predicts (the next one), -100 where it is not an answer's."""
    return input_ids.masked_fill(completion_mask == 0, -100)[:, 1:]


class _FusedPreference:
    """What both trainers share: the hidden states of the policy and of its reference, the LM
    head, and TRL's metrics accumulated as device tensors, read back once per log."""

    def __init__(self, *, loss: dict[str, Any], **kwargs: Any):
        self.loss_options = loss  # linear_preference_loss's method and constants
        self._sums: dict[str, dict[str, list[torch.Tensor]]] = {"train": {}, "eval": {}}
        for model in (kwargs["model"], kwargs.get("ref_model")):
            if model is not None:
                add_hidden_output(model)
        super().__init__(**kwargs)
        # Given a PEFT model, TRL keeps a copy of its adapter as the reference ("ref"), for an
        # adapter trained before. tigon's adapter is new (its B is zero): the model with the
        # adapter switched off is the same reference, without running LoRA in its forward.
        if is_peft_model(self.model) and "ref" in self.model.peft_config:
            self.model.delete_adapter("ref")

    @property
    def method(self) -> str:
        return self.loss_options["method"]

    def _hidden(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
                ) -> torch.Tensor:
        """The model's last hidden states at the positions that predict a next token."""
        return model(input_ids=input_ids, attention_mask=attention_mask, **{HIDDEN: True})[:, :-1]

    def _head(self, model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        return head.weight, head.bias

    def _reference_model(self) -> torch.nn.Module:
        return self.ref_model if self.ref_model is not None else self.model

    @contextlib.contextmanager
    def _as_reference(self, model: torch.nn.Module) -> Iterator[None]:
        """`model` scoring as the reference: a PEFT policy with its adapter switched off."""
        unwrapped = self.accelerator.unwrap_model(model)
        with torch.no_grad():
            if self.ref_model is None and is_peft_model(unwrapped):
                with unwrapped.disable_adapter():
                    yield
            else:
                yield

    def _reference_states(self, model: torch.nn.Module, input_ids: torch.Tensor,
                          attention_mask: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
        """The reference's hidden states and head, as linear_preference_loss takes them."""
        with self._as_reference(model):
            hidden = self._hidden(model, input_ids, attention_mask)
        weight, bias = self._head(model)
        return {"ref_hidden": hidden.to(weight.dtype), "ref_weight": weight.detach(),
                "ref_bias": None if bias is None else bias.detach()}

    def _log_prob_sums(self, states: dict[str, torch.Tensor | None], target: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return TF.linear_log_probs(states["ref_hidden"], states["ref_weight"], target, states["ref_bias"]).sum(-1)

    def _add(self, mode: str, key: str, total: torch.Tensor, count: torch.Tensor | float) -> None:
        """Accumulate `total` over `count` items for the next log (no host sync: a count given
        as a number becomes a device tensor by a fill, not a copy)."""
        total = total.detach().float()
        if not isinstance(count, torch.Tensor):
            count = total.new_full((), float(count))
        self._sums[mode].setdefault(key, []).append(torch.stack([total, count.float()]))

    def _averages(self, mode: str) -> dict[str, float]:
        """The accumulated metrics' means over their items (and over the processes)."""
        store = self._sums[mode]
        if not store:
            return {}
        keys = list(store)
        totals = torch.stack([torch.stack(store[k]).sum(0) for k in keys])
        if self.accelerator.num_processes > 1:
            totals = self.accelerator.reduce(totals, "sum")
        store.clear()
        values = {k: s / c for k, (s, c) in zip(keys, totals.tolist()) if c > 0}
        if MARGIN not in values and "rewards/chosen" in values and "rewards/rejected" in values:
            values[MARGIN] = values["rewards/chosen"] - values["rewards/rejected"]  # KTO's
        return values

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        for key, value in self._averages(mode).items():
            self._metrics[mode][key] = [value]
        super().log(logs, start_time)

    def _returned(self, loss: torch.Tensor, return_outputs: bool) -> Any:
        # tigon passes no compute_metrics, so evaluation asks for the loss alone; the logits that
        # TRL's metrics would take are the very thing never built.
        return (loss, CausalLMOutput(loss=loss)) if return_outputs else loss

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        """None: TRL writes one (README.md) into the output directory at each checkpoint."""

    def _send_telemetry(self) -> None:
        """None: TRL's trainers report their use to the Hugging Face hub; a tigon run makes no
        network call of its own."""


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
        states = self._reference_states(model, inputs["input_ids"], inputs.get("attention_mask"))
        return self._log_prob_sums(states, _targets(inputs["input_ids"], inputs["completion_mask"])).chunk(2)

    def _compute_loss(self, model, inputs, return_outputs):
        mode = "train" if self.model.training else "eval"
        input_ids, attention_mask = inputs["input_ids"], inputs.get("attention_mask")
        target = _targets(input_ids, inputs["completion_mask"])
        weight, bias = self._head(model)
        hidden = self._hidden(model, input_ids, attention_mask).to(weight.dtype)
        reference: dict[str, Any] = {}
        if self.method in REFERENCE_METHODS:
            if self.precompute_ref_logps:
                reference["ref_log_probs"] = torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]])
            else:
                reference = self._reference_states(self._reference_model(), input_ids, attention_mask)
        loss, m = TF.linear_preference_loss(hidden, weight, target, bias, **self.loss_options, **reference)
        pairs = target.shape[0] // 2
        for key, values in (("rewards/chosen", m["chosen_rewards"]), ("rewards/rejected", m["rejected_rewards"]),
                            (MARGIN, m["margin"]), (ACCURACY, m["accuracy"]), ("logps/chosen", m["chosen_logps"]),
                            ("logps/rejected", m["rejected_logps"])):
            self._add(mode, key, values.sum(), pairs)
        self._add(mode, "nll_loss", m["chosen_nll"], 1)
        return self._returned(loss, return_outputs)


class TigonKTOTrainer(_FusedPreference, TigonTrainer, KTOTrainer):
    """TRL's KTOTrainer scoring its loss with `linear_preference_loss` (method kto). The KL
    baseline is TRL's: the policy's and the reference's log-prob sums of each prompt with the
    answer of the previous row of its batch, averaged over the batch (and the processes) and
    floored at 0, without gradient."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if not self.calculate_KL:
            return dataset
        # Each answer goes to the next prompt of its batch (the last to the first), batch by batch
        # as the sequential sampler will read them.
        size, answers = args.per_device_train_batch_size, list(dataset["completion_ids"])
        mismatched = []
        for start in range(0, len(answers), size):
            batch = answers[start:start + size]
            mismatched += batch[-1:] + batch[:-1]
        return dataset.add_column("KL_completion_ids", mismatched)

    def _kl_inputs(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        ids = inputs["KL_input_ids"]
        return ids, inputs.get("KL_attention_mask"), _targets(ids, inputs["KL_completion_mask"])

    def compute_ref_log_probs(self, model, inputs):
        states = self._reference_states(model, inputs["input_ids"], inputs.get("attention_mask"))
        logps = self._log_prob_sums(states, _targets(inputs["input_ids"], inputs["completion_mask"]))
        if not self.calculate_KL:
            return logps, None
        kl_ids, kl_mask, kl_target = self._kl_inputs(inputs)
        return logps, self._log_prob_sums(self._reference_states(model, kl_ids, kl_mask), kl_target)

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
            reference = self._reference_states(self._reference_model(), input_ids, attention_mask)
        kl = None
        if self.calculate_KL:
            kl_ids, kl_mask, kl_target = self._kl_inputs(inputs)
            with torch.no_grad():
                policy = TF.linear_log_probs(self._hidden(model, kl_ids, kl_mask).to(weight.dtype), weight, kl_target,
                                             bias).sum(-1)
            if self.precompute_ref_logps:
                ref = inputs["ref_KL_logps"]
            else:
                ref = self._log_prob_sums(self._reference_states(self._reference_model(), kl_ids, kl_mask), kl_target)
            kl = (policy - ref).mean()
            if self.accelerator.num_processes > 1:
                kl = self.accelerator.reduce(kl, "mean")
            kl = kl.clamp(min=0)
        hidden = self._hidden(model, input_ids, attention_mask).to(weight.dtype)
        loss, m = TF.linear_preference_loss(hidden, weight, target, bias, labels=labels,
                                            kl_baseline=kl if kl is not None else 0.0, **self.loss_options,
                                            **reference)
        desirable = labels.float()
        for name, values in (("rewards", m["rewards"]), ("logps", m["logps"])):
            self._add(mode, f"{name}/chosen", (values * desirable).sum(), desirable.sum())
            self._add(mode, f"{name}/rejected", (values * (1 - desirable)).sum(), (1 - desirable).sum())
        self._add(mode, "kl", m["kl"], 1)
        self._add(mode, "nll_loss", m["chosen_nll"], 1)
        return self._returned(loss, return_outputs)


class PreferenceCollator:
    """TRL's collator for the method, less the attention masks of unpadded sequences (as sft's
    collator: without one the model runs plain causal attention and skips checking an all-ones
    mask on the device, which waits for it), and the batch's token count on the host
    (`NUM_TOKENS`) for the progress bar's tokens/s."""

    def __init__(self, pad_token_id: int, kto: bool):
        self.collate = (DataCollatorForUnpairedPreference if kto else DataCollatorForPreference)(pad_token_id)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collate(features)
        for key in ("attention_mask", "KL_attention_mask"):
            if key in batch and bool(batch[key].all()):  # a host tensor: no device to wait for
                del batch[key]
        batch[NUM_TOKENS] = sum(preference.sequence_tokens(f)[0] for f in features)
        return batch


# --- the run ------------------------------------------------------------------------------------

def loss_options(cfg: RLHFConfig) -> dict[str, Any]:
    """`linear_preference_loss`'s keywords for the run's method."""
    options: dict[str, Any] = {"method": cfg.method, "beta": cfg.beta, "nll_weight": cfg.nll_weight}
    if cfg.method in ("dpo", "simpo", "cpo"):
        options["label_smoothing"] = cfg.label_smoothing
    if cfg.method == "simpo":
        options["gamma"] = cfg.simpo_gamma
    if cfg.method == "kto":
        options.update(desirable_weight=cfg.desirable_weight, undesirable_weight=cfg.undesirable_weight)
    return options


def _arguments(cfg: RLHFConfig, dtype: torch.dtype, has_eval: bool) -> Any:
    kto = cfg.method == "kto"
    cls = KTOConfig if kto else DPOConfig
    # build_model has set up checkpointing as asked; TRL's default turns it on, under the name
    # that transformers >= 5.2x warns is deprecated when it is the only one given.
    checkpointing = next(name for name in ("activation_checkpointing", "gradient_checkpointing")
                         if name in {f.name for f in dataclasses.fields(cls)})
    extra: dict[str, Any] = {
        "beta": cfg.beta, checkpointing: False,
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


def _dataset(rows: list[dict[str, Any]]) -> Any:
    from datasets import Dataset

    return Dataset.from_list(rows)


def _builtin_tokenizer() -> Any:
    """The built-in model's tokenizer, as its sft stage trains it (on the bundled instructions)."""
    tokenizer = tiny.build_tokenizer(load_samples([str(tiny.BUNDLED_DATASET)], seed=0))
    ensure_chat_template(tokenizer)
    return tokenizer


def _is_builtin_sft(path: Path, tokenizer: Any) -> bool:
    """Whether `path` holds the built-in model (its shape, its tokenizer) as `tigon sft` saved it."""
    from transformers import AutoConfig, AutoTokenizer

    if not (path / "model.safetensors").is_file() or (path / "adapter_config.json").exists():
        return False
    try:
        config, saved = AutoConfig.from_pretrained(str(path)), AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError):
        return False
    shape = tiny.build_model(tokenizer, 0, num_hidden_layers=1).config
    keys = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
    return all(getattr(config, k, None) == getattr(shape, k) for k in keys) and saved.get_vocab() == tokenizer.get_vocab()


def builtin_policy(cfg: RLHFConfig, tokenizer: Any) -> Path:
    """The built-in model after sft: this run's own sft stage (OUTPUT_DIR/sft/final) when it has
    one, so that a resumed run keeps its reference; else `make demo`'s demo-out/final when that
    is the built-in model; else the sft stage, trained first (resumed with --resume, trained
    again with --overwrite)."""
    stage = Path(cfg.output_dir) / SFT_DIR
    if not cfg.overwrite and (stage / FINAL_DIR).is_dir():
        log.info("policy: the built-in model after sft, from %s", stage / FINAL_DIR)
        return (stage / FINAL_DIR).resolve()
    if _is_builtin_sft(DEMO_SFT, tokenizer):
        log.info("policy: the built-in model after sft, from %s (make demo)", DEMO_SFT)
        return DEMO_SFT.resolve()
    log.info("policy: the built-in model, fine-tuned first on the bundled instructions by tigon sft into %s", stage)
    sft = SFTConfig(output_dir=str(stage), seed=cfg.seed, kernels=cfg.kernels, kernels_off=cfg.kernels_off,
                    max_steps=SFT_STAGE_STEPS, samples=0, resume="latest" if cfg.resume else None,
                    overwrite=cfg.overwrite)
    return run_sft(sft).resolve()


def run_rlhf(cfg: RLHFConfig, given: set[str] = frozenset()) -> Path:
    """Preference-train as `cfg` says; returns the directory of the final model (or adapter).
    Raises `Interrupted` when stopped by Ctrl-C or SIGTERM (during training, after saving a checkpoint)."""
    return guarded(cfg, lambda: _run(resolve_rlhf(cfg, given)))


def _run(cfg: RLHFConfig) -> Path:
    resume_from = start(cfg)
    items = preference.load_preferences(cfg.dataset or [str(BUNDLED_PREFERENCES)], cfg.seed, cfg.method)
    eval_items: list[Any] = []
    if cfg.eval_dataset:
        eval_items = preference.load_preferences(cfg.eval_dataset, cfg.seed, cfg.method)
    elif cfg.eval_split:
        items, eval_items = split_off(items, cfg.eval_split, cfg.seed)
    builtin = cfg.model is None
    tokenizer = _builtin_tokenizer() if builtin else load_tokenizer(cfg.model)
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
        cfg = dataclasses.replace(cfg, model=str(builtin_policy(cfg, tokenizer)))
        set_seed(cfg.seed)  # as a run that found the sft stage done (its LoRA adapter starts the same)

    train_data, eval_data = _dataset(train_rows), (_dataset(eval_rows) if eval_rows else None)
    kto = cfg.method == "kto"
    reference = cfg.method in REFERENCE_METHODS and not cfg.precompute_ref_log_probs

    def trainer(built: Built, args: Any) -> Any:
        cls = TigonKTOTrainer if kto else TigonDPOTrainer
        return cls(model=built.model, ref_model=built.reference, args=args, train_dataset=train_data,
                   eval_dataset=eval_data, processing_class=tokenizer,
                   data_collator=PreferenceCollator(tokenizer.pad_token_id, kto), save_limit=cfg.save_limit,
                   loss=loss_options(cfg))

    def flops(model: torch.nn.Module, seq_len: float) -> float:
        # Per trained token: the policy's training step, plus the forwards without gradient that
        # come with it: the reference's, and for KTO both models' on the KL sequences.
        forwards = (1 if reference else 0) + (2 if kto else 0)
        return flops_per_token(model, seq_len) + forwards * flops_per_token(model, seq_len, backward=False)

    job = Job("rlhf", train_data, tokens, sequences,
              arguments=lambda dtype: _arguments(cfg, dtype, eval_data is not None), trainer=trainer,
              prompts=lambda: preference.pick_prompts(tokenizer, items, cfg.samples, cfg.max_length,
                                                      cfg.max_prompt_length),
              reference=reference and cfg.tuner == "full", metrics=KTO_METRICS if kto else PAIRED_METRICS,
              flops=flops)
    return train(cfg, resume_from, tokenizer, job)
