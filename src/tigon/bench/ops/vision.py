"""Benchmark cases for the vision-language kernels: M-RoPE (the headline shape first: Qwen2.5-VL-7B,
batch 4 x 2304 tokens, 28 query and 4 KV heads of 128, ``mrope_section`` [16, 24, 24]), the
vision towers' rotary embedding, and their GELU MLP. q and k are laid out as Hugging Face
attention passes them."""

from __future__ import annotations

import torch

import tigon.functional as F
from tigon.bench.registry import BenchOp, register

QWEN2_5_VL_SECTION = (16, 24, 24)
QWEN3_VL_SECTION = (24, 20, 20)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _position_ids(batch, tokens, device):
    """(3, batch, tokens): text positions, with a 16 x 16 image grid at the start of each sample."""
    positions = torch.arange(tokens, device=device).expand(3, batch, tokens).clone()
    image = min(256, tokens)
    grid = torch.arange(image, device=device)
    positions[1, :, :image] = grid // 16
    positions[2, :, :image] = grid % 16
    positions[0, :, :image] = 0
    return positions


def _mrope_inputs(size, dtype, device):
    batch, q_heads, k_heads, tokens, head_dim = size

    def heads(n):
        return torch.randn(batch, tokens, n, head_dim, dtype=dtype, device=device).transpose(1, 2).requires_grad_()

    inv_freq = 1.0 / 1e6 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    freqs = _position_ids(batch, tokens, device)[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return heads(q_heads), heads(k_heads), emb.cos().to(dtype), emb.sin().to(dtype)


def _eager_mrope(section):
    def run(q, k, cos, sin):
        # transformers < 5's apply_multimodal_rotary_pos_emb, written out
        chunks = list(section) * 2
        cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(chunks, dim=-1))], dim=-1).unsqueeze(1)
        sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(chunks, dim=-1))], dim=-1).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    return run


def _liger_mrope(section):
    def load():
        from liger_kernel.ops.qwen2vl_mrope import LigerQwen2VLMRopeFunction

        # Liger rotates its inputs' storage in place (here the case's q and k, over and over: a
        # rotation, so they stay bounded); views keep the leaves' gradients flowing.
        return lambda q, k, cos, sin: LigerQwen2VLMRopeFunction.apply(q.view_as(q), k.view_as(k), cos, sin, list(section), 1)

    return load


def _mrope_bytes(size, dtype):
    batch, q_heads, k_heads, tokens, head_dim = size
    qk = batch * (q_heads + k_heads) * tokens * head_dim
    tables = 2 * batch * tokens * head_dim  # one column of the three tables per pair
    return (4 * qk + 2 * tables) * dtype.itemsize


def _interleaved_eager(q, k, cos, sin):
    from tigon.ops.mrope import merge_tables

    cos, sin = (merge_tables(t, QWEN3_VL_SECTION, True).unsqueeze(1) for t in (cos, sin))
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


MROPE_SIZES = [(4, 28, 4, 2304, 128), (4, 12, 2, 2304, 128), (8, 28, 4, 4096, 128), (1, 28, 4, 16384, 128)]

register(BenchOp(
    name="mrope",
    make_inputs=_mrope_inputs,
    tigon=lambda q, k, cos, sin: F.mrope(q, k, cos, sin, QWEN2_5_VL_SECTION),
    eager=_eager_mrope(QWEN2_5_VL_SECTION),
    bytes_moved=_mrope_bytes,
    sizes=MROPE_SIZES,
    cpu_sizes=[(2, 4, 2, 128, 128)],
    size_names="batch x q_heads x kv_heads x tokens x head_dim",
    peer=_liger_mrope(QWEN2_5_VL_SECTION),
))

register(BenchOp(
    name="mrope_interleaved",
    make_inputs=_mrope_inputs,
    tigon=lambda q, k, cos, sin: F.mrope(q, k, cos, sin, QWEN3_VL_SECTION, interleaved=True),
    eager=_interleaved_eager,
    bytes_moved=_mrope_bytes,
    sizes=[(4, 32, 8, 2304, 128), (4, 16, 8, 2304, 128)],
    cpu_sizes=[(2, 4, 2, 128, 128)],
    size_names="batch x q_heads x kv_heads x tokens x head_dim",
))


