"""Benchmark cases for linear_4bit: a frozen NF4 weight (double quantisation, blocks of 64) at
Llama-3-8B's projection shapes, forward and input gradient. Eager is tigon's PyTorch reference
(dequantise by torch ops, then the GEMM); the peer is bitsandbytes' own ``matmul_4bit``, what PEFT
runs. Per-pass times beside each dequantise + cuBLAS path: ``python -m tigon.bench.gemm_4bit``."""

from __future__ import annotations

import torch

import tigon.functional as F
from tigon.bench.registry import BenchOp, register
from tigon.ops.gemm_4bit import linear_4bit_reference
from tigon.patch.quantized import from_4bit


# size = (tokens, in, out)
def _inputs(size, dtype, device):
    import bitsandbytes.functional as bnb

    tokens, in_features, out_features = size
    master = torch.randn(out_features, in_features, dtype=dtype, device=device) * in_features**-0.5
    data, state = bnb.quantize_4bit(master, blocksize=64, quant_type="nf4", compress_statistics=True)
    x = torch.randn(tokens, in_features, dtype=dtype, device=device, requires_grad=True)
    return x, from_4bit(data, state), data, state


def _bitsandbytes():
    import bitsandbytes

    return lambda x, weight, data, state: bitsandbytes.matmul_4bit(x, data.t(), quant_state=state)


def _bytes(size, dtype):
    # fwd reads x and the packed W, writes out; the input gradient reads dy and W, writes dx
    tokens, in_features, out_features = size
    return 2 * tokens * (in_features + out_features) * dtype.itemsize + in_features * out_features


register(BenchOp(
    name="linear_4bit",
    make_inputs=_inputs,
    tigon=lambda x, weight, data, state: F.linear_4bit(x, weight),
    eager=lambda x, weight, data, state: linear_4bit_reference(x, weight),
    bytes_moved=_bytes,
    flops=lambda size: 4 * size[0] * size[1] * size[2],
    sizes=[(2048, 4096, 4096), (2048, 4096, 14336), (2048, 14336, 4096), (2048, 4096, 1024), (8192, 4096, 4096),
           (8192, 4096, 14336), (512, 4096, 4096), (256, 4096, 14336)],
    cpu_sizes=[(96, 128, 80)],
    size_names="tokens x in x out",
    peer=_bitsandbytes,
))
