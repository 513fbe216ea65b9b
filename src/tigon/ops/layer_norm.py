"""LayerNorm over the last dim, with optional weight and bias, in one pass over each row.

    layer_norm(x, w, b) = (x - mean(x)) / sqrt(var(x) + eps) * w + b

Computed in fp32 and rounded once to the input dtype, as torch's CUDA LayerNorm does. Forward saves
the input and one fp32 mean and rstd per row; backward recomputes the normalised row. A row whose
variance is not finite (a NaN or +-inf in it, or a variance past fp32's range) is a NaN row, and so
are its gradients.
"""

from __future__ import annotations

import functools

import torch

from tigon.ops._checks import KERNEL_DTYPES, check_eps, check_float, check_vector, input_grad_rows, rows_view
from tigon.ops._dispatch import Op, backward_fallback, empty_if, library_op, tl, triton
from tigon.ops._launch import cdiv, launched, persistent_programs, row_block_config

MAX_KERNEL_COLS = 65536  # a whole row lives in registers; wider rows run the reference


@launched
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
    # NaN for the whole row (and its gradients) when its variance is not finite: a NaN or inf in
    # the row already makes it NaN; one past fp32's range would give rstd = 0 and the bare bias.
    var = tl.sum(centered * centered, axis=1) / n_cols
    rstd = tl.where(var < float("inf"), tl.rsqrt(var + eps), float("nan"))
    tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)

    out = centered * rstd[:, None]
    if HAS_WEIGHT:
        out *= tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * out_row_stride + cols[None, :], out, mask=mask)


@launched
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
        # In place (inplace_backward) grad_x_ptr is grad_out_ptr: this program read these elements above.
        tl.store(grad_x_ptr + rows[:, None] * grad_x_row_stride + cols[None, :], grad_x, mask=mask)

    if COMPUTE_GRAD_WEIGHT:
        tl.store(grad_weight_partial_ptr + pid * n_cols + cols, tl.sum(grad_weight_acc, axis=0), mask=col_mask)
    if COMPUTE_GRAD_BIAS:
        tl.store(grad_bias_partial_ptr + pid * n_cols + cols, tl.sum(grad_bias_acc, axis=0), mask=col_mask)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5,
    inplace_backward: bool = False,
) -> torch.Tensor:
    """LayerNorm in PyTorch, computed in fp32 and rounded once: the test oracle and the fallback.
    A row whose variance is not finite is a NaN row, forward and backward, as in the kernel.
    `inplace_backward` is the kernel's memory option, nothing here."""
    compute = torch.promote_types(x.dtype, torch.float32)
    x_up = x.to(compute)
    # torch's layer_norm gives such a row NaN when it holds a NaN or inf, but 0 (the bare bias)
    # when its variance overflows; a NaN factor on the row makes it NaN on every device.
    variance = x_up.detach().var(-1, correction=0, keepdim=True)
    x_up = x_up * torch.where(torch.isfinite(variance), 1.0, float("nan"))
    return torch.nn.functional.layer_norm(
        x_up,
        (x.shape[-1],),
        weight.to(compute) if weight is not None else None,
        bias.to(compute) if bias is not None else None,
        eps,
    ).to(x.dtype)


def _forward_buffers(x):
    """The forward kernel's outputs, unwritten: ``(out, mean, rstd)``, mean and rstd one fp32 value per row."""
    stats = [torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device) for _ in range(2)]
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), *stats


def layer_norm_rows(x, weight, bias, eps):
    """The forward kernel outside autograd: ``(out, mean, rstd)``."""
    x2d = rows_view(x)
    n_rows, n_cols = x2d.shape
    out, mean, rstd = _forward_buffers(x)
    block_rows, block_cols, num_warps = row_block_config(n_cols)
    _layer_norm_fwd_kernel[(cdiv(n_rows, block_rows),)](
        x2d, weight if weight is not None else x2d, bias if bias is not None else x2d, out, mean, rstd,
        n_rows, n_cols, x2d.stride(0), n_cols, eps,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        num_warps=num_warps,
    )
    return out, mean, rstd


def _reference_point(ctx, saved):
    x, weight, bias, _, _ = saved
    return LAYER_NORM, layer_norm_reference, (x, weight, bias, ctx.eps, False)


