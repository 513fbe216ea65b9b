"""Cross-entropy over the last dim of the logits, with label smoothing, z-loss and logit softcapping.

    x'      = softcap * tanh(x / softcap)                  (only when softcap is set; Gemma 2)
    lse     = logsumexp(x')
    loss_i  = lse - (1 - eps) * x'[t] - eps * mean(x') + z_loss_scale * lse^2
            = 0 where t == ignore_index

then "mean" (over the rows whose target is not ignored), "sum" or "none". That is
``torch.nn.functional.cross_entropy(x', t, label_smoothing=eps)`` plus the z-loss, with two
differences: the class dim is the last one (logits ``(..., V)``, target ``(...)``), and a "mean"
over a batch whose every target is ignored is 0 with zero gradients, not NaN. The loss is fp32 for
fp16/bf16 logits (what ``F.cross_entropy(x.float(), t)`` gives); the gradient has the logits' dtype.

Forward reads each row once, walking the vocabulary in blocks with an online logsumexp, and keeps
one fp32 lse per row. Backward reads the row again and writes ``(softmax - onehot) * scale`` into
a fresh buffer: nothing (N, V)-sized is allocated besides the gradient itself, and the gradient is
never written over logits that the caller or autograd may still read. The ``_ce_fwd_kernel`` can
also write the gradient in the same pass (``WRITE_GRAD``), in place if asked: the fused
linear + cross-entropy uses that on its private logits chunks.

Non-finite logits give what torch gives: a NaN anywhere in a row (or a +inf, unless softcap maps
it to softcap) makes that row's loss and gradient row NaN, and so the mean; a -inf logit is a zero
probability (an infinite loss if it is the target's). An ignored row is never read: its loss is 0
as in torch, and its gradient is 0 even where a NaN in it makes torch's NaN (0 * NaN in
log_softmax's backward). A target outside ``[0, V)`` that is not ``ignore_index`` gives its row a
NaN loss and a NaN gradient on every path, kernel and reference (the kernel checks it on the
device, where it reads the target anyway: no host sync); ``TIGON_DEBUG=1`` raises a ValueError
naming the first such target instead.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tigon.ops._checks import check_choice, check_device, check_float, rows_view
from tigon.ops._dispatch import Op, backward_fallback, debug_enabled, library_op, tl, triton
from tigon.ops._launch import launched, next_power_of_2

REDUCTIONS = ("mean", "sum", "none")
TARGET_DTYPES = (torch.int64, torch.int32)
# Vocab elements per loop step, and per thread: the pass that only reads the row (loss and lse)
# keeps 32 elements per thread in flight, a pass that also writes the gradient 16. Chosen on the
# H200 (scripts/tune_cross_entropy.py, 2026-11-29): at 8192 x 128256 bf16 the forward takes
# 0.555 ms (was 0.596 at 4096/8 warps) and the backward 1.059; on a linear-CE chunk of 512 rows
# the pass that writes the gradient in place takes 0.111 ms (was 0.127).
MAX_BLOCK = 8192
ELEMENTS_PER_THREAD = {False: 32, True: 16}


@triton.jit
def _softcapped(x, softcap, HAS_SOFTCAP: tl.constexpr):
    # softcap * tanh(x / softcap), written with exp so no libdevice is needed; it saturates to
    # +-softcap cleanly when exp over- or underflows.
    if HAS_SOFTCAP:
        x = softcap - 2.0 * softcap / (tl.exp(2.0 * x / softcap) + 1.0)
    return x


@triton.jit
def _ce_row_grad(
    logits_ptr, grad_ptr, n_cols, target, valid, lse, scale,
    label_smoothing, z_loss_scale, softcap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # d loss / d x'_j = softmax_j * (1 + 2 z lse) - (1 - eps) [j == t] - eps / V, times d x'/d x.
    # Each element is read and then written by the same thread, so grad_ptr may equal logits_ptr.
    cols = tl.arange(0, BLOCK)
    softmax_scale = scale * (1.0 + 2.0 * z_loss_scale * lse)
    target_scale = scale * (1.0 - label_smoothing)
    smooth = scale * label_smoothing / n_cols
    # An ignored row reads nothing (0 columns); its gradient is 0 whatever the masked values give.
    read_cols = tl.where(valid, n_cols, 0)
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        in_row = offs < n_cols
        x = tl.load(logits_ptr + offs, mask=offs < read_cols, other=0.0).to(tl.float32)
        x = _softcapped(x, softcap, HAS_SOFTCAP)
        g = tl.exp(x - lse) * softmax_scale - tl.where(offs == target, target_scale, 0.0)
        if HAS_SMOOTHING:
            g -= smooth
        if HAS_SOFTCAP:
            g *= 1.0 - (x / softcap) * (x / softcap)
        tl.store(grad_ptr + offs, tl.where(valid, g, 0.0).to(grad_ptr.dtype.element_ty), mask=in_row)


@launched
@triton.jit
def _ce_fwd_kernel(
    logits_ptr, target_ptr, loss_ptr, lse_ptr, grad_ptr, scale_ptr,
    n_cols, logits_row_stride, grad_row_stride, scale_stride,
    ignore_index, label_smoothing, z_loss_scale, softcap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * logits_row_stride
    target = tl.load(target_ptr + row)
    valid = target != ignore_index
    row_cols = tl.where(valid, n_cols, 0)  # an ignored row reads nothing
    cols = tl.arange(0, BLOCK)

    row_max = float("-inf")
    sum_exp = 0.0
    row_sum = 0.0
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        mask = offs < row_cols
        x = tl.load(logits_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.where(mask, _softcapped(x, softcap, HAS_SOFTCAP), float("-inf"))
        new_max = tl.maximum(row_max, tl.max(x, axis=0))
        # While every value seen is -inf (or the row is ignored) there is no finite shift; 0 keeps
        # exp() at 0 instead of NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        sum_exp = sum_exp * tl.exp(row_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
        row_max = new_max
        if HAS_SMOOTHING:
            row_sum += tl.sum(tl.where(mask, x, 0.0), axis=0)
    # tl.max and tl.maximum skip NaN (the GPU's max.f32; the interpreter copies it), so a NaN in
    # the row reaches the lse only through exp() and sum_exp: no floor or max may touch sum_exp,
    # or a NaN row becomes a finite loss. A +inf logit makes sum_exp NaN (exp(inf - inf)), as
    # torch's log_softmax gives. A target outside [0, V) that is not ignore_index has no logit: its
    # lse is NaN, so its loss and its whole gradient row are NaN, with no read out of bounds and no
    # host sync. An ignored row (in_vocab is False there: it read 0 columns) gets lse 0.
    in_vocab = (target >= 0) & (target < row_cols)
    lse = row_max + tl.log(tl.where(in_vocab, sum_exp, 1.0))
    lse = tl.where(in_vocab, lse, tl.where(valid, float("nan"), 0.0))

    x_target = tl.load(logits_ptr + target, mask=in_vocab, other=0.0).to(tl.float32)
    x_target = _softcapped(x_target, softcap, HAS_SOFTCAP)
    loss = lse - (1.0 - label_smoothing) * x_target + z_loss_scale * lse * lse
    if HAS_SMOOTHING:
        loss -= label_smoothing * row_sum / n_cols
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
    tl.store(lse_ptr + row, lse)

    if WRITE_GRAD:
        scale = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
        _ce_row_grad(
            logits_ptr, grad_ptr + row * grad_row_stride, n_cols, target, valid, lse, scale,
            label_smoothing, z_loss_scale, softcap,
            HAS_SOFTCAP=HAS_SOFTCAP, HAS_SMOOTHING=HAS_SMOOTHING, BLOCK=BLOCK,
        )


@launched
@triton.jit
def _ce_bwd_kernel(
    logits_ptr, target_ptr, lse_ptr, grad_ptr, scale_ptr,
    n_cols, logits_row_stride, grad_row_stride, scale_stride,
    ignore_index, label_smoothing, z_loss_scale, softcap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(target_ptr + row)
    scale = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
    _ce_row_grad(
        logits_ptr + row * logits_row_stride, grad_ptr + row * grad_row_stride, n_cols,
        target, target != ignore_index, tl.load(lse_ptr + row), scale,
        label_smoothing, z_loss_scale, softcap,
        HAS_SOFTCAP=HAS_SOFTCAP, HAS_SMOOTHING=HAS_SMOOTHING, BLOCK=BLOCK,
    )


class LossOptions(NamedTuple):
    """The per-token options shared by cross_entropy and linear_cross_entropy."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss_scale: float = 0.0
    softcap: float | None = None


