"""Benchmark cases for swiglu and geglu (the headline shape first: 16384 tokens x 14336, the
intermediate width of Llama-3-8B), and the whole gated MLP glu_mlp against the unfused Llama MLP,
whose peak memory shows the recomputed down_proj input."""

from __future__ import annotations

import torch

import tigon.functional as F
from tigon.bench.registry import BenchOp, liger, register

SIZES = [(16384, 14336), (16384, 8192), (8192, 11008), (16384, 4096), (4096, 28672)]
CPU_SIZES = [(512, 1376)]


def _pair_inputs(size, dtype, device):
    return tuple(torch.randn(size, dtype=dtype, device=device, requires_grad=True) for _ in range(2))


def _glu_bytes(size, dtype):
    # fwd: read gate, up, write out; bwd: read grad, gate, up, write both gradients.
    return 8 * size[0] * size[1] * dtype.itemsize


register(BenchOp(
    name="swiglu",
    make_inputs=_pair_inputs,
    tigon=F.swiglu,
    eager=lambda gate, up: torch.nn.functional.silu(gate) * up,
    bytes_moved=_glu_bytes,
    sizes=SIZES,
    cpu_sizes=CPU_SIZES,
    peer=liger("liger_swiglu"),
))

register(BenchOp(
    name="geglu",
    make_inputs=_pair_inputs,
    tigon=F.geglu,
    eager=lambda gate, up: torch.nn.functional.gelu(gate, approximate="tanh") * up,
    bytes_moved=_glu_bytes,
    sizes=SIZES,
    cpu_sizes=CPU_SIZES,
    peer=liger("liger_geglu"),
))


def _mlp_inputs(size, dtype, device):
    tokens, hidden, intermediate = size

    def weight(rows, cols):
        return (torch.randn(rows, cols, dtype=dtype, device=device) * cols**-0.5).requires_grad_()

    x = torch.randn(tokens, hidden, dtype=dtype, device=device, requires_grad=True)
    return x, weight(intermediate, hidden), weight(intermediate, hidden), weight(hidden, intermediate)


def _eager_mlp(x, gate_weight, up_weight, down_weight):
    linear = torch.nn.functional.linear
    return linear(torch.nn.functional.silu(linear(x, gate_weight)) * linear(x, up_weight), down_weight)


def _mlp_bytes(size, dtype):
    tokens, hidden, intermediate = size
    # x, out and their gradients; the weights and theirs; gate and up written once and read back.
    return (4 * tokens * hidden + 6 * hidden * intermediate + 4 * tokens * intermediate) * dtype.itemsize


register(BenchOp(
    name="glu_mlp",
    make_inputs=_mlp_inputs,
    tigon=F.glu_mlp,
    eager=_eager_mlp,
    bytes_moved=_mlp_bytes,
    flops=lambda size: 9 * 2 * size[0] * size[1] * size[2],  # 3 projections fwd, 6 matmuls bwd
    sizes=[(8192, 4096, 14336), (8192, 2048, 8192), (16384, 4096, 14336)],
    cpu_sizes=[(256, 256, 688)],
    size_names="tokens x hidden x intermediate",
))
