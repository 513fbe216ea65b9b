"""A torchao Float8Linear fed an input that a tigon kernel has already quantised
(``rms_norm(..., fp8=...)``, ``swiglu(..., fp8=...)``), so that the linear skips its own amax and
cast passes over the activation, with torchao's numbers bit for bit.

Why not just pass torchao's tensor type as the input: torchao's matmul function saves its input
for backward as it got it, and a Float8TrainingTensor there is used as-is for the weight gradient
GEMM too. Under tensorwise scaling that is the same tensor torchao would make, but rowwise scaling
quantises the input for the weight gradient along the other axis (one scale per feature, over the
tokens), which no row-at-a-time kernel can write in its pass; and the rowwise-with-hp-weight-grad
recipe wants the high-precision input there. So the handoff runs torchao's own forward on the
pre-quantised input and torchao's own backward on the high-precision input: the kernel writes
both, and only the forward GEMM's operand arrives quantised.

The same holds for the gate/up projections' output gradients, which the SwiGLU backward kernel can
quantise rowwise (``glu_backward(..., fp8=...)``): torchao's backward takes one grad_output for both
of its GEMMs, rowwise along the tokens for one and along the features for the other (and e5m2,
with a global amax, under tensorwise), so those are not handed over; see the report of issue 40.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tigon.ops import Float8Rows

FP8_DTYPE = torch.float8_e4m3fn  # what tigon's kernels write


def _torchao():
    """torchao.float8's pieces the handoff uses (imported when first needed: an optional extra)."""
    from torchao.float8 import float8_linear, float8_training_tensor
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_utils import amax_to_scale

    return SimpleNamespace(
        Float8Linear=float8_linear.Float8Linear,
        matmul=float8_linear.matmul_with_hp_or_float8_args,
        Float8TrainingTensor=float8_training_tensor.Float8TrainingTensor,
        to_float8=float8_training_tensor.hp_tensor_and_scale_to_float8,
        INPUT=float8_training_tensor.GemmInputRole.INPUT,
        AXISWISE=ScalingGranularity.AXISWISE,
        DYNAMIC=ScalingType.DYNAMIC,
        amax_to_scale=amax_to_scale,
    )


def input_fp8_mode(linear: torch.nn.Module) -> str | None:
    """The `fp8` mode a tigon kernel must be asked for so that its output can be handed to
    `linear` by :func:`float8_linear_from_rows`: ``"rowwise_pow2"`` / ``"rowwise"`` for a
    rowwise input cast (with or without power-of-two scales), ``"amax"`` for a tensorwise one,
    None where `linear` is no Float8Linear or does not cast its input to e4m3 dynamically."""
    ao = _torchao()
    if not isinstance(linear, ao.Float8Linear):
        return None
    cast = linear.config.cast_config_input
    if cast.scaling_type is not ao.DYNAMIC or cast.target_dtype != FP8_DTYPE:
        return None
    if cast.scaling_granularity is ao.AXISWISE:
        return "rowwise_pow2" if linear.config.round_scales_to_power_of_2 else "rowwise"
    return "amax"


@torch._dynamo.allow_in_graph
class _PrequantizedInputMatmul(torch.autograd.Function):
    """torchao's float8 matmul with the forward's input operand given already quantised: its
    forward runs on `input_fp8`, its backward (torchao's own) on `input_hp`."""

    @staticmethod
    def forward(ctx, input_hp, input_fp8, weight_t, linear_mm_config, config):
        matmul = _torchao().matmul
        # torchao's forward saves what it is given; this Function saves the high-precision input instead.
        out = matmul.forward(SimpleNamespace(save_for_backward=lambda *_: None), input_fp8, weight_t, linear_mm_config, config)
        ctx.save_for_backward(input_hp, weight_t)
        ctx.linear_mm_config, ctx.config = linear_mm_config, config
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_input, grad_weight_t, _, _ = _torchao().matmul.backward(ctx, grad_out)
        return grad_input, None, grad_weight_t, None, None


def float8_linear_from_rows(linear: torch.nn.Module, x: torch.Tensor, rows: Float8Rows) -> torch.Tensor:
    """``linear(x)`` for a torchao Float8Linear, its input cast taken from `rows`: what a tigon
    kernel wrote next to `x` with ``fp8=input_fp8_mode(linear)``. Bit for bit ``linear(x)``, output
    and gradients; where `rows` cannot stand for torchao's cast (another mode, an autocast that
    would recast `x`), it is ``linear(x)`` itself.

    Tensorwise: the tensor's scale comes from the rows' amax (torchao's own amax_to_scale of their
    max), then torchao casts `x` with it: its amax pass is the one saved. Rowwise: `rows` is the
    cast, handed over as torchao's tensor type."""
    ao = _torchao()
    mode = input_fp8_mode(linear)
    # Float8Linear casts its input to autocast's dtype first: rows of another dtype are not its cast.
    autocast_dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    if mode is None or (rows.data is None) != (mode == "amax") or autocast_dtype != x.dtype:
        return linear(x)
    if mode == "amax":
        scale = ao.amax_to_scale(rows.amax.max(), FP8_DTYPE, linear.config.round_scales_to_power_of_2)
        x_fp8 = ao.to_float8(x.detach(), scale, FP8_DTYPE, linear.linear_mm_config, ao.INPUT)
    else:
        x_fp8 = ao.Float8TrainingTensor(rows.data, rows.scale, x.dtype, linear.linear_mm_config, ao.INPUT, axiswise_dim=-1)
    out = _PrequantizedInputMatmul.apply(x, x_fp8, linear.weight.t(), linear.linear_mm_config, linear.config)
    return out if linear.bias is None else out + linear.bias.to(out.dtype)
