"""Benchmark cases for lora_linear, the shared-input q/k/v group and the LoRA gated MLP (the
issue's target shapes first). Base weights are frozen and the adapters trainable, as in LoRA
fine-tuning; eager is the PEFT arithmetic (``F.linear(x, W) + s * F.linear(F.linear(x, A), B)``)."""

from __future__ import annotations

import torch

import tigon.functional as F
from tigon.bench.registry import BenchOp, register
from tigon.ops import LoraProjection, lora_gated_mlp_reference, lora_linear_reference

SCALING = 2.0  # lora_alpha = 2 r


def _adapter(in_features, out_features, rank, dtype, device):
    """(W frozen, A, B trainable) for one projection."""
    weight = torch.randn(out_features, in_features, dtype=dtype, device=device) * in_features**-0.5
    lora_a = (torch.randn(rank, in_features, dtype=dtype, device=device) * in_features**-0.5).requires_grad_()
    lora_b = (torch.randn(out_features, rank, dtype=dtype, device=device) * rank**-0.5).requires_grad_()
    return weight, lora_a, lora_b


def _lora_flops(rows, in_features, out_features, rank):
    # base GEMM and the input gradient's; x Aᵀ, its gradient and dA; the B-side three likewise
    return 4 * rows * in_features * out_features + 6 * rows * rank * (in_features + out_features)


def _linear_bytes(rows, in_features, out_features, dtype):
    # fwd reads x and W, writes the output; bwd reads dy, x and W, writes dx
    return (rows * (3 * in_features + 2 * out_features) + 2 * in_features * out_features) * dtype.itemsize


def _projections(tensors):
    return [LoraProjection(w, a, b, SCALING) for w, a, b in zip(*[iter(tensors)] * 3)]


# lora_linear: size = (tokens, in, out, r)
def _linear_inputs(size, dtype, device):
    rows, in_features, out_features, rank = size
    x = torch.randn(rows, in_features, dtype=dtype, device=device, requires_grad=True)
    return (x, *_adapter(in_features, out_features, rank, dtype, device))


register(BenchOp(
    name="lora_linear",
    make_inputs=_linear_inputs,
    tigon=lambda x, w, a, b: F.lora_linear(x, w, a, b, SCALING),
    eager=lambda x, w, a, b: lora_linear_reference(x, w, a, b, SCALING),
    bytes_moved=lambda size, dtype: _linear_bytes(*size[:3], dtype),
    flops=lambda size: _lora_flops(*size),
    sizes=[(16384, 4096, 4096, 16), (16384, 4096, 4096, 64), (16384, 4096, 4096, 256), (8192, 4096, 14336, 16),
           (8192, 14336, 4096, 16), (16384, 4096, 1024, 16), (16384, 2048, 2048, 16)],
    cpu_sizes=[(512, 512, 512, 8)],
    size_names="tokens x in x out x rank",
))


# q/k/v of one input: size = (tokens, hidden, kv width, r)
def _qkv_inputs(size, dtype, device):
    rows, hidden, kv, rank = size
    x = torch.randn(rows, hidden, dtype=dtype, device=device, requires_grad=True)
    return (x, *(t for out in (hidden, kv, kv) for t in _adapter(hidden, out, rank, dtype, device)))


register(BenchOp(
    name="lora_qkv",
    make_inputs=_qkv_inputs,
    tigon=lambda x, *t: F.lora_linear_group(x, _projections(t)),
    eager=lambda x, *t: tuple(lora_linear_reference(x, *p) for p in _projections(t)),
    bytes_moved=lambda size, dtype: _linear_bytes(size[0], size[1], size[1] + 2 * size[2], dtype),
    flops=lambda size: _lora_flops(size[0], size[1], size[1] + 2 * size[2], 3 * size[3]),
    sizes=[(8192, 4096, 1024, 16), (8192, 2048, 512, 16)],
    cpu_sizes=[(256, 512, 128, 8)],
    size_names="tokens x hidden x kv x rank",
))


# gated MLP: size = (tokens, hidden, intermediate, r)
def _mlp_inputs(size, dtype, device):
    rows, hidden, intermediate, rank = size
    x = torch.randn(rows, hidden, dtype=dtype, device=device, requires_grad=True)
    shapes = ((hidden, intermediate), (hidden, intermediate), (intermediate, hidden))
    return (x, *(t for i, o in shapes for t in _adapter(i, o, rank, dtype, device)))


def _mlp_flops(size):
    rows, hidden, intermediate, rank = size
    return 3 * _lora_flops(rows, hidden, intermediate, rank)


def _mlp_bytes(size, dtype):
    rows, hidden, intermediate, _ = size
    # fwd reads x, writes gate, up and the output; bwd reads dy, x, gate and up, writes dx;
    # the three weights are read in each direction
    return (4 * rows * hidden + 4 * rows * intermediate + 6 * hidden * intermediate) * dtype.itemsize


register(BenchOp(
    name="lora_gated_mlp",
    make_inputs=_mlp_inputs,
    tigon=lambda x, *t: F.lora_gated_mlp(x, *_projections(t)),
    eager=lambda x, *t: lora_gated_mlp_reference(x, "silu", *(v for p in _projections(t) for v in p)),
    bytes_moved=_mlp_bytes,
    flops=_mlp_flops,
    sizes=[(8192, 4096, 14336, 16), (8192, 2048, 8192, 16), (8192, 4096, 14336, 64), (16384, 4096, 14336, 16)],
    cpu_sizes=[(256, 256, 704, 8)],
    size_names="tokens x hidden x intermediate x rank",
))
