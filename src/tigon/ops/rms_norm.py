"""RMSNorm, and residual add + RMSNorm, in one pass over each row.

    rms_norm(x, w)         = x / sqrt(mean(x^2) + eps) * (offset + w)
    add_rms_norm(x, r, w)  = (rms_norm(x + r, w), x + r)

`casting` picks where rounding to the input dtype happens, to match each model family exactly:
    "llama"  normalise in fp32, round to the input dtype, then multiply by the weight
             (HF LlamaRMSNorm; the output dtype is the promotion of input and weight dtypes);
    "gemma"  everything in fp32, round once at the end (HF GemmaRMSNorm with offset=1.0);
    "none"   the plain formula in the input dtype (the kernel still accumulates in fp32).

Forward saves the row's input (for add_rms_norm, the sum x + r, which is an output anyway) and one
fp32 rstd per row; backward recomputes the normalised row from them.

With `fp8` the forward kernel also writes the normed output quantised to FP8 e4m3 with one scale per
row (or only each row's amax), as torchao.float8 would quantise it for the next linear, in the same
pass (:mod:`tigon.ops._fp8`): the output is still written in its dtype, which autograd, the
residual stream and a rowwise weight gradient (scaled along the other axis) need.

A NaN or +-inf anywhere in a row (of x, or of x + r) makes that whole output row NaN, and its
gradients, on every path and device (torch's own rms_norm gives NaN there on CUDA but 0 for the
row's finite elements on the CPU). So does a row whose sum of squares overflows fp32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from tigon.ops._checks import (
    KERNEL_DTYPES, check_choice, check_eps, check_float, check_vector, input_grad_rows, rows_view,
)
from tigon.ops._dispatch import Op, backward_fallback, empty_if, library_op, tl, triton
from tigon.ops._fp8 import (
    MODE_CODES, SMALL_AMAX, SMALL_AMAX_SCALE, Float8Rows, check_fp8_mode, fp8_kernel_args, fp8_rows_buffers,
    fp8_rows_reference, store_fp8_rows,
)
from tigon.ops._launch import cdiv, launched, persistent_programs, row_block_config

CASTINGS = ("llama", "gemma", "none")
MAX_KERNEL_COLS = 65536  # a whole row lives in registers; wider rows run the reference


@launched
@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, rstd_ptr, fp8_ptr, fp8_scale_ptr, fp8_amax_ptr,
    n_rows, n_cols,
    x_row_stride, residual_row_stride, out_row_stride, sum_row_stride,
    eps, offset, small_amax, small_amax_scale,
    CASTING: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]

    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(
            residual_ptr + rows[:, None] * residual_row_stride + cols[None, :], mask=mask, other=0.0
        )
        # Round the sum to the input dtype, as the unfused `x + residual` does.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + rows[:, None] * sum_row_stride + cols[None, :], x, mask=mask)
    x = x.to(tl.float32)

    # A NaN or inf in the row (or a sum of squares past fp32's range) makes the whole row NaN, and
    # its gradients, which backward forms from rstd: rsqrt(inf) = 0 would zero its finite elements.
    sum_sq = tl.sum(x * x, axis=1)
    rstd = tl.where(sum_sq < float("inf"), tl.rsqrt(sum_sq / n_cols + eps), float("nan"))
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)

    x_hat = x * rstd[:, None]
    if CASTING == "llama":
        x_hat = x_hat.to(x_ptr.dtype.element_ty).to(tl.float32)
    if HAS_WEIGHT:
        out = x_hat * (tl.load(weight_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32) + offset)[None, :]
    else:
        out = x_hat * (1.0 + offset)
    tl.store(out_ptr + rows[:, None] * out_row_stride + cols[None, :], out, mask=mask)
    if FP8 != 0:
        # Quantised as the next layer reads the output: rounded to its dtype first.
        store_fp8_rows(
            out.to(out_ptr.dtype.element_ty).to(tl.float32), rows, cols, row_mask, mask,
            fp8_ptr, n_cols, fp8_scale_ptr, fp8_amax_ptr, small_amax, small_amax_scale, FP8,
        )


@launched
@triton.jit
def _rms_norm_bwd_kernel(
    grad_out_ptr, grad_sum_ptr, x_ptr, weight_ptr, rstd_ptr, grad_x_ptr, grad_weight_partial_ptr,
    n_rows, n_cols,
    grad_out_row_stride, grad_sum_row_stride, x_row_stride, grad_x_row_stride,
    offset,
    CASTING: tl.constexpr,
    HAS_GRAD_SUM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_GRAD_WEIGHT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # Persistent: each program walks row blocks pid, pid + n_programs, ... and keeps its share of
    # the weight gradient in registers, written once as one row of a (n_programs, n_cols) buffer.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    grad_weight_acc = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)

    for block in range(pid, tl.cdiv(n_rows, BLOCK_ROWS), tl.num_programs(0)):
        rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        grad_out = tl.load(
            grad_out_ptr + rows[:, None] * grad_out_row_stride + cols[None, :], mask=mask, other=0.0
        ).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)

        x_hat = x * rstd[:, None]
        if COMPUTE_GRAD_WEIGHT:
            if CASTING == "llama":
                grad_weight_acc += grad_out * x_hat.to(x_ptr.dtype.element_ty).to(tl.float32)
            else:
                grad_weight_acc += grad_out * x_hat
        if HAS_WEIGHT:
            grad_x_hat = grad_out * weight[None, :]
        else:
            grad_x_hat = grad_out * (1.0 + offset)
        mean_dot = tl.sum(grad_x_hat * x_hat, axis=1) / n_cols
        grad_x = (grad_x_hat - x_hat * mean_dot[:, None]) * rstd[:, None]
        if HAS_GRAD_SUM:
            grad_x += tl.load(
                grad_sum_ptr + rows[:, None] * grad_sum_row_stride + cols[None, :], mask=mask, other=0.0
            ).to(tl.float32)
        # In place (inplace_backward) grad_x_ptr is grad_out_ptr: this program read these elements above.
        tl.store(grad_x_ptr + rows[:, None] * grad_x_row_stride + cols[None, :], grad_x, mask=mask)

    if COMPUTE_GRAD_WEIGHT:
        tl.store(grad_weight_partial_ptr + pid * n_cols + cols, tl.sum(grad_weight_acc, axis=0), mask=col_mask)


def _reference_rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(mean(x^2) + eps)`` per row, NaN where the mean square is not finite: the kernel's
    rule, which torch's own norms follow on the GPU but not on the CPU (there an inf gives 0s)."""
    mean_square = x.pow(2).mean(-1, keepdim=True)
    return torch.where(torch.isfinite(mean_square), torch.rsqrt(mean_square + eps), float("nan"))


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting: str = "llama",
    inplace_backward: bool = False,
    fp8: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, Float8Rows]:
    """RMSNorm written the obvious way in PyTorch: the test oracle and the fallback. A row holding
    a NaN or inf gives a NaN row (and NaN gradients for it), as the kernel does. Without a weight
    the scale is ``offset + 1``; `inplace_backward` is the kernel's memory option, nothing here.
    With `fp8`, ``(out, fp8_rows_reference(out, fp8))``."""
    out = _rms_norm_plain(x, weight, eps, offset, casting)
    return out if fp8 is None else (out, fp8_rows_reference(out, fp8))


