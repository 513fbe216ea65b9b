"""Residual add + RMSNorm, then the gated MLP, as one autograd op:

    add_rms_norm_glu_mlp(x, r, w, ...) = (glu_mlp(rms_norm(x + r, w), ...), x + r)

the second half of a pre-norm decoder layer (Llama's ``post_attention_layernorm`` and MLP). It runs
the kernels of :func:`tigon.ops.rms_norm.add_rms_norm` and :func:`tigon.ops.composite.glu_mlp.glu_mlp`, so the
numbers are theirs; as one op it costs the host one autograd Function, one dispatch and one set of
checks instead of two, and the MLP's input is recomputed in backward by a bare kernel launch. A
training step on a fast GPU waits for the host to issue each layer, so this is time on the step.

Saved for backward: the sum ``x + r`` (the residual stream, kept anyway), one fp32 rstd per row,
and the MLP's gate and up projections (not those with ``recompute``: backward forms them again from
the normed input); the normed input is recomputed from the sum (the same kernel on the same rows,
so bit for bit the forward's). With ``output_discarded`` the MLP forms only what it keeps, as
:func:`~tigon.ops.composite.glu_mlp.glu_mlp`'s does.
"""

from __future__ import annotations

import functools

import torch

from tigon.ops._checks import rows_view
from tigon.ops._dispatch import Op, backward_fallback
from tigon.ops.composite.glu_mlp import (
    GLU_MLP, check_glu_mlp, glu_mlp_backward, glu_mlp_compiled, glu_mlp_reference, gate_and_up, kept_forward,
)
from tigon.ops.rms_norm import (
    ADD_RMS_NORM, add_rms_norm_compiled, add_rms_norm_reference, check_rms_norm, rms_norm_backward,
    rms_norm_rows,
)


def add_rms_norm_glu_mlp_reference(
    x, residual, norm_weight, eps, gate_weight, up_weight, down_weight, gate_bias=None, up_bias=None, down_bias=None,
    offset=0.0, casting="llama", activation="silu",
):
    """The two ops' references, one after the other: the test oracle and the fallback."""
    normed, total = add_rms_norm_reference(x, residual, norm_weight, eps, offset, casting)
    return glu_mlp_reference(normed, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation), total


def _reference_in_op_order(x, residual, norm_weight, eps, gate_weight, up_weight, down_weight, gate_bias, up_bias,
                           down_bias, offset, casting, activation, recompute, discarded):
    """The reference with the op's argument order (what the fused op keeps changes no value; a
    discarded output is formed all the same)."""
    return add_rms_norm_glu_mlp_reference(
        x, residual, norm_weight, eps, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias,
        offset, casting, activation,
    )


def _reference_in_function_order(x, residual, norm_weight, gate_weight, up_weight, down_weight, gate_bias, up_bias,
                            down_bias, eps, offset, casting, activation, recompute, discarded):
    """The reference with the Function's argument order."""
    return _reference_in_op_order(x, residual, norm_weight, eps, gate_weight, up_weight, down_weight, gate_bias,
                                  up_bias, down_bias, offset, casting, activation, recompute, discarded)


def _reference_point(ctx, saved):
    total, _, norm_weight, _, _, *weights_and_biases = saved
    # x and the residual enter only through their sum, so (sum, 0) stands in for them.
    inputs = (total, torch.zeros_like(total), norm_weight, *weights_and_biases, *ctx.config, False, False)
    return ADD_RMS_NORM_GLU_MLP, _reference_in_function_order, inputs