def mean_denominator(
    target: torch.Tensor, ignore_index: int, num_items_in_batch: int | torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """The 0-dim divisor of a "mean": `num_items_in_batch` if given, else the count of targets
    that are not `ignore_index`; 1 where that is 0, so an all-ignored batch gives 0, not NaN.
    Computed on the targets' device without a host sync."""
    if num_items_in_batch is None:
        count = (target != ignore_index).sum()
    elif isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.device == target.device:
        count = num_items_in_batch
    else:
        # An int, or a CPU tensor (reading host memory is no device sync; copying it over would be).
        count = torch.full((), float(num_items_in_batch), dtype=dtype, device=target.device)
    count = count.to(dtype)
    return torch.where(count == 0, torch.ones_like(count), count)


def reduce_losses(
    losses: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token `losses` reduced as the ops do it ("mean" divides by :func:`mean_denominator`)."""
    if reduction == "none":
        return losses
    total = losses.sum()
    if reduction == "sum":
        return total
    return total / mean_denominator(target, ignore_index, num_items_in_batch, total.dtype)


def cross_entropy_reference(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """The loss written the obvious way over ``torch.nn.functional.cross_entropy``: the test oracle
    and the fallback. Where it departs from torch, it does what the kernel does: an ignored row's
    logits are not used (torch's gradient there is NaN when they hold a NaN; this one is 0), and a
    target outside ``[0, V)`` gives a NaN loss and gradient row (torch raises on the CPU and stops
    the process with a device-side assert on a GPU)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    target1d = target.reshape(-1)
    ignored = target1d == ignore_index
    out_of_range = ~ignored & ((target1d < 0) | (target1d >= x.shape[-1]))
    x2d = torch.where(ignored[:, None], 0.0, x.reshape(-1, x.shape[-1]))
    if softcap is not None:
        x2d = softcap * torch.tanh(x2d / softcap)
    # Every row gets a class in range here (torch's own ignore_index never matches); the ignored
    # rows are zeroed below, where their loss is finite.
    losses = torch.nn.functional.cross_entropy(
        x2d, torch.where(ignored | out_of_range, 0, target1d).long(), reduction="none",
        label_smoothing=label_smoothing,
    )
    if z_loss_scale:
        losses = losses + z_loss_scale * torch.logsumexp(x2d, dim=-1).pow(2)
    # A product, not masked_fill: its gradient carries the NaN back into the row's logits.
    losses = losses * torch.where(out_of_range, float("nan"), 1.0).to(losses.dtype)
    losses = torch.where(ignored, 0.0, losses)
    return reduce_losses(losses.view(target.shape), target, ignore_index, reduction)


def vocab_block_config(n_cols: int, writes_grad: bool) -> tuple[int, int]:
    """(BLOCK, num_warps) for a kernel that walks a row of `n_cols` logits block by block, and
    writes the row's gradient too if `writes_grad`."""
    block = min(MAX_BLOCK, next_power_of_2(n_cols))
    return block, max(1, min(16, block // (32 * ELEMENTS_PER_THREAD[writes_grad])))


def _kernel_options(options: LossOptions, n_cols: int, writes_grad: bool) -> dict:
    block, num_warps = vocab_block_config(n_cols, writes_grad)
    return dict(
        ignore_index=options.ignore_index,
        label_smoothing=float(options.label_smoothing),
        z_loss_scale=float(options.z_loss_scale),
        softcap=float(options.softcap) if options.softcap is not None else 1.0,
        HAS_SOFTCAP=options.softcap is not None,
        HAS_SMOOTHING=options.label_smoothing > 0,
        BLOCK=block,
        num_warps=num_warps,
    )


def cross_entropy_rows(
    logits2d: torch.Tensor,
    target1d: torch.Tensor,
    loss: torch.Tensor,
    lse: torch.Tensor,
    options: LossOptions,
    grad: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> None:
    """Write each row's fp32 loss and lse into `loss` and `lse`; with `grad`, also the gradient of
    ``sum(scale * loss)`` in the same pass. `scale` is 0-dim or one value per row; `grad` may be
    `logits2d` itself (its rows are then overwritten: only for a buffer nobody else reads)."""
    n_rows, n_cols = logits2d.shape
    write_grad = grad is not None
    _ce_fwd_kernel[(n_rows,)](
        logits2d, target1d, loss, lse,
        grad if write_grad else logits2d, scale if write_grad else lse,
        n_cols, logits2d.stride(0), grad.stride(0) if write_grad else 0,
        _scale_stride(scale) if write_grad else 0,
        WRITE_GRAD=write_grad,
        **_kernel_options(options, n_cols, write_grad),
    )


def _scale_stride(scale: torch.Tensor) -> int:
    return scale.stride(0) if scale.dim() else 0


def cross_entropy_backward(logits, target, lse, scale, options):
    """The logits' gradient, of the logits' shape, by the backward kernel; `scale` is 0-dim or one
    value per row (the loss's gradient)."""
    logits2d, target1d = rows_view(logits), target.reshape(-1)
    n_rows, n_cols = logits2d.shape
    grad = torch.empty((n_rows, n_cols), dtype=logits2d.dtype, device=logits2d.device)
    _ce_bwd_kernel[(n_rows,)](
        logits2d, target1d, lse, grad, scale,
        n_cols, logits2d.stride(0), grad.stride(0), _scale_stride(scale),
        **_kernel_options(options, n_cols, True),
    )
    return grad.view(logits.shape)


def _row_losses(logits, target, options):
    """Each row's fp32 loss (shape of `target`) and lse (one per row) by the forward kernel."""
    loss = torch.empty(target.shape, dtype=torch.float32, device=logits.device)
    lse = torch.empty(target.shape, dtype=torch.float32, device=logits.device)
    cross_entropy_rows(rows_view(logits), target.reshape(-1), loss.view(-1), lse.view(-1), options)
    return loss, lse


def _reference_point(ctx, saved):
    logits, target, _ = saved
    options, reduction = ctx.config
    return CROSS_ENTROPY, _reference_in_function_order, (logits, target, options, reduction)


def _reference_in_function_order(logits, target, options, reduction):
    ignore_index, label_smoothing, z_loss_scale, softcap = options
    return cross_entropy_reference(logits, target, ignore_index, reduction, label_smoothing, z_loss_scale, softcap)


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, options, reduction):
        loss, lse = _row_losses(logits, target, options)
        ctx.save_for_backward(logits, target, lse)
        ctx.config = (options, reduction)
        if reduction == "none":
            return loss
        total = loss.sum()
        if reduction == "sum":
            return total
        ctx.denominator = mean_denominator(target, options.ignore_index, None, torch.float32)
        return total / ctx.denominator

    @staticmethod
    @torch.autograd.function.once_differentiable
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_output):
        logits, target, lse = saved
        options, reduction = ctx.config
        if reduction == "none":
            scale = grad_output.reshape(-1)
        else:
            scale = grad_output / ctx.denominator if reduction == "mean" else grad_output
        return cross_entropy_backward(logits, target, lse, scale, options), None, None, None


def check_loss_options(options: LossOptions, reduction: str) -> None:
    """ValueError for an option outside its domain."""
    ignore_index, label_smoothing, z_loss_scale, softcap = options
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    check_choice("reduction", reduction, REDUCTIONS)
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if not isinstance(z_loss_scale, (int, float)) or z_loss_scale < 0:
        raise ValueError(f"z_loss_scale must be a non-negative float, got {z_loss_scale!r}")
    if softcap is not None and (not isinstance(softcap, (int, float)) or softcap <= 0):
        raise ValueError(f"softcap must be None or a positive float, got {softcap!r}")


def check_target(target: torch.Tensor, rows_shape: torch.Size, device: torch.device, of: str) -> None:
    """`target` holds class indices with shape `rows_shape` (that of `of` without its last dim)."""
    if not isinstance(target, torch.Tensor):
        raise ValueError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in TARGET_DTYPES:
        raise ValueError(f"target must hold class indices as int64 or int32, got {target.dtype}")
    if target.shape != rows_shape:
        raise ValueError(
            f"target must have shape {tuple(rows_shape)} ({of} without its last dim), got {tuple(target.shape)}"
        )
    check_device("target", target, device)


def check_target_range(target: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """ValueError naming the first target outside ``[0, n_classes)`` that is not `ignore_index`.
    Reads the targets back to the host, so it runs only under TIGON_DEBUG=1; otherwise such rows
    give NaN."""
    bad = ((target < 0) | (target >= n_classes)) & (target != ignore_index)
    positions = bad.nonzero()
    if positions.shape[0]:
        first = tuple(positions[0].tolist())
        raise ValueError(
            f"target{list(first)} is {target[first].item()}, outside [0, {n_classes}) and not "
            f"ignore_index ({ignore_index}); {positions.shape[0]} target(s) like it would give a NaN loss"
        )


def _check(logits, target, options, reduction) -> None:
    check_float("logits", logits)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty last (vocabulary) dim, got shape {tuple(logits.shape)}")
    check_target(target, logits.shape[:-1], logits.device, "logits")
    check_loss_options(options, reduction)


def _cross_entropy_kernel(logits, target, ignore_index, reduction, label_smoothing, z_loss_scale, softcap):
    options = LossOptions(ignore_index, label_smoothing, z_loss_scale, softcap)
    return _CrossEntropyFunction.apply(logits, target, options, reduction)


# Inside torch.compile: the same launchers as library ops, reduced by torch ops around them.
def _forward_fake(logits, target, ignore_index, label_smoothing, z_loss_scale, softcap):
    return tuple(torch.empty(target.shape, dtype=torch.float32, device=logits.device) for _ in range(2))


@library_op(
    "cross_entropy",
    "(Tensor logits, Tensor target, int ignore_index, float label_smoothing, float z_loss_scale, float? softcap) "
    "-> (Tensor, Tensor)",
    _forward_fake,
)
def _forward_op(logits, target, ignore_index, label_smoothing, z_loss_scale, softcap):
    return _row_losses(logits, target, LossOptions(ignore_index, label_smoothing, z_loss_scale, softcap))


@library_op(
    "cross_entropy_backward",
    "(Tensor logits, Tensor target, Tensor lse, Tensor scale, int ignore_index, float label_smoothing, "
    "float z_loss_scale, float? softcap) -> Tensor",
    lambda logits, *_: torch.empty(logits.shape, dtype=logits.dtype, device=logits.device),
)
def _backward_op(logits, target, lse, scale, ignore_index, label_smoothing, z_loss_scale, softcap):
    return cross_entropy_backward(logits, target, lse, scale, LossOptions(ignore_index, label_smoothing, z_loss_scale, softcap))


def _setup_context(ctx, inputs, output):
    logits, target, *options = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.options = options


def _op_backward(ctx, grad_losses, _):
    logits, target, lse = ctx.saved_tensors
    return _backward_op(logits, target, lse, grad_losses.reshape(-1), *ctx.options), None, None, None, None, None


_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


def _cross_entropy_compiled(logits, target, ignore_index, reduction, label_smoothing, z_loss_scale, softcap):
    losses, _ = _forward_op(
        logits, target, ignore_index, float(label_smoothing), float(z_loss_scale),
        None if softcap is None else float(softcap),
    )
    return reduce_losses(losses, target, ignore_index, reduction)


CROSS_ENTROPY = Op("cross_entropy", _cross_entropy_kernel, cross_entropy_reference, compiled=_cross_entropy_compiled)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Cross-entropy of `logits` against class indices `target`, with the class dim last.

    Args:
        logits: ``(..., V)`` float16/bfloat16/float32 (float64 runs the reference); need not be
            contiguous. Any V (262144 and more): rows are walked in blocks.
        target: ``(...)`` int64/int32 class indices; rows equal to `ignore_index` add nothing.
            A target outside ``[0, V)`` gives its row a NaN loss and gradient (checked on the
            device; ``TIGON_DEBUG=1`` raises a ValueError naming it instead).
        ignore_index: target value to skip.
        reduction: ``"mean"`` over the non-ignored rows, ``"sum"``, or ``"none"`` (shape of `target`).
        label_smoothing: eps in [0, 1], as in ``torch.nn.functional.cross_entropy``.
        z_loss_scale: adds ``z_loss_scale * logsumexp(logits)**2`` to each non-ignored row's loss.
        softcap: if set, the logits become ``softcap * tanh(logits / softcap)`` first (Gemma 2).

    Returns:
        The loss in fp32 (the logits' dtype if that is float64). A "mean" over an all-ignored batch
        is 0, where torch gives NaN. A NaN or +inf logit in a row that is not ignored makes that
        row's loss NaN, as in torch (the module docstring has the details). The gradient is written
        to a fresh buffer in backward.
    """
    _check(logits, target, LossOptions(ignore_index, label_smoothing, z_loss_scale, softcap), reduction)
    if debug_enabled():
        check_target_range(target, logits.shape[-1], ignore_index)
    return CROSS_ENTROPY(None, logits, target, ignore_index, reduction, label_smoothing, z_loss_scale, softcap)
