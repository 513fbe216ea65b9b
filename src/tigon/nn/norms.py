"""Norm modules with the state dicts of the Hugging Face / torch modules they replace."""

from __future__ import annotations

import torch

from tigon import functional as F


class RMSNorm(torch.nn.Module):
    """RMSNorm with HF's layout: a `weight` parameter and a `variance_epsilon` attribute.

    ``RMSNorm(h)`` replaces LlamaRMSNorm (and the Mistral/Qwen/Phi-3 copies of it);
    ``RMSNorm(h, offset=1.0, casting="gemma")`` replaces GemmaRMSNorm, whose weight starts at zero;
    ``RMSNorm(h, elementwise_affine=False)`` is a norm without a scale (``weight`` is None), as
    ``torch.nn.RMSNorm(h, elementwise_affine=False)``.

    ``inplace_backward=True`` writes the input gradient over the output gradient's storage, saving
    one ``x``-sized buffer in backward: only for a norm whose output feeds nothing but layers
    that make their own gradient for it (linear projections), as :func:`tigon.ops.rms_norm.rms_norm`
    details. Not part of the state dict.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        offset: float = 0.0,
        casting: str = "llama",
        elementwise_affine: bool = True,
        inplace_backward: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if elementwise_affine:
            init = torch.zeros if offset else torch.ones
            self.weight = torch.nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        # Without a weight there is nothing to offset: the scale is one.
        self.offset = offset if elementwise_affine else 0.0
        self.casting = casting
        self.inplace_backward = inplace_backward

    @property
    def eps(self) -> float:
        """Alias of `variance_epsilon` (Gemma's modules call it `eps`)."""
        return self.variance_epsilon

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(
            hidden_states, self.weight, self.variance_epsilon, offset=self.offset, casting=self.casting,
            inplace_backward=self.inplace_backward,
        )

    def extra_repr(self) -> str:
        return (
            f"({self.hidden_size},), eps={self.variance_epsilon}, offset={self.offset}, "
            f"casting={self.casting!r}, elementwise_affine={self.weight is not None}"
            + (", inplace_backward=True" if self.inplace_backward else "")
        )


class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm (same arguments and state dict) over the fused kernel; the last dim only.
    ``inplace_backward=True`` is :class:`RMSNorm`'s option, under the same conditions."""

    def __init__(
        self, normalized_shape: int | tuple[int], eps: float = 1e-5, *, inplace_backward: bool = False, **kwargs
    ) -> None:
        super().__init__(normalized_shape, eps, **kwargs)
        if len(self.normalized_shape) != 1:
            raise ValueError(
                f"normalized_shape must be one dim (the last), got {tuple(self.normalized_shape)}"
            )
        self.inplace_backward = inplace_backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight, self.bias, self.eps, inplace_backward=self.inplace_backward)
