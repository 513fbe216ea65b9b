"""The forwards tigon puts in place of a vision tower's own: its MLPs that are not gated.

A ViT, SigLIP or CLIP block's MLP is ``fc2(gelu(fc1(x)))``; as one
:func:`tigon.functional.gelu_mlp` it keeps fc1's output for backward and forms the activation
again there, instead of keeping both. (The towers' norms, gated MLPs and 2-D rotary run on the
forwards the decoders' use.)
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tigon import functional as F
from tigon.patch.families import MLP
from tigon.patch.modules import has_hooks, module_activation, plain_linear

# gelu_mlp's `approximate` for the GELUs module_activation names.
_APPROXIMATIONS = {"gelu": "none", "gelu_tanh": "tanh"}


def gelu_approximation(act: torch.nn.Module) -> str | None:
    """:func:`tigon.functional.gelu_mlp`'s `approximate` for the activation module `act` (exact
    GELU, its tanh form, QuickGELU: ``"sigmoid"``), or None for any other activation or one with
    hooks."""
    if has_hooks(act):
        return None
    approximate = _APPROXIMATIONS.get(module_activation(act) or "")
    if approximate is not None:
        return approximate
    from transformers.activations import ACT2CLS

    return "sigmoid" if type(act) is ACT2CLS.get("quick_gelu") else None


def gelu_mlp_forward(mlp: MLP, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Forward for a vision tower's MLP `mlp` (switch ``gelu_mlp``): one
    :func:`tigon.functional.gelu_mlp` where both linears are plain and the activation is a GELU
    the kernel computes; `original` otherwise (LoRA on the tower, another activation)."""

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        approximate = None if args or kwargs else gelu_approximation(getattr(self, mlp.act))
        fc1, fc2 = (getattr(self, name) for name in mlp.projections)
        if approximate is None or not (plain_linear(fc1) and plain_linear(fc2)):
            return original(self, hidden_states, *args, **kwargs)
        return F.gelu_mlp(hidden_states, fc1.weight, fc2.weight, fc1.bias, fc2.bias, approximate=approximate)

    forward.__qualname__ = f"tigon_{mlp.cls}.forward"
    return forward