def _vision_rope_inputs(size, dtype, device):
    tokens, heads, head_dim = size
    qkv = torch.randn(tokens, 3 * heads * head_dim, dtype=dtype, device=device)
    q, k, _ = qkv.reshape(tokens, 3, heads, head_dim).permute(1, 0, 2, 3).unbind(0)
    angles = torch.rand(tokens, head_dim // 2, device=device) * 100
    emb = torch.cat((angles, angles), dim=-1)
    return q.detach().requires_grad_(), k.detach().requires_grad_(), emb.cos(), emb.sin()


def _eager_vision_rope(q, k, cos, sin):
    # transformers' apply_rotary_pos_emb_vision, written out
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    qf, kf = q.float(), k.float()
    return (qf * cos + _rotate_half(qf) * sin).to(q.dtype), (kf * cos + _rotate_half(kf) * sin).to(k.dtype)


def _vision_rope_bytes(size, dtype):
    tokens, heads, head_dim = size
    return (8 * tokens * heads * head_dim * dtype.itemsize) + 4 * tokens * head_dim * 4


register(BenchOp(
    name="vision_rope",
    make_inputs=_vision_rope_inputs,
    tigon=F.vision_rope,
    eager=_eager_vision_rope,
    bytes_moved=_vision_rope_bytes,
    sizes=[(4 * 1024, 16, 80), (16384, 16, 80), (4 * 729, 16, 72)],  # Qwen2/2.5-VL tower: 16 heads of 80
    cpu_sizes=[(256, 4, 80)],
    size_names="tokens x heads x head_dim",
))


def _gelu_mlp_inputs(size, dtype, device):
    tokens, hidden, intermediate = size

    def param(*shape):
        return (torch.randn(*shape, dtype=dtype, device=device) * shape[-1] ** -0.5).requires_grad_()

    x = torch.randn(tokens, hidden, dtype=dtype, device=device, requires_grad=True)
    return x, param(intermediate, hidden), param(hidden, intermediate), param(intermediate), param(hidden)


def _gelu_mlp_bytes(size, dtype):
    tokens, hidden, intermediate = size
    return (4 * tokens * hidden + 4 * hidden * intermediate + 4 * tokens * intermediate) * dtype.itemsize


def _register_gelu_mlp(name, approximate, eager_act, sizes):
    register(BenchOp(
        name=name,
        make_inputs=_gelu_mlp_inputs,
        tigon=lambda x, w1, w2, b1, b2: F.gelu_mlp(x, w1, w2, b1, b2, approximate=approximate),
        eager=lambda x, w1, w2, b1, b2: torch.nn.functional.linear(eager_act(torch.nn.functional.linear(x, w1, b1)), w2, b2),
        bytes_moved=_gelu_mlp_bytes,
        flops=lambda size: 6 * 2 * size[0] * size[1] * size[2],  # 2 projections fwd, 4 matmuls bwd
        sizes=sizes,
        cpu_sizes=[(256, 128, 512)],
        size_names="tokens x hidden x intermediate",
    ))


# SigLIP so400m (1152 -> 4304, gelu_pytorch_tanh), 4 images of 729 patches; Qwen2-VL's tower
# (1280 -> 5120, QuickGELU), 4 images of 1024 patches.
_register_gelu_mlp("gelu_mlp_tanh", "tanh", lambda h: torch.nn.functional.gelu(h, approximate="tanh"),
                   [(4 * 729, 1152, 4304), (16 * 729, 1152, 4304)])
_register_gelu_mlp("gelu_mlp_quick", "sigmoid", lambda h: h * torch.sigmoid(1.702 * h),
                   [(4 * 1024, 1280, 5120), (16 * 1024, 1280, 5120)])
