"""LayerNorm over the last dim, with optional weight and bias, in one pass over each row.

    layer_norm(x, w, b) = (x - mean(x)) / sqrt(var(x) + eps) * w + b

Computed in fp32 and rounded once to the input dtype, as torch's CUDA LayerNorm does. Forward saves
the input and one fp32 mean and rstd per row; backward recomputes the normalised row.
"""

from __future__ import annotations

import torch

from tigon import _backend
from tigon._backend import tl, triton
from tigon.ops._launch import cdiv, persistent_programs, row_block_config
from tigon._checks import KERNEL_DTYPES, check_eps, check_float, check_vector, rows_view

LAYER_NORM = _backend.register("layer_norm")
MAX_KERNEL_COLS = 65536  # a whole row lives in registers; wider rows run the reference


@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr, weight_ptr, bias_ptr, out_ptr, mean_ptr, rstd_ptr,
    n_rows, n_cols, x_row_stride, out_row_stride, eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]

    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols
    centered = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=1) / n_cols + eps)
    tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)

    out = centered * rstd[:, None]
    if HAS_WEIGHT:
        out *= tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * out_row_stride + cols[None, :], out, mask=mask)


@triton.jit
def _layer_norm_bwd_kernel(
    grad_out_ptr, x_ptr, weight_ptr, mean_ptr, rstd_ptr, grad_x_ptr,
    grad_weight_partial_ptr, grad_bias_partial_ptr,
    n_rows, n_cols, grad_out_row_stride, x_row_stride, grad_x_row_stride,
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_GRAD_WEIGHT: tl.constexpr,
    COMPUTE_GRAD_BIAS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # Persistent, like the RMSNorm backward: per-program partial sums of the weight and bias
    # gradients stay in registers and are written once.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    grad_weight_acc = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    grad_bias_acc = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)

    for block in range(pid, tl.cdiv(n_rows, BLOCK_ROWS), tl.num_programs(0)):
        rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        grad_out = tl.load(
            grad_out_ptr + rows[:, None] * grad_out_row_stride + cols[None, :], mask=mask, other=0.0
        ).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)

        x_hat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if COMPUTE_GRAD_WEIGHT:
            grad_weight_acc += grad_out * x_hat
        if COMPUTE_GRAD_BIAS:
            grad_bias_acc += grad_out
        grad_x_hat = grad_out * weight[None, :] if HAS_WEIGHT else grad_out
        mean_grad = tl.sum(grad_x_hat, axis=1) / n_cols
        mean_dot = tl.sum(grad_x_hat * x_hat, axis=1) / n_cols
        grad_x = (grad_x_hat - mean_grad[:, None] - x_hat * mean_dot[:, None]) * rstd[:, None]
        tl.store(grad_x_ptr + rows[:, None] * grad_x_row_stride + cols[None, :], grad_x, mask=mask)

    if COMPUTE_GRAD_WEIGHT:
        tl.store(grad_weight_partial_ptr + pid * n_cols + cols, tl.sum(grad_weight_acc, axis=0), mask=col_mask)
    if COMPUTE_GRAD_BIAS:
        tl.store(grad_bias_partial_ptr + pid * n_cols + cols, tl.sum(grad_bias_acc, axis=0), mask=col_mask)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm in PyTorch, computed in fp32 and rounded once: the test oracle and the fallback."""
    compute = torch.promote_types(x.dtype, torch.float32)
    return torch.nn.functional.layer_norm(
        x.to(compute),
        (x.shape[-1],),
        weight.to(compute) if weight is not None else None,
        bias.to(compute) if bias is not None else None,
        eps,
    ).to(x.dtype)


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        x2d = rows_view(x)
        n_rows, n_cols = x2d.shape
        out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
        mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block_rows, block_cols, num_warps = row_block_config(n_cols)
        _layer_norm_fwd_kernel[(cdiv(n_rows, block_rows),)](
            x2d, weight if weight is not None else x2d, bias if bias is not None else x2d, out, mean, rstd,
            n_rows, n_cols, x2d.stride(0), out.stride(0), eps,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            BLOCK_ROWS=block_rows,
            BLOCK_COLS=block_cols,
            num_warps=num_warps,
        )
        ctx.save_for_backward(x2d, weight, bias, mean, rstd)
        ctx.eps = eps
        ctx.shape = x.shape
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight, bias, mean, rstd = ctx.saved_tensors
        needs_weight = weight is not None and ctx.needs_input_grad[1]
        needs_bias = bias is not None and ctx.needs_input_grad[2]
        try:
            grad_x, grad_weight, grad_bias = _layer_norm_backward(
                grad_out, x2d, weight, mean, rstd, needs_weight, needs_bias, bias
            )
        except Exception as err:
            grad_x, grad_weight, grad_bias = _backend.reference_backward(
                LAYER_NORM, err, lambda x, w, b: layer_norm_reference(x, w, b, ctx.eps),
                (x2d.view(ctx.shape), weight, bias), (grad_out,),
            )
        return grad_x.view(ctx.shape), grad_weight, grad_bias, None


def _layer_norm_backward(grad_out, x2d, weight, mean, rstd, needs_weight, needs_bias, bias):
    n_rows, n_cols = x2d.shape
    grad_out2d = rows_view(grad_out)
    grad_x = torch.empty_like(x2d)
    block_rows, block_cols, num_warps = row_block_config(n_cols)
    n_programs = persistent_programs(cdiv(n_rows, block_rows), x2d.device)
    partial = lambda needed: (  # noqa: E731
        torch.empty((n_programs, n_cols), dtype=torch.float32, device=x2d.device) if needed else rstd
    )
    grad_weight_partial, grad_bias_partial = partial(needs_weight), partial(needs_bias)
    _layer_norm_bwd_kernel[(n_programs,)](
        grad_out2d, x2d, weight if weight is not None else x2d, mean, rstd, grad_x,
        grad_weight_partial, grad_bias_partial,
        n_rows, n_cols, grad_out2d.stride(0), x2d.stride(0), grad_x.stride(0),
        HAS_WEIGHT=weight is not None,
        COMPUTE_GRAD_WEIGHT=needs_weight,
        COMPUTE_GRAD_BIAS=needs_bias,
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        num_warps=num_warps,
    )
    grad_weight = grad_weight_partial.sum(0).to(weight.dtype) if needs_weight else None
    grad_bias = grad_bias_partial.sum(0).to(bias.dtype) if needs_bias else None
    return grad_x, grad_weight, grad_bias


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """LayerNorm over the last dim of `x`, ``(x - mean) * rstd * weight + bias``.

    Args:
        x: input ``(..., hidden)``, float16/bfloat16/float32 (float64 runs the reference); need not
            be contiguous.
        weight: ``(hidden,)`` scale, or None for none.
        bias: ``(hidden,)`` shift, or None for none.
        eps: added to the variance.

    Returns:
        A tensor of the shape and dtype of `x`.
    """
    check_float("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the normalised one), got a scalar")
    params = [t for t in (weight, bias) if t is not None]
    if weight is not None:
        check_vector("weight", weight, x.shape[-1], x.device)
    if bias is not None:
        check_vector("bias", bias, x.shape[-1], x.device)
    check_eps(eps)
    if x.numel() == 0:
        return layer_norm_reference(x, weight, bias, eps)
    unsupported = None
    if any(t.dtype not in KERNEL_DTYPES for t in [x, *params]):
        unsupported = "float64 runs on the reference"
    elif x.shape[-1] > MAX_KERNEL_COLS:
        unsupported = f"last dim {x.shape[-1]} is wider than the kernel's {MAX_KERNEL_COLS}"
    return _backend.dispatch(
        LAYER_NORM, _LayerNormFunction.apply, layer_norm_reference, x, weight, bias, float(eps),
        device=x.device, unsupported=unsupported,
    )
