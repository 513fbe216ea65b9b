"""DoRA's weight norm and output scale (weight-decomposed LoRA, as PEFT computes it).

    dora_norm(W, A, B, s)      = ‖W_j + s · (B A)_j‖₂ for each output row j        (fp32, no gradient)
    dora_scale(z, m, n, bias)  = z · (m / n) + bias, per output column

A DoRA linear is ``dora_scale(x Wᵀ + s · (x Aᵀ) Bᵀ, m, dora_norm(W, A, B, s), bias)``: the LoRA
linear's output rescaled per output feature by the learned magnitude `m` over the norm of the
adapted weight. As in PEFT (and section 4.3 of the DoRA paper) the norm is treated as a constant:
it gets no gradient, so `m`, the LoRA output and the bias are all that backward reaches.

``dora_norm`` forms each tile of ``B A`` in registers (a small fp32 dot) and adds it to the
weight tile, so the adapted weight ``W + s B A`` never exists (PEFT builds it whole, and an
``in × in`` identity to get ``B A``, in every forward). ``dora_scale``'s backward writes
``dz = dy · m / n`` and reduces ``Σ dy · z / n`` (the magnitude's gradient) and ``Σ dy`` (the
bias's) in the same pass, as per-row-chunk partial sums added up afterwards (no atomics: the
result does not depend on scheduling). The LoRA ops (:mod:`tigon.ops.composite.lora`) run these
kernels inside their own forward and backward (:data:`DORA_NORM`, :data:`DORA_SCALE`,
:data:`DORA_SCALE_BACKWARD`).
"""

from __future__ import annotations

import torch

from tigon.ops._checks import check_device, check_float, check_vector, rows_view
from tigon.ops._dispatch import Op, backward_fallback, tl, triton
from tigon.ops._launch import cdiv, next_power_of_2

NORM_BLOCK_ROWS, NORM_BLOCK_COLS = 16, 128  # tl.dot takes 16 rows at least
SCALE_BLOCK_ROWS, SCALE_BLOCK_COLS = 16, 128
ROWS_PER_PROGRAM = 256  # rows each backward program reduces over (its share of the partial sums)
NUM_WARPS = 4


@triton.jit
def _dora_norm_kernel(
    weight_ptr, lora_a_ptr, lora_b_ptr, out_ptr,
    n_rows, n_cols, rank, weight_row_stride, scaling,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    ranks = tl.arange(0, BLOCK_RANK)
    total = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_COLS):
        cols = start + tl.arange(0, BLOCK_COLS)
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        weight = tl.load(weight_ptr + rows[:, None] * weight_row_stride + cols[None, :], mask=mask, other=0.0)
        delta = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_RANK):
            k = r0 + ranks
            b = tl.load(lora_b_ptr + rows[:, None] * rank + k[None, :], mask=row_mask[:, None] & (k < rank)[None, :],
                        other=0.0).to(tl.float32)
            a = tl.load(lora_a_ptr + k[:, None] * n_cols + cols[None, :], mask=(k < rank)[:, None] & col_mask[None, :],
                        other=0.0).to(tl.float32)
            # Full fp32 products (no TF32): the norm is compared against PEFT's.
            delta = tl.dot(b, a, delta, input_precision="ieee")
        adapted = weight.to(tl.float32) + scaling * delta
        total += adapted * adapted
    tl.store(out_ptr + rows, tl.sqrt(tl.sum(total, axis=1)), mask=row_mask)


