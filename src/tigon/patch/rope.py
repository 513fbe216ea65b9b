"""The family's rotary-embedding function swapped for one over :func:`tigon.functional.rope`.

RoPE is a module-level function in transformers' modeling files, not a module: it has no per-model
home, so :mod:`tigon.patch.apply` swaps it in the family's module. The function is the same
object for the same table entry (``lru_cache``), so every patch that needs it installs an
identical one (stable for torch.compile's guards).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from tigon import functional as F
from tigon.patch.families import Rope


def _kernel_frequencies(layout: str, t: torch.Tensor) -> torch.Tensor:
    """cos or sin as the RoPE kernel reads them (``cat(f, f)``: R columns, see
    :mod:`tigon.ops.rope`) from `layout` (:attr:`Rope.cos`)."""
    if layout == "pairs":
        t = t[..., ::2]
    elif layout != "once":
        return t
    return torch.cat((t, t), dim=-1)


def _evens_then_odds(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


@functools.lru_cache(maxsize=None)
def rope_function(rope: Rope, original: Callable[..., tuple]) -> Callable[..., tuple]:
    """The family's rotary-embedding function over :func:`tigon.functional.rope` (partial rotary
    included), for each form of :class:`~tigon.patch.families.Rope`; a call it does not expect
    (another `unsqueeze_dim`, that is another q/k layout) runs `original`."""

    def rotated(q, k, cos, sin, layout=rope.cos, transposed=False):
        if transposed:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = _kernel_frequencies(layout, cos), _kernel_frequencies(layout, sin)
        q_embed, k_embed = F.rope(q, k, cos, sin, interleaved=rope.interleaved)
        if transposed:
            q_embed, k_embed = q_embed.transpose(1, 2), k_embed.transpose(1, 2)
        if rope.keep_dtype:
            return q_embed.to(q.dtype), k_embed.to(k.dtype)
        return q_embed, k_embed

    if rope.form == "complex":

        def apply_rotary_emb(xq, xk, freqs_cis):
            # Each frequency once, rotating the pairs (2i, 2i + 1).
            return rotated(xq, xk, freqs_cis.real, freqs_cis.imag, "once", rope.tokens_first)

        function = apply_rotary_emb
    elif rope.form == "vision":

        def apply_rotary_pos_emb_vision(q, k, cos, sin):
            # (patches, heads, head_dim): one sequence of patches, heads after tokens.
            if q.dim() != 3 or cos.dim() != 2:
                return original(q, k, cos, sin)
            q_embed, k_embed = rotated(q.unsqueeze(0), k.unsqueeze(0), cos.float(), sin.float(), transposed=True)
            return q_embed[0], k_embed[0]

        function = apply_rotary_pos_emb_vision
    elif rope.halves:

        def apply_rotary_pos_emb_interleave(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
            # The pairs (2i, 2i + 1) written as two halves are the halves rotated as Llama's.
            if unsqueeze_dim != 1 or cos.shape[-1] != q.shape[-1]:
                return original(q, k, cos, sin, position_ids, unsqueeze_dim)
            return F.rope(_evens_then_odds(q), _evens_then_odds(k), cos, sin)

        function = apply_rotary_pos_emb_interleave
    else:

        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            if unsqueeze_dim != 1:
                return original(q, k, cos, sin, unsqueeze_dim)
            return rotated(q, k, cos, sin)

        function = apply_rotary_pos_emb
    function.__qualname__ = f"tigon_{rope.function}"
    return function