def _rms_norm_plain(x, weight, eps, offset, casting):
    if casting == "none":
        return x * _reference_rstd(x, eps) * (offset + (1.0 if weight is None else weight))
    compute = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for a float64 oracle
    x_up = x.to(compute)
    x_hat = x_up * _reference_rstd(x_up, eps)
    if casting == "gemma":
        return (x_hat * (offset + (1.0 if weight is None else weight.to(compute)))).to(x.dtype)
    if weight is None:
        return (offset + 1.0) * x_hat.to(x.dtype)
    return (offset + weight) * x_hat.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting: str = "llama",
    inplace_backward: bool = False,
    fp8: str | None = None,
) -> tuple[torch.Tensor, ...]:
    """``(rms_norm(x + residual), x + residual)`` in PyTorch, and with `fp8` the normed output's
    :class:`Float8Rows` third."""
    total = x + residual
    out = _rms_norm_plain(total, weight, eps, offset, casting)
    return (out, total) if fp8 is None else (out, total, fp8_rows_reference(out, fp8))


class NormedInput(NamedTuple):
    """Says that a tensor is ``rms_norm(source, weight, eps, offset=offset, casting=casting)``.

    An op consuming such a tensor (:func:`tigon.ops.composite.glu_mlp.glu_mlp`) may save `source`
    for backward instead of it and recompute it there: the norm keeps `source` for its own backward
    anyway, so one hidden-sized tensor per layer is not kept twice. The recomputation runs the same kernel on
    the same rows, so it is bit for bit the tensor of the forward.
    """

    source: torch.Tensor
    weight: torch.Tensor | None
    eps: float
    offset: float
    casting: str

    def recompute(self) -> torch.Tensor:
        with torch.no_grad():
            return rms_norm(self.source, self.weight, self.eps, offset=self.offset, casting=self.casting)