@triton.jit
def _dora_scale_fwd_kernel(
    z_ptr, magnitude_ptr, norm_ptr, bias_ptr, out_ptr,
    n_rows, n_cols, z_row_stride, out_row_stride,
    HAS_BIAS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    scale = tl.load(magnitude_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) / tl.load(
        norm_ptr + cols, mask=col_mask, other=1.0
    )
    z = tl.load(z_ptr + rows[:, None] * z_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = z * scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * out_row_stride + cols[None, :], out, mask=mask)


@triton.jit
def _dora_scale_bwd_kernel(
    grad_out_ptr, z_ptr, magnitude_ptr, norm_ptr, grad_z_ptr, grad_magnitude_partial_ptr, grad_bias_partial_ptr,
    n_rows, n_cols, grad_out_row_stride, z_row_stride, grad_z_row_stride,
    ROWS_PER_PROGRAM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    chunk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    norm = tl.load(norm_ptr + cols, mask=col_mask, other=1.0)
    scale = tl.load(magnitude_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) / norm
    magnitude_acc = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    bias_acc = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    first = chunk.to(tl.int64) * ROWS_PER_PROGRAM
    for offset in range(0, tl.minimum(ROWS_PER_PROGRAM, n_rows - first), BLOCK_ROWS):
        rows = first + offset + tl.arange(0, BLOCK_ROWS)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        grad_out = tl.load(grad_out_ptr + rows[:, None] * grad_out_row_stride + cols[None, :], mask=mask, other=0.0)
        grad_out = grad_out.to(tl.float32)
        z = tl.load(z_ptr + rows[:, None] * z_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(grad_z_ptr + rows[:, None] * grad_z_row_stride + cols[None, :], grad_out * scale[None, :], mask=mask)
        magnitude_acc += grad_out * z
        if HAS_BIAS:
            bias_acc += grad_out
    tl.store(grad_magnitude_partial_ptr + chunk * n_cols + cols, tl.sum(magnitude_acc, axis=0) / norm, mask=col_mask)
    if HAS_BIAS:
        tl.store(grad_bias_partial_ptr + chunk * n_cols + cols, tl.sum(bias_acc, axis=0), mask=col_mask)


def dora_norm_reference(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """‖W + s·B·A‖ per row, in fp32 by PyTorch (PEFT's ``get_weight_norm``): oracle and fallback."""
    return torch.linalg.norm(weight.float() + scaling * (lora_b.float() @ lora_a.float()), dim=1)


def dora_scale_reference(
    z: torch.Tensor, magnitude: torch.Tensor, weight_norm: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``z · (m / n) + bias`` in fp32, rounded to z's dtype (the norm detached): oracle and fallback."""
    out = z.float() * (magnitude.float() / weight_norm.detach().float())
    if bias is not None:
        out = out + bias.float()
    return out.to(z.dtype)


def dora_scale_backward_reference(
    grad_out: torch.Tensor, z: torch.Tensor, magnitude: torch.Tensor, weight_norm: torch.Tensor, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dz, dm, dbias) of :func:`dora_scale_reference` for 2-D `grad_out` and `z`, by PyTorch;
    dm and dbias in fp32 (None for dbias without a bias)."""
    grad = grad_out.float()
    grad_z = (grad * (magnitude.float() / weight_norm)).to(grad_out.dtype)
    grad_magnitude = (grad * z.float()).sum(0) / weight_norm
    return grad_z, grad_magnitude, grad.sum(0) if has_bias else None


def dora_norm_launch(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """:func:`dora_norm` by its kernel (row-major weight rows; contiguous adapters)."""
    n_rows, n_cols = weight.shape
    weight = rows_view(weight)
    out = torch.empty(n_rows, dtype=torch.float32, device=weight.device)
    rank = lora_a.shape[0]
    _dora_norm_kernel[(cdiv(n_rows, NORM_BLOCK_ROWS),)](
        weight, lora_a.contiguous(), lora_b.contiguous(), out,
        n_rows, n_cols, rank, weight.stride(0), float(scaling),
        BLOCK_ROWS=NORM_BLOCK_ROWS, BLOCK_COLS=NORM_BLOCK_COLS, BLOCK_RANK=min(64, max(16, next_power_of_2(rank))),
        num_warps=NUM_WARPS,
    )
    return out


def dora_scale_forward(
    z: torch.Tensor, magnitude: torch.Tensor, weight_norm: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``z · (m / n) + bias`` for 2-D `z` by the forward kernel, outside autograd (a new tensor)."""
    n_rows, n_cols = z.shape
    out = torch.empty((n_rows, n_cols), dtype=z.dtype, device=z.device)
    _dora_scale_fwd_kernel[(cdiv(n_rows, SCALE_BLOCK_ROWS), cdiv(n_cols, SCALE_BLOCK_COLS))](
        z, magnitude, weight_norm, magnitude if bias is None else bias, out,
        n_rows, n_cols, z.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_ROWS=SCALE_BLOCK_ROWS, BLOCK_COLS=SCALE_BLOCK_COLS, num_warps=NUM_WARPS,
    )
    return out


def dora_scale_backward_launch(
    grad_out: torch.Tensor, z: torch.Tensor, magnitude: torch.Tensor, weight_norm: torch.Tensor, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dz, dm, dbias) for 2-D `grad_out` and `z` by the backward kernel: dz in grad_out's dtype,
    dm and dbias in fp32 (dbias None without a bias)."""
    n_rows, n_cols = z.shape
    chunks = cdiv(n_rows, ROWS_PER_PROGRAM)
    grad_z = torch.empty((n_rows, n_cols), dtype=grad_out.dtype, device=z.device)
    partial = torch.empty((2 if has_bias else 1, chunks, n_cols), dtype=torch.float32, device=z.device)
    _dora_scale_bwd_kernel[(chunks, cdiv(n_cols, SCALE_BLOCK_COLS))](
        grad_out, z, magnitude, weight_norm, grad_z, partial[0], partial[-1],
        n_rows, n_cols, grad_out.stride(0), z.stride(0), grad_z.stride(0),
        ROWS_PER_PROGRAM=ROWS_PER_PROGRAM, HAS_BIAS=has_bias,
        BLOCK_ROWS=SCALE_BLOCK_ROWS, BLOCK_COLS=SCALE_BLOCK_COLS, num_warps=NUM_WARPS,
    )
    sums = partial.sum(1)
    return grad_z, sums[0], sums[1] if has_bias else None


def _reference_point(ctx, saved):
    z, magnitude, weight_norm, bias = saved
    return DORA_SCALE, dora_scale_reference, (z.view(ctx.shape), magnitude, weight_norm, bias)


class _DoraScaleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, magnitude, weight_norm, bias):
        z2d = rows_view(z)
        ctx.save_for_backward(z2d, magnitude, weight_norm, bias)
        ctx.shape = z.shape
        return dora_scale_forward(z2d, magnitude, weight_norm, bias).view(z.shape)

    @staticmethod
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_out):
        z2d, magnitude, weight_norm, bias = saved
        grad_z, grad_magnitude, grad_bias = dora_scale_backward_launch(
            rows_view(grad_out), z2d, magnitude, weight_norm, bias is not None
        )
        needs = ctx.needs_input_grad
        return (
            grad_z.view(ctx.shape) if needs[0] else None,
            grad_magnitude.to(magnitude.dtype) if needs[1] else None,
            None,
            grad_bias.to(bias.dtype) if needs[3] else None,
        )


DORA_NORM = Op("dora_norm", dora_norm_launch, dora_norm_reference)
DORA_SCALE = Op("dora_scale", _DoraScaleFunction.apply, dora_scale_reference)
DORA_SCALE_BACKWARD = Op(
    "dora_scale_backward", dora_scale_backward_launch, dora_scale_backward_reference, parts=(DORA_SCALE,)
)


def dora_norm(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """The DoRA weight norm ``‖W_j + s (B A)_j‖₂`` of every output row j, in fp32, without forming
    ``W + s B A`` (see the module docstring). It has no gradient (DoRA detaches it).

    Args:
        weight: ``(out, in)`` base weight (float16/bfloat16/float32; float64 runs the reference).
        lora_a: ``(r, in)``; lora_b: ``(out, r)``; any float dtype, on weight's device.
        scaling: the adapter's scale.

    Returns:
        ``(out,)`` float32.
    """
    for name, t in (("weight", weight), ("lora_a", lora_a), ("lora_b", lora_b)):
        check_float(name, t)
        if t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D matrix, got shape {tuple(t.shape)}")
        check_device(name, t, weight.device)
    out_features, in_features = weight.shape
    if lora_a.shape[1] != in_features or tuple(lora_b.shape) != (out_features, lora_a.shape[0]):
        raise ValueError(f"lora_a must be (r, {in_features}) and lora_b ({out_features}, r), got "
                         f"{tuple(lora_a.shape)} and {tuple(lora_b.shape)}")
    with torch.no_grad():
        return DORA_NORM(None, weight, lora_a, lora_b, scaling)


def dora_scale(
    z: torch.Tensor, magnitude: torch.Tensor, weight_norm: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """DoRA's output scale ``z · (m / n) + bias`` per output feature, the norm `n` treated as a
    constant (no gradient), as PEFT's DoRA does.

    Args:
        z: ``(..., out)`` the LoRA linear's output without its bias, float16/bfloat16/float32.
        magnitude: ``(out,)`` DoRA's magnitude vector (PEFT's ``lora_magnitude_vector``).
        weight_norm: ``(out,)`` :func:`dora_norm` of the adapted weight (float32).
        bias: optional ``(out,)`` base bias.

    Returns:
        ``(..., out)`` in z's dtype; gradients for z, magnitude and bias.
    """
    check_float("z", z)
    if z.dim() == 0:
        raise ValueError("z must have at least one dimension (the features), got a scalar")
    width = z.shape[-1]
    check_vector("magnitude", magnitude, width, z.device)
    check_vector("weight_norm", weight_norm, width, z.device)
    if weight_norm.dtype != torch.float32:
        raise ValueError(f"weight_norm must be float32 (dora_norm's output), got {weight_norm.dtype}")
    if bias is not None:
        check_vector("bias", bias, width, z.device)
    return DORA_SCALE(None, z, magnitude, weight_norm.detach(), bias)
