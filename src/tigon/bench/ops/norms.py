"""Benchmark cases for rms_norm, add_rms_norm and layer_norm (the headline shape first: 16384 x 4096)."""

from __future__ import annotations

import torch

import tigon.functional as F
from tigon.bench.registry import BenchOp, liger, register

SIZES = [(16384, 4096), (16384, 1024), (16384, 2048), (16384, 8192), (4096, 16384), (1024, 65536)]
CPU_SIZES = [(512, 1024), (512, 4096)]


def _row_inputs(size, dtype, device, n_inputs=1, bias=False):
    rows, cols = size
    xs = [torch.randn(rows, cols, dtype=dtype, device=device, requires_grad=True) for _ in range(n_inputs)]
    weight = (1 + 0.1 * torch.randn(cols, dtype=dtype, device=device)).requires_grad_()
    params = [weight]
    if bias:
        params.append((0.1 * torch.randn(cols, dtype=dtype, device=device)).requires_grad_())
    return (*xs, *params)


def _norm_bytes(n_row_tensors):
    # fwd: read the inputs, write the outputs; bwd: read grads + saved input, write input grads.
    return lambda size, dtype: n_row_tensors * size[0] * size[1] * torch.finfo(dtype).bits // 8


def _eager_rms_norm(x, w, eps=1e-6):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


register(BenchOp(
    name="rms_norm",
    make_inputs=lambda size, dtype, device: _row_inputs(size, dtype, device),
    tigon=F.rms_norm,
    eager=_eager_rms_norm,
    bytes_moved=_norm_bytes(5),  # x, y | dy, x, dx
    sizes=SIZES,
    cpu_sizes=CPU_SIZES,
    peer=liger("liger_rms_norm", eps=1e-6),
))

register(BenchOp(
    name="add_rms_norm",
    make_inputs=lambda size, dtype, device: _row_inputs(size, dtype, device, n_inputs=2),
    tigon=F.add_rms_norm,
    eager=lambda x, r, w: (_eager_rms_norm(x + r, w), x + r),
    bytes_moved=_norm_bytes(8),  # x, r, y, sum | dy, dsum, sum, dx (= dr)
    sizes=SIZES,
    cpu_sizes=CPU_SIZES,
    peer=liger("liger_fused_add_rms_norm", eps=1e-6),
))

register(BenchOp(
    name="layer_norm",
    make_inputs=lambda size, dtype, device: _row_inputs(size, dtype, device, bias=True),
    tigon=F.layer_norm,
    eager=lambda x, w, b: torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
    bytes_moved=_norm_bytes(5),
    sizes=SIZES,
    cpu_sizes=CPU_SIZES,
    peer=liger("liger_layer_norm", eps=1e-5),
))