def _grads(ctx, saved, grad_out, backward):
    """The Function's (and the library op's) input gradients, by `backward` (the kernel's
    launcher, or its library op)."""
    x, weight, bias, mean, rstd = saved
    needs_weight = weight is not None and ctx.needs_input_grad[1]
    needs_bias = bias is not None and ctx.needs_input_grad[2]
    grad_x, grad_weight, grad_bias = backward(grad_out, x, weight, bias, mean, rstd, needs_weight, needs_bias)
    return (
        grad_x.view(ctx.shape), grad_weight if needs_weight else None, grad_bias if needs_bias else None, None, None
    )


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, inplace_backward):
        out, mean, rstd = layer_norm_rows(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.eps = eps
        ctx.shape = x.shape
        ctx.inplace_backward = inplace_backward
        return out

    @staticmethod
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_out):
        return _grads(ctx, saved, grad_out, functools.partial(layer_norm_backward, in_place=ctx.inplace_backward))


def layer_norm_backward(grad_out, x, weight, bias, mean, rstd, needs_weight, needs_bias, in_place=False):
    """(dx as 2-D rows, dweight or None, dbias or None) by the backward kernel, from the forward's
    input `x` (any shape, or its 2-D rows) and its per-row `mean` and `rstd`. With `in_place`,
    dx is written over `grad_out` where it can hold it (:func:`input_grad_rows`)."""
    x2d = rows_view(x)
    n_rows, n_cols = x2d.shape
    grad_out2d = rows_view(grad_out)
    grad_x = input_grad_rows(grad_out, grad_out2d, x2d, in_place)
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


# Inside torch.compile: the same launchers as library ops, with the Function's gradients (never in
# place: the library ops are functional).
@library_op(
    "layer_norm", "(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)",
    lambda x, weight, bias, eps: _forward_buffers(x),
)
def _forward_op(x, weight, bias, eps):
    return layer_norm_rows(x, weight, bias, eps)


def _backward_fake(grad_out, x, weight, bias, mean, rstd, needs_weight, needs_bias):
    return x.new_empty(x.shape), empty_if(needs_weight, x if weight is None else weight), empty_if(needs_bias, x if bias is None else bias)


@library_op(
    "layer_norm_backward",
    "(Tensor grad_out, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, bool needs_weight, "
    "bool needs_bias) -> (Tensor, Tensor, Tensor)",
    _backward_fake,
)
def _backward_op(grad_out, x, weight, bias, mean, rstd, needs_weight, needs_bias):
    grad_x, grad_weight, grad_bias = layer_norm_backward(grad_out, x, weight, bias, mean, rstd, needs_weight, needs_bias)
    return grad_x.view(x.shape), *(g if g is not None else x.new_empty(0) for g in (grad_weight, grad_bias))


def _setup_context(ctx, inputs, output):
    x, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])
    ctx.eps, ctx.shape = eps, x.shape


_forward_op.register_autograd(
    lambda ctx, grad_out, *_: _grads(ctx, ctx.saved_tensors, grad_out, _backward_op), setup_context=_setup_context
)

LAYER_NORM = Op(
    "layer_norm", _LayerNormFunction.apply, layer_norm_reference,
    compiled=lambda x, weight, bias, eps, inplace_backward: _forward_op(x, weight, bias, eps)[0],
)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    inplace_backward: bool = False,
) -> torch.Tensor:
    """LayerNorm over the last dim of `x`, ``(x - mean) * rstd * weight + bias``.

    Args:
        x: input ``(..., hidden)``, float16/bfloat16/float32 (float64 runs the reference); need not
            be contiguous.
        weight: ``(hidden,)`` scale, or None for none.
        bias: ``(hidden,)`` shift, or None for none.
        eps: added to the variance.
        inplace_backward: write the input gradient over the output gradient's storage, under the
            conditions :func:`tigon.ops.rms_norm.rms_norm` gives (the caller promises that
            nothing else reads that gradient); the values are those of the default backward.

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
    unsupported = None
    if any(t.dtype not in KERNEL_DTYPES for t in params):
        unsupported = "float64 weight or bias runs on the reference"
    elif x.shape[-1] > MAX_KERNEL_COLS:
        unsupported = f"last dim {x.shape[-1]} is wider than the kernel's {MAX_KERNEL_COLS}"
    return LAYER_NORM(unsupported, x, weight, bias, float(eps), bool(inplace_backward))