class _AddNormGLUMLPFunction(torch.autograd.Function):
    # custom_fwd/custom_bwd: under autocast the backward's matmuls run in the forward's precision.
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, residual, norm_weight, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias,
                eps, offset, casting, activation, recompute, discarded):
        normed, total, rstd = rms_norm_rows(x, residual, norm_weight, eps, offset, casting)
        out, gate, up = kept_forward(normed, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias,
                                     activation, recompute, discarded)
        ctx.save_for_backward(
            total, rstd, norm_weight, gate, up, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias
        )
        ctx.config = (eps, offset, casting, activation)
        return out, total

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_out, grad_total):
        total, rstd, norm_weight, gate, up, gate_weight, up_weight, down_weight, gate_bias, up_bias, _ = saved
        eps, offset, casting, activation = ctx.config
        needs = ctx.needs_input_grad
        need_normed = any(needs[:3])  # the MLP's input gradient feeds x's, the residual's and the norm weight's
        @functools.cache  # formed at most once
        def normed_rows() -> torch.Tensor:
            return rms_norm_rows(rows_view(total), None, norm_weight, eps, offset, casting)[0]

        if gate is None:  # recompute
            gate, up = gate_and_up(normed_rows(), gate_weight, up_weight, gate_bias, up_bias)

        mlp_grads = glu_mlp_backward(
            grad_out, normed_rows, gate, up, gate_weight, up_weight, down_weight, activation, (need_normed, *needs[3:9]),
        )
        grad_sum = grad_norm_weight = None
        if need_normed:
            grad_sum, grad_norm_weight = rms_norm_backward(
                mlp_grads[0], grad_total, total, norm_weight, rstd, offset, casting, needs[2]
            )
            grad_sum = grad_sum.view(total.shape)
        return (
            grad_sum if needs[0] else None, grad_sum if needs[1] else None, grad_norm_weight if needs[2] else None,
            *(g if need else None for g, need in zip(mlp_grads[1:], needs[3:9])), None, None, None, None, None, None,
        )


def _kernel(x, residual, norm_weight, eps, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias,
            offset, casting, activation, recompute, discarded):
    return _AddNormGLUMLPFunction.apply(
        x, residual, norm_weight, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias,
        float(eps), float(offset), casting, activation, recompute, discarded,
    )


def _compiled(x, residual, norm_weight, eps, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias,
              offset, casting, activation, recompute, discarded):
    # Inside torch.compile: the two ops' library ops, one after the other.
    normed, total = add_rms_norm_compiled(x, residual, norm_weight, eps, offset, casting)
    out = glu_mlp_compiled(normed, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation,
                            None, recompute, discarded)
    return out, total


ADD_RMS_NORM_GLU_MLP = Op(
    "add_rms_norm_glu_mlp", _kernel, _reference_in_op_order, compiled=_compiled, parts=(ADD_RMS_NORM, GLU_MLP)
)


def add_rms_norm_glu_mlp(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    *,
    offset: float = 0.0,
    casting: str = "llama",
    activation: str = "silu",
    recompute: bool = False,
    output_discarded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm, then the gated MLP on the normed sum, as one op: returns
    ``(glu_mlp(rms_norm(x + residual)), x + residual)``.

    Args:
        x, residual: ``(..., hidden)``, same shape and dtype (float16/bfloat16/float32; float64
            runs the reference).
        norm_weight, eps, offset, casting: the RMSNorm's, as for :func:`tigon.ops.rms_norm.rms_norm`.
        gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation: the gated
            MLP's, as for :func:`tigon.ops.composite.glu_mlp.glu_mlp`.
        recompute: keep neither the gate nor the up projection for backward, which forms them
            again from the normed input (as :func:`~tigon.ops.composite.glu_mlp.glu_mlp`'s).
        output_discarded: the caller never reads the MLP's output (gradient checkpointing's
            replay of a layer in backward): the MLP forms only what it keeps, and that output is
            NaN; the sum is formed as ever. (The reference path forms it all the same.)

    Returns:
        The MLP's output ``(..., hidden)`` and the sum (the residual stream after the add). Works
        under autocast.

    The kernels are those of add_rms_norm and glu_mlp: ``TIGON_DISABLE`` naming either (or this op)
    runs the PyTorch reference.
    """
    args = (x, residual, norm_weight, eps, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)
    unsupported = check_rms_norm(x, norm_weight, eps, casting, residual) or check_glu_mlp(
        x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation
    )
    return ADD_RMS_NORM_GLU_MLP(unsupported, *args, offset, casting, activation, bool(recompute),
                                bool(output_discarded))
