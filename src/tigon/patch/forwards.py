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
from tigon.patch.families import Layer, Norm


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
