"""The gate activations of tigon's gated-MLP kernels: one table, read by name and by module.

``ACTIVATIONS`` maps each Hugging Face ``hidden_act`` name that a kernel computes exactly to the
kernel's name for it (the `activation` of :func:`tigon.functional.glu_mlp`). Everything that asks
"which activation is this?" reads it: :mod:`tigon.nn.mlp` from a config's name,
:func:`tigon.patch.modules.module_activation` from a live module's activation (the class
transformers builds for that name), for full fine-tuning and LoRA alike.
"""

from __future__ import annotations

from typing import Any

import torch

from tigon import functional as F

# Hugging Face `hidden_act` names -> the activation of tigon.functional.glu_mlp.
ACTIVATIONS = {
    "silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu",
}


def glu_kind(activation: str) -> str:
    """``"swiglu"`` for the SiLU gate, ``"geglu"`` for a GELU one (the op, and patch switch, names)."""
    return "swiglu" if activation == "silu" else "geglu"


def config_activation_name(config: Any) -> str | None:
    """The activation name of an HF config (Gemma 2/3 call it `hidden_activation`)."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)


def glu(
    activation: str, gate: torch.Tensor, up: torch.Tensor, gate_multiplier: float = 1.0, out_multiplier: float = 1.0
) -> torch.Tensor:
    """``act(gate * gate_multiplier) * up * out_multiplier`` on the GLU kernel for `activation`."""
    multipliers = {"gate_multiplier": gate_multiplier, "out_multiplier": out_multiplier}
    if activation == "silu":
        return F.swiglu(gate, up, **multipliers)
    return F.geglu(gate, up, approximate="tanh" if activation == "gelu_tanh" else "none", **multipliers)
