"""A causal LM's last hidden states through the model's own call: what tigon's fused losses (the
preference, policy and distillation losses) take instead of the logits.

Making a model return them rebinds its forward, which only the patch floor does:
:func:`tigon.patch.add_hidden_output` (undone by :func:`tigon.unpatch`), re-exported here.
"""

from __future__ import annotations

import torch

from tigon.patch.apply import HIDDEN, add_hidden_output

__all__ = ["HIDDEN", "add_hidden_output", "head_of"]


def head_of(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head's (weight, bias) of `model` (unwrapped, or PEFT's)."""
    head = model.get_output_embeddings()
    return head.weight, head.bias
