"""Loss modules over tigon.functional: cross-entropy, and the fused LM head + cross-entropy."""

from __future__ import annotations

import torch

from tigon import functional as F
from tigon.ops import LossOptions, LossOutput, check_flags, check_loss_options


def _check_class_weight(name: str, weight: torch.Tensor | None) -> None:
    # The class count is known at the first call (the op checks it there); the kind of tensor now.
    if weight is not None and (not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 1):
        raise ValueError(f"{name} must be None or a 1-D float tensor of class weights, got {weight!r}")


class CrossEntropyLoss(torch.nn.Module):
    """``torch.nn.CrossEntropyLoss`` for class indices, with the class dim last, plus z-loss, logit
    softcapping, token scaling and the argmax/accuracy and z-loss outputs (see
    :func:`tigon.functional.cross_entropy`). Class weights `weight` are a buffer, as torch's."""

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        z_loss_scale: float = 0.0,
        softcap: float | None = None,
        weight: torch.Tensor | None = None,
        token_scaling: bool = False,
        return_z_loss: bool = False,
        return_argmax: bool = False,
    ) -> None:
        super().__init__()
        self.options = LossOptions(ignore_index, label_smoothing, z_loss_scale, softcap, token_scaling)
        check_loss_options(self.options, reduction)
        check_flags(return_z_loss=return_z_loss, return_argmax=return_argmax)
        _check_class_weight("weight", weight)
        self.reduction = reduction
        self.outputs = dict(return_z_loss=return_z_loss, return_argmax=return_argmax)
        self.register_buffer("weight", weight)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor | LossOutput:
        return F.cross_entropy(
            logits, target, reduction=self.reduction, weight=self.weight, **self.options._asdict(), **self.outputs
        )

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, {_options_repr(self.options)}, {_outputs_repr(self.outputs)}"


class LinearCrossEntropyLoss(torch.nn.Module):
    """The loss of a linear layer's output, ``cross_entropy(hidden @ weight.T + bias, target)``,
    computed without materialising the logits (see :func:`tigon.functional.linear_cross_entropy`).

    It holds no parameters: pass the LM head's weight (and bias) to :meth:`forward`. Class
    weights are `class_weight` (a buffer): `weight` is the LM head's.
    """

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        z_loss_scale: float = 0.0,
        softcap: float | None = None,
        max_chunk_bytes: int | None = None,
        class_weight: torch.Tensor | None = None,
        token_scaling: bool = False,
        return_z_loss: bool = False,
        return_argmax: bool = False,
        fp32_weight_grad: bool = False,
    ) -> None:
        super().__init__()
        self.options = LossOptions(ignore_index, label_smoothing, z_loss_scale, softcap, token_scaling)
        check_loss_options(self.options, reduction)
        check_flags(return_z_loss=return_z_loss, return_argmax=return_argmax, fp32_weight_grad=fp32_weight_grad)
        _check_class_weight("class_weight", class_weight)
        self.reduction = reduction
        self.max_chunk_bytes = max_chunk_bytes
        self.outputs = dict(return_z_loss=return_z_loss, return_argmax=return_argmax)
        self.fp32_weight_grad = fp32_weight_grad
        self.register_buffer("class_weight", class_weight)

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor | LossOutput:
        return F.linear_cross_entropy(
            hidden, weight, target, bias,
            reduction=self.reduction,
            num_items_in_batch=num_items_in_batch,
            max_chunk_bytes=self.max_chunk_bytes,
            class_weight=self.class_weight,
            fp32_weight_grad=self.fp32_weight_grad,
            **self.options._asdict(),
            **self.outputs,
        )

    def extra_repr(self) -> str:
        return (
            f"reduction={self.reduction!r}, {_options_repr(self.options)}, max_chunk_bytes={self.max_chunk_bytes!r}, "
            f"{_outputs_repr(self.outputs)}, fp32_weight_grad={self.fp32_weight_grad!r}"
        )


def _options_repr(options: LossOptions) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in options._asdict().items())


def _outputs_repr(outputs: dict) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in outputs.items())
