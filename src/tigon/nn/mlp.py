"""Gated MLP modules with the state dicts of Hugging Face's LlamaMLP / GemmaMLP.

In training they save, per layer, the MLP input, `gate` and `up` only: the down projection's input
``act(gate) * up`` is recomputed in backward (:func:`tigon.functional.glu_mlp`).
"""

from __future__ import annotations

from typing import Any

import torch

from tigon import functional as F
from tigon.nn.activations import ACTIVATIONS, config_activation_name, glu, glu_kind

SWIGLU_ACTS = {name: act for name, act in ACTIVATIONS.items() if glu_kind(act) == "swiglu"}
GEGLU_ACTS = {name: act for name, act in ACTIVATIONS.items() if glu_kind(act) == "geglu"}


def glu_activation(config: Any) -> str:
    """The glu_mlp activation for an HF config; ValueError if tigon has no kernel for it."""
    name = config_activation_name(config)
    if name not in ACTIVATIONS:
        raise ValueError(
            f"hidden_act must be one of {', '.join(map(repr, ACTIVATIONS))} for tigon's gated MLP, "
            f"got {name!r}"
        )
    return ACTIVATIONS[name]


class _GatedMLP(torch.nn.Module):
    ACTS: dict[str, str] = {}

    def __init__(self, config: Any, intermediate_size: int | None = None) -> None:
        super().__init__()
        name = config_activation_name(config)
        if name not in self.ACTS:
            other = "GeGLUMLP" if name in GEGLU_ACTS else "SwiGLUMLP" if name in SWIGLU_ACTS else None
            raise ValueError(
                f"{type(self).__name__} needs hidden_act in {', '.join(map(repr, self.ACTS))}, got {name!r}"
                + (f"; use tigon.nn.{other}" if other else "")
            )
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = intermediate_size or config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = torch.nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.up_proj = torch.nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.down_proj = torch.nn.Linear(self.intermediate_size, self.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Reads only what HF's MLP modules also have (config and the three projections), so it can
        # be bound to a live LlamaMLP / GemmaMLP.
        activation = glu_activation(self.config)
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        if all(type(p) is torch.nn.Linear for p in projections):
            gate, up, down = projections
            return F.glu_mlp(
                x, gate.weight, up.weight, down.weight, gate.bias, up.bias, down.bias, activation=activation
            )
        # Wrapped projections (PEFT LoRA, quantised layers) keep their own forwards.
        return self.down_proj(glu(activation, self.gate_proj(x), self.up_proj(x)))


class SwiGLUMLP(_GatedMLP):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``: replaces LlamaMLP (and the Mistral, Qwen,
    ... copies of it) with the same state dict.

    Built from an HF config: `hidden_size`, `intermediate_size` (or the `intermediate_size`
    argument, as MoE experts pass it), `hidden_act` ("silu") and `mlp_bias` when present.
    """

    ACTS = SWIGLU_ACTS


class GeGLUMLP(_GatedMLP):
    """``down_proj(gelu(gate_proj(x)) * up_proj(x))``: replaces GemmaMLP (gelu_pytorch_tanh), with
    the same state dict; `hidden_activation` (Gemma 2/3) or `hidden_act` picks the GELU form."""

    ACTS = GEGLU_ACTS
