"""Benchmark cases for the fused FP8 quantisation: rms_norm / add_rms_norm / swiglu writing their
output as FP8 e4m3 with rowwise power-of-two scales (torchao's rowwise recipe) in the same pass, at
the 1B and 8B Llama shapes (4 x 2048 tokens; hidden 2048 / 4096, intermediate 8192 / 14336).

Columns: tigon is the fused kernel; eager is PyTorch's norm (or silu * up) then torchao.float8's
own cast (its amax pass, then the scale-and-cast pass); compile is that under torch.compile, where
inductor fuses what it can; peer is tigon's unfused kernel then torchao's cast, the path the fusion
replaces. Every column also runs the op's backward (the quantised rows take no gradient), so
fwd_ms is the figure the fusion moves.
"""

from __future__ import annotations

import torch

import tigon.functional as F
from tigon.bench.ops.norms import _eager_rms_norm, _row_inputs
from tigon.bench.registry import BenchOp, register

MODE = "rowwise_pow2"
NORM_SIZES = [(8192, 2048), (8192, 4096)]
GLU_SIZES = [(8192, 8192), (8192, 14336)]
CPU_SIZES = [(64, 256)]


def _torchao_cast(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`out` and torchao's rowwise cast of it (payload, scale), as a Float8Linear casts its input."""
    from torchao.float8.config import ScalingGranularity, e4m3_dtype
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    cast = hp_tensor_to_float8_dynamic(
        out.detach(), e4m3_dtype, LinearMMConfig(), scaling_granularity=ScalingGranularity.AXISWISE,
        axiswise_dim=-1, round_scales_to_power_of_2=True,
    )
    return out, cast._data, cast._scale


def _then_cast(fn):
    """`fn` followed by torchao's cast of its (first) output."""
    def run(*args):
        out = fn(*args)
        if isinstance(out, tuple):
            return (*_torchao_cast(out[0]), *out[1:])
        return _torchao_cast(out)

    return run


def _unfused(fn):
    """A `peer` factory: tigon's kernel without the option, then torchao's cast."""
    return lambda: _then_cast(fn)


def _fused_bytes(row_tensors):
    # The hp tensors read and written over fwd + bwd at the input's width, plus the e4m3 payload.
    return lambda size, dtype: (row_tensors * dtype.itemsize + 1) * size[0] * size[1]


def _swiglu(gate, up):
    return torch.nn.functional.silu(gate) * up


register(BenchOp(
    name="rms_norm_fp8",
    make_inputs=lambda size, dtype, device: _row_inputs(size, dtype, device),
    tigon=lambda x, w: F.rms_norm(x, w, fp8=MODE),
    eager=_then_cast(_eager_rms_norm),
    bytes_moved=_fused_bytes(5),  # x, y | dy, x, dx
    sizes=NORM_SIZES,
    cpu_sizes=CPU_SIZES,
    peer=_unfused(F.rms_norm),
))

register(BenchOp(
    name="add_rms_norm_fp8",
    make_inputs=lambda size, dtype, device: _row_inputs(size, dtype, device, n_inputs=2),
    tigon=lambda x, r, w: F.add_rms_norm(x, r, w, fp8=MODE),
    eager=_then_cast(lambda x, r, w: (_eager_rms_norm(x + r, w), x + r)),
    bytes_moved=_fused_bytes(8),  # x, r, y, sum | dy, dsum, sum, dx
    sizes=NORM_SIZES,
    cpu_sizes=CPU_SIZES,
    peer=_unfused(F.add_rms_norm),
))

register(BenchOp(
    name="swiglu_fp8",
    make_inputs=lambda size, dtype, device: tuple(
        torch.randn(size, dtype=dtype, device=device, requires_grad=True) for _ in range(2)
    ),
    tigon=lambda gate, up: F.swiglu(gate, up, fp8=MODE),
    eager=_then_cast(_swiglu),
    bytes_moved=_fused_bytes(8),  # gate, up, out | dout, gate, up, dgate, dup
    sizes=GLU_SIZES,
    cpu_sizes=CPU_SIZES,
    peer=_unfused(F.swiglu),
))
