"""bitsandbytes' quantised linears in the terms of tigon's dequantisation (:class:`tigon.ops.QuantizedWeight`),
and tigon's FP8 linears (:class:`tigon.nn.Fp8Linear`, an :class:`tigon.ops.Fp8Weight`).

A PEFT LoRA layer on a bitsandbytes base (``peft.tuners.lora.bnb.Linear4bit`` / ``Linear8bitLt``,
what ``from_pretrained(..., quantization_config=BitsAndBytesConfig(...))`` and PEFT make) runs
tigon's fused LoRA ops with the base read through :func:`module_weight`; anything bitsandbytes
computes differently stays on PEFT's path (:func:`why_not`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from tigon.nn import Fp8Linear
from tigon.ops import Fp8Weight, QuantizedWeight


def from_4bit(data: torch.Tensor, quant_state: Any) -> QuantizedWeight:
    """A QuantizedWeight of bitsandbytes' packed 4-bit `data` and its ``QuantState``."""
    nested = quant_state.nested
    state2 = quant_state.state2
    return QuantizedWeight(
        data=data,
        absmax=quant_state.absmax,
        shape=tuple(quant_state.shape),
        code=quant_state.code,
        blocksize=quant_state.blocksize,
        scale_code=state2.code if nested else None,
        scale_absmax=state2.absmax if nested else None,
        offset=quant_state.offset if nested else None,
        scale_blocksize=state2.blocksize if nested else 256,
    )


def from_int8(data: torch.Tensor, row_absmax: torch.Tensor) -> QuantizedWeight:
    """A QuantizedWeight of an LLM.int8 matrix (``CB``) and its per-row absmax (``SCB``)."""
    return QuantizedWeight(data=data, absmax=row_absmax, shape=tuple(data.shape))


def _bnb_linears() -> tuple[type, type] | None:
    """bitsandbytes' Linear4bit and Linear8bitLt, when bitsandbytes is imported."""
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return None
    return bnb.nn.Linear4bit, bnb.nn.Linear8bitLt


def is_quantized_linear(module: torch.nn.Module) -> bool:
    """Whether `module` is a bitsandbytes 4-bit or 8-bit linear or tigon's FP8 one (exactly those classes)."""
    if type(module) is Fp8Linear:
        return True
    classes = _bnb_linears()
    return classes is not None and type(module) in classes


def why_not(module: torch.nn.Module) -> str | None:
    """Why the fused path cannot read this quantised linear's weight as it is (None if it can)."""
    if type(module) is Fp8Linear:
        return None
    linear4, linear8 = _bnb_linears()
    weight = module.weight
    if type(module) is linear4:
        state = getattr(weight, "quant_state", None)
        if state is None or state.shape is None or len(state.shape) != 2:
            return "4-bit base not quantised yet"
        if getattr(state, "packing_format_for_cpu", False):
            return "4-bit base repacked for bitsandbytes' CPU inference kernel"
        if state.quant_type not in ("nf4", "fp4") or state.code is None or state.code.numel() != 16:
            return f"4-bit base of type {state.quant_type!r}"
        if state.nested and state.state2.blocksize != 256:
            return "4-bit base with a nested blocksize other than 256"
        return None
    row_absmax = getattr(weight, "SCB", None)
    if module.state.has_fp16_weights or weight.dtype != torch.int8 or row_absmax is None:
        return "8-bit base holding fp16 weights (has_fp16_weights)"
    return None


def module_weight(module: torch.nn.Module) -> QuantizedWeight | Fp8Weight:
    """The weight of a quantised linear for which :func:`why_not` is None."""
    if type(module) is Fp8Linear:
        return module.fp8_weight()
    weight = module.weight
    if hasattr(weight, "quant_state"):
        return from_4bit(weight.data, weight.quant_state)
    return from_int8(weight.data, weight.SCB)


def kind(module: torch.nn.Module) -> str:
    """``"nf4"``, ``"fp4"``, ``"int8"`` or ``"fp8"``."""
    if type(module) is Fp8Linear:
        return "fp8"
    state = getattr(module.weight, "quant_state", None)
    return "int8" if state is None else state.quant_type
