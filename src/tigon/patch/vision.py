"""The forwards tigon puts in place of a vision tower's own: its MLPs that are not gated, and the
patch embedding of the Qwen-VL and GLM-4V towers.

A ViT, SigLIP or CLIP block's MLP is ``fc2(gelu(fc1(x)))``; as one
:func:`tigon.functional.gelu_mlp` it keeps fc1's output for backward and forms the activation
again there, instead of keeping both. (The towers' norms, gated MLPs and 2-D rotary run on the
forwards the decoders' use.)

A Qwen-VL tower embeds patches the processor has already cut and flattened with a Conv3d whose
kernel is the whole patch and whose stride is that kernel: each output is one dot product of a
flattened patch with a flattened filter, a GEMM, but it reaches cuDNN as a 3-D convolution, whose
kernels for this shape (and their weight gradient above all) run many times slower than the GEMM.
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


def patch_embed_forward(name: str, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Forward for the patch-embedding class `name` (switch ``patch_embed``): ``proj``'s Conv3d as
    ``F.linear`` of the flattened patches with its flattened filters (and bias), the same sums in
    another order; `original` where ``proj`` is not a plain Conv3d of stride equal to its kernel,
    without padding, dilation or groups (PEFT's LoRA on it, a hook)."""

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        conv = self.proj
        if not (type(conv) is torch.nn.Conv3d and not has_hooks(conv) and conv.stride == conv.kernel_size
                and conv.groups == 1 and set(conv.padding) == {0} and set(conv.dilation) == {1}):
            return original(self, hidden_states)
        weight = conv.weight
        patches = hidden_states.reshape(-1, weight[0].numel()).to(weight.dtype)
        return torch.nn.functional.linear(patches, weight.reshape(weight.shape[0], -1), conv.bias)

    forward.__qualname__ = f"tigon_{name}.forward"
    return forward
