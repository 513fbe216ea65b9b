"""Linear projections of one input as one op, so that their input gradient is one tensor.

    linear_group(x, weights, biases) = (x W₁ᵀ + b₁, x W₂ᵀ + b₂, …)

When several linears read the same tensor (an attention's q, k and v projections), autograd gets
an input gradient from each and sums them: two full-size adds per attention layer in every
backward pass, each reading two tensors and writing one (~0.8 ms of a Llama-3.2-1B step at 4 x 2048
tokens on an H200). Here the first projection's backward GEMM writes dx and each further one
accumulates into it (``addmm_``: cuBLAS reads dx in its epilogue, which costs nothing in a
compute-bound GEMM), so no add runs. Forward runs the same GEMMs as the separate linears and x is
saved once, as autograd saves it for them.

Everything is cuBLAS, on any device; float64, ``TIGON_DISABLE=linear_group`` and torch.compile run
the reference (autograd over the separate linears), as the dispatcher's rules say for every op.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tigon.ops._checks import check_device, check_float, check_input, rows_view
from tigon.ops._dispatch import Op, autocast_dtype


def linear_group_reference(x: torch.Tensor, *params: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The separate linears (`params` is ``weight₁, bias₁, weight₂, bias₂, …``): oracle and fallback."""
    return tuple(torch.nn.functional.linear(x, w, b) for w, b in zip(params[0::2], params[1::2]))


class _LinearGroupFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *params):
        weights = params[0::2]
        ctx.save_for_backward(x, *weights)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not a zero tensor
        return tuple(torch.nn.functional.linear(x, w, b) for w, b in zip(weights, params[1::2]))

    @staticmethod
    def backward(ctx, *grad_outs):
        x, *weights = ctx.saved_tensors
        x2d = rows_view(x)
        needs = ctx.needs_input_grad
        grads = [None if g is None else rows_view(g) for g in grad_outs]
        grad_x = None
        if needs[0]:
            for dy, weight in zip(grads, weights):
                if dy is None:
                    continue
                if grad_x is None:
                    grad_x = torch.mm(dy, weight)
                else:
                    grad_x.addmm_(dy, weight)
            if grad_x is not None:
                grad_x = grad_x.view(x.shape)
        param_grads = []
        for i, dy in enumerate(grads):
            need_weight, need_bias = needs[1 + 2 * i], needs[2 + 2 * i]
            param_grads.append(torch.mm(dy.t(), x2d) if need_weight and dy is not None else None)
            param_grads.append(dy.sum(0) if need_bias and dy is not None else None)
        return (grad_x, *param_grads)


LINEAR_GROUP = Op("linear_group", _LinearGroupFunction.apply, linear_group_reference, uses_triton=False)


def _is_plain(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, device: torch.device) -> bool:
    """Whether a projection is of the usual kind (2-D, x's width, dtype and device; a bias to
    match), found without building any message: this op replaces three F.linear calls, so its
    host time is most of its cost. Anything else goes through :func:`_check_projection`."""
    dtype = x.dtype
    return (
        isinstance(weight, torch.Tensor) and weight.dtype == dtype and weight.dim() == 2
        and weight.shape[1] == x.shape[-1] and weight.device == device
        and (bias is None or (
            isinstance(bias, torch.Tensor) and bias.dtype == dtype and bias.shape == weight.shape[:1]
            and bias.device == device
        ))
    )


def _check_projection(i: int, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, autocast: bool) -> None:
    name = f"weights[{i}]"
    check_float(name, weight)
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{name} must have shape (out, {x.shape[-1]}) to match x's last dim, got {tuple(weight.shape)}")
    check_device(name, weight, x.device)
    if bias is not None:
        check_float(f"biases[{i}]", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"biases[{i}] must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        check_device(f"biases[{i}]", bias, x.device)
    if not autocast:
        for arg, t in ((name, weight), (f"biases[{i}]", bias)):
            if t is not None and t.dtype != x.dtype:
                raise ValueError(f"{arg} must have the dtype of x ({x.dtype}), got {t.dtype}")


def linear_group(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Several linears of the same input (an attention's q/k/v) as one op.

    Equal to ``tuple(F.linear(x, w, b) for w, b in zip(weights, biases))``, forward and backward,
    but the gradient of x is one tensor that each projection's backward GEMM accumulates into
    (no per-projection copies of dx for autograd to add up).

    Args:
        x: input ``(..., in)``, float16/bfloat16/float32 (float64 runs the reference).
        weights: one ``(out_i, in)`` weight per projection (``nn.Linear`` layout), on x's device,
            in x's dtype unless autocast is on (then everything is cast as ``F.linear`` would be).
            A weight's gradient is computed only if it requires grad.
        biases: None, or one ``(out_i,)`` bias or None per weight.

    Returns:
        One ``(..., out_i)`` tensor per weight.
    """
    check_input(x)
    weights = list(weights)
    if not weights:
        raise ValueError("weights must hold at least one weight, got none")
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(f"biases must hold one bias (or None) per weight: {len(weights)}, got {len(biases)}")
    dtype = autocast_dtype(x)
    device = x.device
    for i, (weight, bias) in enumerate(zip(weights, biases)):
        if not _is_plain(weight, bias, x, device):
            _check_projection(i, weight, bias, x, autocast=dtype is not None)
    params = tuple(t for pair in zip(weights, biases) for t in pair)
    if dtype is not None:
        # As autocast casts a linear's operands; the casts are autograd nodes, so gradients come
        # back in the original dtypes.
        x, params = x.to(dtype), tuple(None if t is None else t.to(dtype) for t in params)
    return LINEAR_GROUP.without_autocast(dtype, None, x, *params)
