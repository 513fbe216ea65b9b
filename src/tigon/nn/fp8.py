"""A frozen linear layer on an FP8 (e4m3) weight: the base of LoRA on FP8 (``tigon sft --quant fp8``)."""

from __future__ import annotations

import torch
from torch import nn

from tigon import functional as F
from tigon.ops import Fp8Weight, dequantize_fp8, quantize_weight


class Fp8Linear(nn.Linear):
    """``y = x Wᵀ + b`` with W frozen in e4m3 and fp32 scales per block (:class:`tigon.ops.Fp8Weight`).

    The parameters are named as Hugging Face's FP8 checkpoints name them (``weight`` in
    float8_e4m3fn, ``weight_scale_inv``: the multiplier of each ``block_size`` block), so such a
    checkpoint's tensors load into it as they are. Neither trains. An nn.Linear subclass, so that
    PEFT puts LoRA adapters on it; PEFT takes the adapters' dtype from `compute_dtype` and a
    dequantised weight (DoRA's norm, on its own path) from :meth:`dequantize` through `W_q`, the
    attribute by which it recognises a quantised base with that method.

    Args:
        in_features, out_features: the shape, as nn.Linear.
        bias: whether there is a (trainable-dtype, `compute_dtype`) bias.
        block_size: ``(rows, cols)`` of a scale's block; default ``(1, in_features)``: one scale per
            output row (what the FP8 GEMMs take).
        compute_dtype: the dtype of the inputs, outputs and bias.
        device: where the (uninitialised) tensors are made.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 block_size: tuple[int, int] | None = None, compute_dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate and initialise a full-precision weight
        self.in_features, self.out_features = in_features, out_features
        self.block_size = tuple(block_size) if block_size is not None else (1, in_features)
        self.compute_dtype = compute_dtype
        blocks = (-(-out_features // self.block_size[0]), -(-in_features // self.block_size[1]))
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(blocks, dtype=torch.float32, device=device),
                                             requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=compute_dtype, device=device))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        """`linear`'s weight quantised to e4m3 per output row (:func:`tigon.ops.quantize_weight`), on
        its device; its bias kept as it is."""
        weight = quantize_weight(linear.weight.detach())
        module = cls(linear.in_features, linear.out_features, linear.bias is not None,
                     compute_dtype=linear.weight.dtype, device="meta")
        module.weight = nn.Parameter(weight.data, requires_grad=False)
        module.weight_scale_inv = nn.Parameter(weight.scale, requires_grad=False)
        if linear.bias is not None:
            module.bias = linear.bias
        return module

    def fp8_weight(self) -> Fp8Weight:
        """The weight as tigon's ops take it."""
        return Fp8Weight(self.weight, self.weight_scale_inv, self.block_size)

    @torch.no_grad()
    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight in `dtype` (default `compute_dtype`): each payload times its block's scale."""
        return dequantize_fp8(self.fp8_weight(), dtype or self.compute_dtype)

    @property
    def W_q(self) -> torch.Tensor:  # noqa: N802 (PEFT's name)
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.fp8_linear(x, self.fp8_weight(), self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", block_size={self.block_size}"


def quantize_linears(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace every nn.Linear of `model` (but those whose name ends in one of `skip`) by an
    :class:`Fp8Linear` of its weight, in place, on the linear's device. Returns how many."""
    replaced = 0
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or name.split(".")[-1] in skip:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, Fp8Linear.from_linear(module))
        replaced += 1
    return replaced