def keep_normed(ctx, x: torch.Tensor, normed: NormedInput | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What an op consuming `x` saves of it for backward: `x`, or, when `normed` says `x` is an
    RMSNorm's output, that norm's input and weight (kept by the norm anyway), which
    :func:`restore_normed` renormalises. Save both tensors it returns. An `x` that needs no gradient
    came from a norm that saved nothing (its input and weight frozen, as a first layer's are under
    LoRA): it is kept itself."""
    if normed is None or not x.requires_grad:
        ctx.norm_config = None
        return x, None
    ctx.norm_config = (normed.eps, normed.offset, normed.casting, x.dtype)
    return normed.source, normed.weight


def restore_normed(ctx, first: torch.Tensor, second: torch.Tensor | None) -> torch.Tensor:
    """`x` again from the two tensors :func:`keep_normed` returned, saved and unpacked: the same
    kernel on the same rows, so bit for bit the forward's (in `x`'s dtype, which an autocast cast
    before the op may have made other than the norm's; in the norm input's shape)."""
    if ctx.norm_config is None:
        return first
    eps, offset, casting, dtype = ctx.norm_config
    return NormedInput(first, second, eps, offset, casting).recompute().to(dtype)


def check_normed_input(x: torch.Tensor, normed_input: NormedInput) -> None:
    """Raise ValueError unless `normed_input` can say how `x` was normed: a NormedInput whose
    source has x's shape and device and whose weight (if any) is a vector of x's width."""
    if not isinstance(normed_input, NormedInput):
        raise ValueError(f"normed_input must be a tigon.ops.NormedInput, got {type(normed_input).__name__}")
    source, weight = normed_input.source, normed_input.weight
    if source.shape != x.shape or source.device != x.device:
        raise ValueError(
            f"normed_input.source must have x's shape {tuple(x.shape)} on {x.device}, "
            f"got {tuple(source.shape)} on {source.device}"
        )
    if weight is not None:
        check_vector("normed_input.weight", weight, x.shape[-1], x.device)


def _output_dtype(x: torch.Tensor, weight: torch.Tensor | None, casting: str) -> torch.dtype:
    return x.dtype if casting == "gemma" or weight is None else torch.promote_types(x.dtype, weight.dtype)


def _forward_buffers(x, residual, weight, casting):
    """The forward kernel's outputs, unwritten: ``(normed, sum or None, rstd)``, rstd one fp32 value
    per row. Allocated in x's shape (no views to make of them): contiguous, row stride n_cols."""
    out = torch.empty(x.shape, dtype=_output_dtype(x, weight, casting), device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    return out, total, rstd


def rms_norm_rows(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float, offset: float,
    casting: str, fp8: str | None = None, fp8_rows: Float8Rows | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward kernel outside autograd: ``(normed, source, rstd)``, where `source` is the
    normalised input (the sum ``x + residual`` when there is a residual, else `x` as 2-D rows)
    and `rstd` one fp32 value per row: what :func:`rms_norm_backward` takes. With `fp8` the
    kernel also fills `fp8_rows` (from :func:`tigon.ops._fp8.fp8_rows_buffers`) for `normed`."""
    x2d = rows_view(x)
    n_rows, n_cols = x2d.shape
    out, total, rstd = _forward_buffers(x, residual, weight, casting)
    if residual is not None:
        residual2d = rows_view(residual)
    else:
        residual2d = total = x2d  # unused by the kernel; any pointer will do
    block_rows, block_cols, num_warps = row_block_config(n_cols)
    _rms_norm_fwd_kernel[(cdiv(n_rows, block_rows),)](
        x2d, residual2d, weight if weight is not None else x2d, out, total, rstd, *fp8_kernel_args(fp8_rows, rstd),
        n_rows, n_cols,
        x2d.stride(0), residual2d.stride(0), n_cols, n_cols if residual is not None else x2d.stride(0),
        eps, offset, SMALL_AMAX, SMALL_AMAX_SCALE,
        CASTING=casting,
        HAS_RESIDUAL=residual is not None,
        HAS_WEIGHT=weight is not None,
        FP8=MODE_CODES[fp8],
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        num_warps=num_warps,
    )
    return out, total, rstd


def _norm_and_sum(x, residual, weight, eps, offset, casting, inplace_backward=False, fp8=None):
    """What :class:`_RMSNormFunction` returns (its differentiable outputs), by the references."""
    if residual is None:
        return _rms_norm_plain(x, weight, eps, offset, casting), None
    return add_rms_norm_reference(x, residual, weight, eps, offset, casting)


def _reference_point(ctx, saved):
    source, weight, _ = saved
    eps, offset, casting, shape, has_residual = ctx.config
    x = source.view(shape)
    # x and the residual enter only through their sum, so (sum, 0) stands in for them.
    residual = torch.zeros_like(x) if has_residual else None
    inputs = (x, residual, weight, eps, offset, casting, False, None)
    return (ADD_RMS_NORM if has_residual else RMS_NORM), _norm_and_sum, inputs


def _grads(ctx, saved, grad_out, grad_sum, backward):
    """The Function's (and the library op's) input gradients, by `backward` (the kernel's
    launcher, or its library op)."""
    source, weight, rstd = saved
    eps, offset, casting, shape, has_residual = ctx.config
    need_weight = ctx.needs_input_grad[2]
    grad_x, grad_weight = backward(
        grad_out, grad_sum if has_residual else None, source, weight, rstd, offset, casting, need_weight
    )
    grad_x = grad_x.view(shape)
    return grad_x, (grad_x if has_residual else None), (grad_weight if need_weight else None), None, None, None, None, None


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, casting, inplace_backward, fp8=None):
        fp8_rows = fp8_rows_buffers(x, fp8)
        out, source, rstd = rms_norm_rows(x, residual, weight, eps, offset, casting, fp8, fp8_rows)
        # Backward needs the normalised row's input: the sum when there is a residual.
        ctx.save_for_backward(source, weight, rstd)
        ctx.config = (eps, offset, casting, x.shape, residual is not None)
        ctx.inplace_backward = inplace_backward
        total = source if residual is not None else None
        # fp8_rows is no tensor to autograd: its tensors get no gradient, as quantised values.
        return (out, total) if fp8 is None else (out, total, fp8_rows)

    @staticmethod
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_out, grad_sum, *_):
        backward = functools.partial(rms_norm_backward, in_place=ctx.inplace_backward)
        return _grads(ctx, saved, grad_out, grad_sum, backward)


def _backward_block_config(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_COLS, num_warps) of the backward. Rows narrower than 4096 go in tiles of
    8192 elements on 4 warps: on the H200 (scripts/tune_norm_backward.py, 2026-11-29, CUDA-graph
    times) that took 8192 x 2048 from 0.054 to 0.040 ms and 8192 x 1024 from 0.032 to 0.028 ms;
    from 4096 columns on, the forward's tiles were already within 6% of the best."""
    block_rows, block_cols, num_warps = row_block_config(n_cols)
    if block_cols >= 4096:
        return block_rows, block_cols, num_warps
    return max(1, 8192 // block_cols), block_cols, 4


def rms_norm_backward(
    grad_out, grad_sum, source, weight, rstd, offset, casting, compute_grad_weight, in_place=False
):
    """(dx as 2-D rows, dweight or None) by the backward kernel, from the `source` the forward
    normalised (any shape, or its 2-D rows) and its `rstd`; `grad_sum` (or None) is the gradient
    reaching the sum ``x + residual`` directly.

    With `in_place`, dx is written over `grad_out` where it can hold it (:func:`input_grad_rows`)."""
    x2d = rows_view(source)
    n_rows, n_cols = x2d.shape
    grad_out2d = rows_view(grad_out)
    grad_sum2d = rows_view(grad_sum) if grad_sum is not None else grad_out2d
    grad_x = input_grad_rows(grad_out, grad_out2d, x2d, in_place)
    block_rows, block_cols, num_warps = _backward_block_config(n_cols)
    n_programs = persistent_programs(cdiv(n_rows, block_rows), x2d.device)
    grad_weight_partial = (
        torch.empty((n_programs, n_cols), dtype=torch.float32, device=x2d.device)
        if compute_grad_weight
        else rstd  # unused by the kernel
    )
    _rms_norm_bwd_kernel[(n_programs,)](
        grad_out2d, grad_sum2d, x2d, weight if weight is not None else x2d, rstd, grad_x, grad_weight_partial,
        n_rows, n_cols,
        grad_out2d.stride(0), grad_sum2d.stride(0), x2d.stride(0), grad_x.stride(0),
        offset,
        CASTING=casting,
        HAS_GRAD_SUM=grad_sum is not None,
        HAS_WEIGHT=weight is not None,
        COMPUTE_GRAD_WEIGHT=compute_grad_weight,
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        num_warps=num_warps,
    )
    grad_weight = grad_weight_partial.sum(0).to(weight.dtype) if compute_grad_weight else None
    return grad_x, grad_weight


def check_rms_norm(x, weight, eps, casting, residual=None) -> str | None:
    """Validate the arguments; return why the kernel cannot take them, if it cannot."""
    check_float("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the normalised one), got a scalar")
    if weight is not None:
        check_vector("weight", weight, x.shape[-1], x.device)
    check_eps(eps)
    check_choice("casting", casting, CASTINGS)
    if residual is not None:
        check_float("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
        if residual.dtype != x.dtype:
            raise ValueError(f"residual must have the dtype of x ({x.dtype}), got {residual.dtype}")
        if residual.device != x.device:
            raise ValueError(f"residual is on {residual.device}, expected {x.device} like x")
    if weight is not None and weight.dtype not in KERNEL_DTYPES:
        return f"weight dtype {weight.dtype} runs on the reference"
    if x.shape[-1] > MAX_KERNEL_COLS:
        return f"last dim {x.shape[-1]} is wider than the kernel's {MAX_KERNEL_COLS}"
    return None


def _rms_norm_kernel(x, weight, eps, offset, casting, inplace_backward=False, fp8=None):
    outputs = _RMSNormFunction.apply(x, None, weight, float(eps), float(offset), casting, inplace_backward, fp8)
    return outputs[0] if fp8 is None else (outputs[0], outputs[2])


def _add_rms_norm_kernel(x, residual, weight, eps, offset, casting, inplace_backward=False, fp8=None):
    return _RMSNormFunction.apply(x, residual, weight, float(eps), float(offset), casting, inplace_backward, fp8)


# Inside torch.compile: the same launchers as library ops, with the Function's gradients. The
# library ops are functional, so there the backward is never in place.
def _forward_fake(x, residual, weight, eps, offset, casting):
    out, total, rstd = _forward_buffers(x, residual, weight, casting)
    return out, (total if total is not None else x.new_empty(0)), rstd


@library_op(
    "rms_norm",
    "(Tensor x, Tensor? residual, Tensor? weight, float eps, float offset, str casting) -> (Tensor, Tensor, Tensor)",
    _forward_fake,
)
def _forward_op(x, residual, weight, eps, offset, casting):
    out, total, rstd = rms_norm_rows(x, residual, weight, eps, offset, casting)
    return out, (total if residual is not None else x.new_empty(0)), rstd


def _backward_fake(grad_out, grad_sum, source, weight, rstd, offset, casting, compute_grad_weight):
    return source.new_empty(source.shape), empty_if(compute_grad_weight, source if weight is None else weight)


@library_op(
    "rms_norm_backward",
    "(Tensor grad_out, Tensor? grad_sum, Tensor source, Tensor? weight, Tensor rstd, float offset, str casting, "
    "bool compute_grad_weight) -> (Tensor, Tensor)",
    _backward_fake,
)
def _backward_op(grad_out, grad_sum, source, weight, rstd, offset, casting, compute_grad_weight):
    grad_x, grad_weight = rms_norm_backward(grad_out, grad_sum, source, weight, rstd, offset, casting, compute_grad_weight)
    if not compute_grad_weight:
        grad_weight = (source if weight is None else weight).new_empty(0)
    return grad_x.view(source.shape), grad_weight


def _setup_context(ctx, inputs, output):
    x, residual, weight, eps, offset, casting = inputs
    ctx.save_for_backward(output[1] if residual is not None else x, weight, output[2])
    ctx.config = (eps, offset, casting, x.shape, residual is not None)


_forward_op.register_autograd(
    lambda ctx, grad_out, grad_sum, _: _grads(ctx, ctx.saved_tensors, grad_out, grad_sum, _backward_op),
    setup_context=_setup_context,
)


# Inside torch.compile the fp8 option runs the reference, whose quantisation inductor fuses itself.
def _rms_norm_compiled(x, weight, eps, offset, casting, inplace_backward=False, fp8=None):
    if fp8 is not None:
        return rms_norm_reference(x, weight, eps, offset, casting, fp8=fp8)
    return _forward_op(x, None, weight, float(eps), float(offset), casting)[0]


def add_rms_norm_compiled(x, residual, weight, eps, offset, casting, inplace_backward=False, fp8=None):
    """add_rms_norm inside torch.compile: the forward library op (add_rms_norm_glu_mlp's too)."""
    if fp8 is not None:
        return add_rms_norm_reference(x, residual, weight, eps, offset, casting, fp8=fp8)
    out, total, _ = _forward_op(x, residual, weight, float(eps), float(offset), casting)
    return out, total


RMS_NORM = Op("rms_norm", _rms_norm_kernel, rms_norm_reference, compiled=_rms_norm_compiled)
ADD_RMS_NORM = Op("add_rms_norm", _add_rms_norm_kernel, add_rms_norm_reference, compiled=add_rms_norm_compiled)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    casting: str = "llama",
    inplace_backward: bool = False,
    fp8: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, Float8Rows]:
    """RMSNorm over the last dim of `x`, scaled by ``offset + weight``.

    Args:
        x: input of any shape ``(..., hidden)``, float16/bfloat16/float32 (float64 runs the
            reference); need not be contiguous.
        weight: ``(hidden,)`` scale, or None for a norm without one (``elementwise_affine=False``:
            the scale is ``offset + 1``).
        eps: added to the mean square before the square root.
        offset: added to `weight` (1.0 for Gemma, whose weights are stored as ``scale - 1``).
        casting: ``"llama"``, ``"gemma"`` or ``"none"``: where rounding to the input dtype
            happens (see the module docstring).
        inplace_backward: write the input gradient over the output gradient's storage instead
            of a new ``x``-sized buffer (one fewer activation-sized tensor at the backward's
            peak). Opt-in, because autograd may hand the same gradient tensor to other readers,
            and the kernel cannot tell: it is safe only when nothing but this norm reads the
            gradient of its output. That holds when the output feeds only ops whose backward
            makes a fresh gradient for it (linear layers, matmuls, or several such consumers,
            whose gradients autograd sums into a buffer of its own). It does not hold when the
            output is added to or concatenated with another tensor whose gradient is still to
            be used (autograd hands ``a + b``'s gradient to both terms as one tensor), is the
            tensor passed to ``.backward(g)`` / ``autograd.grad(..., g)`` (g is overwritten),
            has a hook or ``retain_grad()`` that keeps its gradient, or when the backward is
            differentiated again (``create_graph=True``). The write happens only where the
            output gradient can hold dx (contiguous, of `x`'s dtype: not with ``"llama"``
            casting and a wider weight dtype); elsewhere, on the reference path and inside
            torch.compile the backward allocates as usual. The values are those of the
            out-of-place backward, bit for bit.
        fp8: also quantise the output to FP8 e4m3 in the same pass, as torchao.float8 quantises
            a Float8Linear's input: ``"rowwise"`` (one scale per row), ``"rowwise_pow2"`` (the
            scales floored to powers of two: torchao's rowwise recipes), or ``"amax"`` (only each
            row's amax, from which tensorwise scaling needs no amax pass of its own). See
            :mod:`tigon.ops._fp8`. Inside torch.compile this runs the reference, which inductor
            fuses: inductor does not round the output to its dtype before taking the amax, so
            there the scales are those of the unrounded row (within one rounding of torchao's).
            The FP8 payload is always torchao's quantisation of the output returned, but that
            output is not always bit for bit the one a call without `fp8` returns: on the GPU
            the kernel that also writes FP8 may sum a row's squares in another order (an H100
            at widths 2048 and 4096), so a consumer must not recompute it without `fp8`.

    Returns:
        A tensor of the shape of `x`; dtype of `x` (``"llama"``/``"none"`` promote with the
        weight's dtype, as the HF modules do). With `fp8`, ``(out, Float8Rows)``: the quantised
        output carries no gradient (the output does).
    """
    return RMS_NORM(
        check_rms_norm(x, weight, eps, casting), x, weight, eps, offset, casting, bool(inplace_backward),
        check_fp8_mode(fp8),
    )


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    casting: str = "llama",
    inplace_backward: bool = False,
    fp8: str | None = None,
) -> tuple[torch.Tensor, ...]:
    """Residual add then RMSNorm in one kernel: returns ``(rms_norm(x + residual), x + residual)``,
    and with `fp8` (as for :func:`rms_norm`) the normed output's :class:`Float8Rows` third.

    The sum is rounded to the input dtype before it is normalised, as in the unfused code. Arguments
    are those of :func:`rms_norm`; `residual` has the shape and dtype of `x`. With
    `inplace_backward` the gradient of x and of the residual (one tensor) is written over the
    normed output's gradient, under the conditions :func:`rms_norm` gives for that one; the
    sum's gradient is only read.
    """
    return ADD_RMS_NORM(
        check_rms_norm(x, weight, eps, casting, residual), x, residual, weight, eps, offset, casting,
        bool(inplace_backward), check_fp8_mode(fp8),
    )
