"""The forwards tigon puts in place of a vision tower's own: its MLPs that are not gated, and the
patch embedding and attention of the Qwen-VL and GLM-4V towers.

A ViT, SigLIP or CLIP block's MLP is ``fc2(gelu(fc1(x)))``; as one
:func:`tigon.functional.gelu_mlp` it keeps fc1's output for backward and forms the activation
again there, instead of keeping both. (The towers' norms, gated MLPs and 2-D rotary run on the
forwards the decoders' use.)

A Qwen-VL tower embeds patches the processor has already cut and flattened with a Conv3d whose
kernel is the whole patch and whose stride is that kernel: each output is one dot product of a
flattened patch with a flattened filter, a GEMM, but it reaches cuDNN as a 3-D convolution, whose
kernels for this shape (their weight gradient above all) can be far slower than that GEMM, by
cuDNN version and card.

Those towers pack every image of a batch into one sequence and give each block's attention the
images' boundaries (``cu_seqlens``) on the device. Without flash-attention each block reads the
lengths to the host to split the sequence per image, a device sync per block: the GPU drains and
waits for the host to launch the block's kernels anew, 32 times a forward. tigon's forward reads
them once per tower forward (kept in the model's relay) and gives images of one size to one
batched attention call.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

from tigon import functional as F
from tigon.patch.families import MLP
from tigon.patch.handoff import LayerPlan, live
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


def vision_attention_forward(name: str, original: Callable[..., torch.Tensor]
                             ) -> Callable[[LayerPlan], Callable[..., torch.Tensor]]:
    """What makes the forward of the vision attention class `name` (switch ``vision_attention``)
    for a plan: with SDPA, the images' lengths from the plan's relay (one host read per
    ``cu_seqlens`` tensor, not one per block) and images of one length in one batched
    ``scaled_dot_product_attention``; the rotary is the modeling module's (tigon's where patched).
    `original` for any other attention implementation, under torch.compile, with attention dropout
    or further arguments."""

    def make(plan: LayerPlan) -> Callable[..., torch.Tensor]:
        relay = plan.relay

        def forward(self: torch.nn.Module, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, max_seqlen: int | None = None,
                    **kwargs: Any) -> torch.Tensor:
            if (kwargs or position_embeddings is None or relay is None or not live()
                    or getattr(self.config, "_attn_implementation", None) != "sdpa"
                    or (self.training and getattr(self, "attention_dropout", 0.0))):
                return original(self, hidden_states, cu_seqlens=cu_seqlens, position_embeddings=position_embeddings,
                                max_seqlen=max_seqlen, **kwargs)
            tokens = hidden_states.shape[0]
            lengths = relay.segment_lengths(cu_seqlens)
            q, k, v = self.qkv(hidden_states).reshape(tokens, 3, self.num_heads, -1).unbind(1)
            rotary = sys.modules[type(self).__module__].apply_rotary_pos_emb_vision
            q, k = rotary(q, k, *position_embeddings)
            attention = torch.nn.functional.scaled_dot_product_attention
            if len(set(lengths)) == 1:  # (images, heads, length, head dim): one call
                images = [t.reshape(len(lengths), lengths[0], self.num_heads, -1).transpose(1, 2) for t in (q, k, v)]
                out = attention(*images, scale=self.scaling).transpose(1, 2)
            else:
                out = torch.cat([attention(*(t.transpose(0, 1)[None] for t in image), scale=self.scaling)[0].transpose(0, 1)
                                 for image in zip(q.split(lengths), k.split(lengths), v.split(lengths))])
            return self.proj(out.reshape(tokens, -1))

        forward.__qualname__ = f"tigon_{name}.forward"
        return forward

    return make
