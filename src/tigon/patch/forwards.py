"""The forwards and functions tigon puts in place of Hugging Face's.

Each factory returns one function per table entry and returns the *same* function for the same
entry (``lru_cache``), so patching twice installs an identical object and torch.compile sees a
stable callee. A forward reads only the attributes the HF module already has, so it can be bound
to a live module (instance patching) or set on the class (class patching) alike.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from tigon import functional as F
from tigon.patch.families import MLP, Layer, Norm, Rope


@functools.lru_cache(maxsize=None)
def rms_norm_forward(norm: Norm) -> Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]:
    """Forward for an HF RMSNorm module: its `weight` and epsilon through :func:`tigon.functional.rms_norm`."""

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(
            hidden_states, self.weight, getattr(self, norm.eps), offset=norm.offset, casting=norm.casting
        )

    forward.__qualname__ = f"tigon_{norm.cls}.forward"
    return forward


def _add_norm(norm: Norm, module: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor):
    """``(module(residual + x), residual + x)`` in one kernel; the sum is formed in the dtype
    ``residual + x`` would have, so the result is the unfused one."""
    dtype = torch.promote_types(x.dtype, residual.dtype)
    return F.add_rms_norm(
        x.to(dtype), residual.to(dtype), module.weight, getattr(module, norm.eps),
        offset=norm.offset, casting=norm.casting,
    )


@functools.lru_cache(maxsize=None)
def decoder_layer_forward(layer: Layer, norm: Norm, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Forward for an HF decoder layer with its residual add and following RMSNorm fused.

    The same module calls in the same order as `original`, so outputs, hooks and gradient
    checkpointing are unchanged. Every argument but the hidden states reaches the attention as HF
    passes it, by keyword; a positional one sends the call to `original`.
    """

    def branch(self: torch.nn.Module, out: torch.Tensor, index: int) -> torch.Tensor:
        if layer.dropout is not None:
            out = getattr(self, layer.dropout[index])(out)
        if layer.scale is not None:
            out = out * getattr(self, layer.scale)
        return out

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args:
            return original(self, hidden_states, *args, **kwargs)
        residual = hidden_states
        hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        if layer.fuse == "sandwich":
            hidden_states, residual = _add_norm(
                norm, self.pre_feedforward_layernorm, self.post_attention_layernorm(hidden_states), residual
            )
            hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        else:
            hidden_states, residual = _add_norm(
                norm, self.post_attention_layernorm, branch(self, hidden_states, 0), residual
            )
            hidden_states = self.mlp(hidden_states)
        return residual + branch(self, hidden_states, 1)

    forward.__qualname__ = f"tigon_{layer.cls}.forward"
    return forward


# The activations each GLU switch covers, as the op's activation name.
GLU_ACTIVATIONS = {"swiglu": ("silu",), "geglu": ("gelu_tanh", "gelu")}


def _activation_names() -> dict[type, str]:
    """HF activation module classes that compute exactly one of the ops' activations."""
    from transformers import activations

    return {
        activations.SiLUActivation: "silu",
        torch.nn.SiLU: "silu",
        activations.GELUTanh: "gelu_tanh",
        activations.GELUActivation: "gelu",
    }


def _glu(activation: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if activation == "silu":
        return F.swiglu(gate, up)
    return F.geglu(gate, up, approximate="tanh" if activation == "gelu_tanh" else "none")


def _plain(linear: torch.nn.Module) -> bool:
    """An nn.Linear whose weights the fused MLP may read directly: not a LoRA or quantised wrapper,
    and no hooks (accelerate's offload hooks among them) that calling it would run."""
    return (
        type(linear) is torch.nn.Linear
        and not linear._forward_hooks
        and not linear._forward_pre_hooks
        and not hasattr(linear, "_hf_hook")
    )


@functools.lru_cache(maxsize=None)
def mlp_forward(mlp: MLP, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Forward for an HF gated MLP: :func:`tigon.functional.glu_mlp` when its projections are
    plain linears (saves less for backward), else the projections' own forwards (LoRA, quantised)
    around :func:`tigon.functional.swiglu` / :func:`~tigon.functional.geglu`. A module whose
    activation is not one of `mlp.switch`'s runs `original`."""
    names = _activation_names()
    allowed = GLU_ACTIVATIONS[mlp.switch]

    def forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        activation = names.get(type(getattr(self, mlp.act)))
        if activation not in allowed:
            return original(self, x)
        down = self.down_proj
        if mlp.packed:
            gate_up = self.gate_up_proj
            if _plain(gate_up) and _plain(down):
                gate_w, up_w = gate_up.weight.chunk(2, dim=0)
                gate_b, up_b = (None, None) if gate_up.bias is None else gate_up.bias.chunk(2)
                return F.glu_mlp(x, gate_w, up_w, down.weight, gate_b, up_b, down.bias, activation=activation)
            gate, up = gate_up(x).chunk(2, dim=-1)
            return down(_glu(activation, gate, up))
        gate_proj, up_proj = self.gate_proj, self.up_proj
        if _plain(gate_proj) and _plain(up_proj) and _plain(down):
            return F.glu_mlp(
                x, gate_proj.weight, up_proj.weight, down.weight, gate_proj.bias, up_proj.bias, down.bias,
                activation=activation,
            )
        return down(_glu(activation, gate_proj(x), up_proj(x)))

    forward.__qualname__ = f"tigon_{mlp.cls}.forward"
    return forward


@functools.lru_cache(maxsize=None)
def rope_function(rope: Rope, original: Callable[..., tuple]) -> Callable[..., tuple]:
    """``apply_rotary_pos_emb`` over :func:`tigon.functional.rope` (partial rotary included);
    another `unsqueeze_dim` (a different q/k layout) runs `original`."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim != 1:
            return original(q, k, cos, sin, unsqueeze_dim)
        q_embed, k_embed = F.rope(q, k, cos, sin)
        if rope.keep_dtype:
            return q_embed.to(q.dtype), k_embed.to(k.dtype)
        return q_embed, k_embed

    apply_rotary_pos_emb.__qualname__ = f"tigon_{rope.function}"
    return apply_rotary_pos_emb
