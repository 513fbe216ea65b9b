"""Loss modules over tigon.functional: cross-entropy, and the fused LM head + cross-entropy."""

from __future__ import annotations

import torch

from tigon import functional as F
from tigon.ops import LossOptions, check_loss_options


class CrossEntropyLoss(torch.nn.Module):
    """``torch.nn.CrossEntropyLoss`` for class indices, with the class dim last, plus z-loss and
    logit softcapping (see :func:`tigon.functional.cross_entropy`). No class weights."""

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        z_loss_scale: float = 0.0,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.options = LossOptions(ignore_index, label_smoothing, z_loss_scale, softcap)
        check_loss_options(self.options, reduction)
        self.reduction = reduction

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target, reduction=self.reduction, **self.options._asdict())

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, {_options_repr(self.options)}"


class LinearCrossEntropyLoss(torch.nn.Module):
    """The loss of a linear layer's output, ``cross_entropy(hidden @ weight.T + bias, target)``,
    computed without materialising the logits (see :func:`tigon.functional.linear_cross_entropy`).

    It holds no parameters: pass the LM head's weight (and bias) to :meth:`forward`.
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
    ) -> None:
        super().__init__()
        self.options = LossOptions(ignore_index, label_smoothing, z_loss_scale, softcap)
        check_loss_options(self.options, reduction)
        self.reduction = reduction
        self.max_chunk_bytes = max_chunk_bytes

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        return F.linear_cross_entropy(
            hidden, weight, target, bias,
            reduction=self.reduction,
            num_items_in_batch=num_items_in_batch,
            max_chunk_bytes=self.max_chunk_bytes,
            **self.options._asdict(),
        )

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, {_options_repr(self.options)}, max_chunk_bytes={self.max_chunk_bytes!r}"


def _options_repr(options: LossOptions) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in options._asdict().items())
