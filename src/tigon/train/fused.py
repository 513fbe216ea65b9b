"""What tigon's trainers with a fused loss share (the TRL ones of `tigon rlhf`, and `tigon
distill`'s): the models' last hidden states and LM heads that the loss takes instead of logits (its
metrics go through `TigonTrainer`'s device-side sums)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from accelerate.utils import is_peft_model

from tigon.train.heads import HIDDEN, add_hidden_output
from tigon.train.modeling import kernel_switches


def checkpointing_off(config_class: type) -> dict[str, bool]:
    """The keyword that leaves gradient checkpointing off in a TRL config (the model stage has
    set it up as asked; TRL's default turns it on), under the name transformers >= 5.2x warns is
    deprecated when it is the only one given."""
    names = {f.name for f in dataclasses.fields(config_class)}
    return {next(name for name in ("activation_checkpointing", "gradient_checkpointing") if name in names): False}


def frozen_patcher(cfg: Any, whose: str) -> Callable[[torch.nn.Module], Any] | None:
    """What patches a frozen model the trainer scores with (GRPO's reference, GKD's teacher:
    `whose`, named in the patch's line) as the policy was patched (None: --no-kernels), less the
    causal LM's loss: such a model's forward runs either TRL's fused LM head (which
    `trl_log_probs` runs on tigon's op) or, for the hidden states, its backbone alone."""
    if not cfg.kernels:
        return None
    import tigon

    switches = {**kernel_switches(cfg.kernels_off), "linear_cross_entropy": False, "cross_entropy": False}

    return lambda model: tigon.patch(model, role=whose, **switches)


class FusedTrainer:
    """Mixed in before a Trainer: `models` are the keyword arguments naming the models whose
    hidden states the loss reads (made to return them, :func:`~tigon.train.heads.add_hidden_output`)."""

    _HIDDEN_MODELS: tuple[str, ...] = ("model", "ref_model")

    def __init__(self, **kwargs: Any):
        for name in self._HIDDEN_MODELS:
            if isinstance(kwargs.get(name), torch.nn.Module):
                add_hidden_output(kwargs[name])
        super().__init__(**kwargs)
        # Given a PEFT model, TRL keeps a copy of its adapter as the reference ("ref"), for an
        # adapter trained before. tigon's adapter is new (its B is zero): the model with the
        # adapter switched off is the same reference, without running LoRA in its forward.
        if is_peft_model(self.model) and "ref" in self.model.peft_config:
            self.model.delete_adapter("ref")

    def _hidden(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                **kwargs: Any) -> torch.Tensor:
        """The model's last hidden states at the positions that predict a next token."""
        return model(input_ids=input_ids, attention_mask=attention_mask, **kwargs, **{HIDDEN: True})[:, :-1]

    def _head(self, model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        return head.weight, head.bias

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        """None: TRL writes one (README.md) into the output directory at each checkpoint."""

    def _send_telemetry(self) -> None:
        """None: TRL's trainers report their use to the Hugging Face hub; a tigon run makes no
        network call of its own."""
