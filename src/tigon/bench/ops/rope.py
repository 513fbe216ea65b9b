"""Benchmark cases for rope (the headline shape first: batch 8, 32 query and 8 KV heads, 2048
tokens, head dim 128). q and k are laid out as Hugging Face attention passes them: (B, T, H, D)
projections viewed as (B, H, T, D)."""

from __future__ import annotations

import torch

import tigon.functional as F
from tigon.bench.registry import BenchOp, liger, register


def _rope_inputs(size, dtype, device):
    batch, q_heads, k_heads, tokens, head_dim = size

    def heads(n):
        x = torch.randn(batch, tokens, n, head_dim, dtype=dtype, device=device)
        return x.transpose(1, 2).requires_grad_()

    positions = torch.arange(tokens, device=device, dtype=torch.float32).expand(batch, tokens)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return heads(q_heads), heads(k_heads), emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _eager_rope(q, k, cos, sin):
    # transformers' apply_rotary_pos_emb (Llama), written out so the bench does not import transformers.
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rope_bytes(size, dtype):
    batch, q_heads, k_heads, tokens, head_dim = size
    qk = batch * (q_heads + k_heads) * tokens * head_dim
    cos_sin = 2 * batch * tokens * head_dim
    # fwd: read q, k, cos, sin, write both outputs; bwd: the same with the outputs' gradients.
    return (4 * qk + 2 * cos_sin) * dtype.itemsize


register(BenchOp(
    name="rope",
    make_inputs=_rope_inputs,
    tigon=F.rope,
    eager=_eager_rope,
    bytes_moved=_rope_bytes,
    sizes=[
        (8, 32, 8, 2048, 128),
        (8, 32, 32, 2048, 128),
        (4, 32, 8, 4096, 128),
        (8, 32, 32, 2048, 80),
        (16, 16, 16, 2048, 64),
        (1, 32, 8, 32768, 128),
    ],
    cpu_sizes=[(2, 4, 2, 128, 64)],
    size_names="batch x q_heads x kv_heads x tokens x head_dim",
    peer=liger("liger_rope"),
))
