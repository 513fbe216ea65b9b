"""A causal LM's last hidden states through the model's own call: what tigon's fused losses (the
preference, policy and distillation losses) take instead of the logits."""

from __future__ import annotations

import functools
import types

import torch
from accelerate.utils import is_peft_model

from tigon.patch.forwards import run_decoder

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
        return run_decoder(self.base_model, *args, use_cache=False, **kwargs).last_hidden_state

    causal.forward = types.MethodType(hidden_or_forward, causal)
    causal._tigon_hidden_output = True


def head_of(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head's (weight, bias) of `model` (unwrapped, or PEFT's)."""
    head = model.get_output_embeddings()
    return head.weight, head.bias
