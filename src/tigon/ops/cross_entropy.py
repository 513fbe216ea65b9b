"""Cross-entropy over the last dim of the logits, with label smoothing, z-loss, logit softcapping,
class weights and token scaling.

    x'      = softcap * tanh(x / softcap)                  (only when softcap is set; Gemma 2)
    lse     = logsumexp(x')
    ce_i    = (1 - eps) w_t (lse - x'[t]) + eps / V * sum_j w_j (lse - x'_j)
    z_i     = z_loss_scale * lse^2
    loss_i  = ce_i + z_i    (both times p_t = softmax(x')[t], detached, with token scaling)
            = 0 where t == ignore_index

with class weights w (all 1 without them), then "mean", "sum" or "none". The cross-entropy terms
are ``torch.nn.functional.cross_entropy(x', t, weight=w, label_smoothing=eps)``'s: a "mean"
divides their sum by the sum of w_t over the rows whose target is not ignored (their count without
weights). The z-loss, which torch does not define, is not weighted by the class weight and a
"mean" divides its sum by the count of those rows, weights or not: what Liger's kernel computes,
the loss users swap this one in for. Without class weights the two divisors are one. That is
torch's loss plus the z-loss, with two differences: the class dim is the last one (logits ``(..., V)``, target ``(...)``), and a "mean"
over a batch whose every target is ignored is 0 with zero gradients, not NaN. The loss is fp32 for
fp16/bf16 logits (what ``F.cross_entropy(x.float(), t)`` gives); the gradient has the logits' dtype.
The same pass can write each row's z-loss term and its argmax (the walk over the row takes the max
anyway), so a training step can report its token accuracy without logits or another pass.

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

from tigon.ops._checks import check_choice, check_device, check_float, check_ignore_index, check_target, rows_view
from tigon.ops._dispatch import Op, backward_fallback, debug_enabled, library_op, tl, triton
from tigon.ops._launch import launched, next_power_of_2, vocab_block_config

REDUCTIONS = ("mean", "sum", "none")


@triton.jit
def _softcapped(x, softcap, HAS_SOFTCAP: tl.constexpr):
    # softcap * tanh(x / softcap), written with exp so no libdevice is needed; it saturates to
    # +-softcap cleanly when exp over- or underflows.
    if HAS_SOFTCAP:
        x = softcap - 2.0 * softcap / (tl.exp(2.0 * x / softcap) + 1.0)
    return x


@triton.jit
def _target_weight(class_weight_ptr, target, in_vocab, HAS_WEIGHT: tl.constexpr):
    # The target's class weight (1 without weights); 0 where the target has no class (its row's
    # lse is NaN or it is ignored, so the value never shows).
    weight = 1.0
    if HAS_WEIGHT:
        weight = tl.load(class_weight_ptr + target, mask=in_vocab, other=0.0).to(tl.float32)
    return weight


@triton.jit
def _z_scale(scale, z_ratio_ptr, HAS_Z_RATIO: tl.constexpr):
    # The z-loss's share of the upstream gradient: the cross-entropy's `scale`, times (sum of the
    # targets' weights) / (their count) in a weighted mean, whose z-loss divides by the count.
    if HAS_Z_RATIO:
        scale *= tl.load(z_ratio_ptr)
    return scale


@triton.jit
def _ce_row_grad(
    logits_ptr, grad_ptr, class_weight_ptr, n_cols, target, valid, lse, scale, z_scale, w_target, weight_total,
    label_smoothing, z_loss_scale, softcap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # With class weights w (all 1 without them; weight_total = sum(w), V without them), the
    # cross-entropy terms scaled by `scale` and the z-loss by `z_scale` (they differ only in a
    # weighted mean, whose divisors differ):
    # d loss / d x'_j = softmax_j * (scale ((1 - eps) w_t + eps W / V) + z_scale 2 z lse)
    #                   - scale ((1 - eps) w_t [j == t] + eps w_j / V), times d x'/d x.
    # Each element is read and then written by the same thread, so grad_ptr may equal logits_ptr.
    cols = tl.arange(0, BLOCK)
    softmax_scale = (
        scale * ((1.0 - label_smoothing) * w_target + label_smoothing * weight_total / n_cols)
        + z_scale * 2.0 * z_loss_scale * lse
    )
    target_scale = scale * (1.0 - label_smoothing) * w_target
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
            if HAS_WEIGHT:
                g -= smooth * tl.load(class_weight_ptr + offs, mask=in_row, other=0.0).to(tl.float32)
            else:
                g -= smooth
        if HAS_SOFTCAP:
            g *= 1.0 - (x / softcap) * (x / softcap)
        tl.store(grad_ptr + offs, tl.where(valid, g, 0.0).to(grad_ptr.dtype.element_ty), mask=in_row)


@launched
@triton.jit
def _ce_fwd_kernel(
    logits_ptr, target_ptr, loss_ptr, lse_ptr, grad_ptr, scale_ptr,
    class_weight_ptr, weight_total_ptr, z_ratio_ptr, argmax_ptr, z_loss_ptr,
    n_cols, logits_row_stride, grad_row_stride, scale_stride,
    ignore_index, label_smoothing, z_loss_scale, softcap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_Z_RATIO: tl.constexpr,
    TOKEN_SCALING: tl.constexpr,
    WRITE_ARGMAX: tl.constexpr,
    WRITE_Z_LOSS: tl.constexpr,
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
    # The argmax rides on the max the loop takes anyway: the first index of the largest value, or
    # of the first NaN (what torch.argmax gives), found without another pass over the row.
    best = float("-inf")
    best_index = 0
    first_nan = n_cols
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        mask = offs < row_cols
        x = tl.load(logits_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.where(mask, _softcapped(x, softcap, HAS_SOFTCAP), float("-inf"))
        block_max = tl.max(x, axis=0)
        new_max = tl.maximum(row_max, block_max)
        # While every value seen is -inf (or the row is ignored) there is no finite shift; 0 keeps
        # exp() at 0 instead of NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        sum_exp = sum_exp * tl.exp(row_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
        row_max = new_max
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                w = tl.load(class_weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                row_sum += tl.sum(tl.where(mask, w * x, 0.0), axis=0)
            else:
                row_sum += tl.sum(tl.where(mask, x, 0.0), axis=0)
        if WRITE_ARGMAX:
            is_nan = x != x
            first_nan = tl.minimum(first_nan, tl.min(tl.where(is_nan, offs, n_cols), axis=0))
            finite_or_inf = tl.where(is_nan, float("-inf"), x)
            block_best = tl.max(finite_or_inf, axis=0)
            block_index = start + tl.argmax(finite_or_inf, axis=0, tie_break_left=True)
            best_index = tl.where(block_best > best, block_index, best_index)
            best = tl.maximum(best, block_best)
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
    w_target = _target_weight(class_weight_ptr, target, in_vocab, HAS_WEIGHT)
    if HAS_WEIGHT:
        weight_total = tl.load(weight_total_ptr)
    else:
        weight_total = n_cols * 1.0
    # torch's weighted, smoothed loss: (1 - eps) w_t (lse - x_t) + eps / V sum_j w_j (lse - x_j);
    # the z-loss is not weighted.
    z_term = z_loss_scale * lse * lse
    loss = (1.0 - label_smoothing) * w_target * (lse - x_target) + z_term
    if HAS_SMOOTHING:
        loss += label_smoothing * (weight_total * lse - row_sum) / n_cols
    # Token scaling: the row's loss times its target's probability, a constant to the gradient.
    token_scale = 1.0
    if TOKEN_SCALING:
        token_scale = tl.exp(x_target - lse)
    tl.store(loss_ptr + row, tl.where(valid, loss * token_scale, 0.0))
    tl.store(lse_ptr + row, lse)
    if WRITE_Z_LOSS:
        tl.store(z_loss_ptr + row, tl.where(valid, z_term * token_scale, 0.0))
    if WRITE_ARGMAX:
        index = tl.where(first_nan < n_cols, first_nan, best_index)
        tl.store(argmax_ptr + row, tl.where(valid, index, -1).to(tl.int64))

    if WRITE_GRAD:
        scale = tl.load(scale_ptr + row * scale_stride).to(tl.float32) * token_scale
        _ce_row_grad(
            logits_ptr, grad_ptr + row * grad_row_stride, class_weight_ptr, n_cols, target, valid, lse, scale,
            _z_scale(scale, z_ratio_ptr, HAS_Z_RATIO), w_target, weight_total, label_smoothing, z_loss_scale, softcap,
            HAS_SOFTCAP=HAS_SOFTCAP, HAS_SMOOTHING=HAS_SMOOTHING, HAS_WEIGHT=HAS_WEIGHT, BLOCK=BLOCK,
        )


@launched
@triton.jit
def _ce_bwd_kernel(
    logits_ptr, target_ptr, lse_ptr, grad_ptr, scale_ptr, class_weight_ptr, weight_total_ptr, z_ratio_ptr,
    n_cols, logits_row_stride, grad_row_stride, scale_stride,
    ignore_index, label_smoothing, z_loss_scale, softcap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_Z_RATIO: tl.constexpr,
    TOKEN_SCALING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * logits_row_stride
    target = tl.load(target_ptr + row)
    valid = target != ignore_index
    in_vocab = valid & (target >= 0) & (target < n_cols)
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
    if TOKEN_SCALING:
        x_target = tl.load(logits_ptr + target, mask=in_vocab, other=0.0).to(tl.float32)
        scale *= tl.exp(_softcapped(x_target, softcap, HAS_SOFTCAP) - lse)
    if HAS_WEIGHT:
        weight_total = tl.load(weight_total_ptr)
    else:
        weight_total = n_cols * 1.0
    _ce_row_grad(
        logits_ptr, grad_ptr + row * grad_row_stride, class_weight_ptr, n_cols, target, valid, lse, scale,
        _z_scale(scale, z_ratio_ptr, HAS_Z_RATIO), _target_weight(class_weight_ptr, target, in_vocab, HAS_WEIGHT),
        weight_total,
        label_smoothing, z_loss_scale, softcap,
        HAS_SOFTCAP=HAS_SOFTCAP, HAS_SMOOTHING=HAS_SMOOTHING, HAS_WEIGHT=HAS_WEIGHT, BLOCK=BLOCK,
    )


class LossOptions(NamedTuple):
    """The per-token options shared by cross_entropy and linear_cross_entropy."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss_scale: float = 0.0
    softcap: float | None = None
    token_scaling: bool = False


class LossOutput(NamedTuple):
    """What a loss returns when asked for more than the loss (``return_z_loss`` or
    ``return_argmax``); the fields not asked for are None.

    Attributes:
        loss: the loss, as the op returns it alone (z-loss included).
        z_loss: the z-loss term of `loss`, ``z_loss_scale * lse**2`` per row (times the token
            scale with token scaling; never the class weight), reduced as `loss` is (a "mean"
            divides by the count of rows not ignored, with class weights too); detached.
        argmax: int64, shape of the target: each row's predicted class (the first index of the
            largest logit, after softcap; the first NaN's index in a row holding one, as
            torch.argmax), -1 where the target is ignored.
        accuracy: fp32 0-dim: the fraction of the rows that are not ignored whose argmax is their
            target (0 when every row is ignored); unweighted.
    """

    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    argmax: torch.Tensor | None = None
    accuracy: torch.Tensor | None = None


class ClassWeight(NamedTuple):
    """Class weights as the kernels read them: fp32 ``(V,)`` and their sum (0-dim, on the device,
    so that nothing is read back to the host)."""

    weight: torch.Tensor
    total: torch.Tensor


def class_weights(weight: torch.Tensor | None) -> ClassWeight | None:
    """`weight` (a checked ``(V,)`` float tensor, or None) as the kernels take it. The weights
    are constants to the loss: no gradient reaches them."""
    if weight is None:
        return None
    weight = weight.detach().to(torch.float32).contiguous()
    return ClassWeight(weight, weight.sum())


def target_weights(target: torch.Tensor, ignore_index: int, weight: torch.Tensor | None) -> torch.Tensor | None:
    """Each row's class weight, `weight[target]`, 0 on ignored rows (None without weights). A
    target outside the classes reads the last (or first) one: its row's loss is NaN anyway."""
    if weight is None:
        return None
    valid = target != ignore_index
    picked = weight[target.clamp(0, weight.shape[0] - 1).long()]
    return torch.where(valid, picked, torch.zeros_like(picked))


def mean_denominator(
    target: torch.Tensor,
    ignore_index: int,
    num_items_in_batch: int | torch.Tensor | None,
    dtype: torch.dtype,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The 0-dim divisor of a "mean": `num_items_in_batch` if given, else the count of targets
    that are not `ignore_index` (with class weights `weight`, the sum of their weights, as
    torch's); 1 where that is 0, so an all-ignored batch gives 0, not NaN. Computed on the
    targets' device without a host sync."""
    if num_items_in_batch is None:
        count = (target != ignore_index).sum() if weight is None else target_weights(target, ignore_index, weight).sum()
    elif isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.device == target.device:
        count = num_items_in_batch
    else:
        # An int, or a CPU tensor (reading host memory is no device sync; copying it over would be).
        count = torch.full((), float(num_items_in_batch), dtype=dtype, device=target.device)
    count = count.to(dtype)
    return torch.where(count == 0, torch.ones_like(count), count)


def has_two_divisors(reduction: str, class_weight: object, options: LossOptions) -> bool:
    """Whether a loss's cross-entropy and z-loss terms have different divisors: a "mean" with
    class weights (the sum of the targets' weights, and their count) and a z-loss."""
    return reduction == "mean" and class_weight is not None and options.z_loss_scale > 0


def reduce_losses(
    losses: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    num_items_in_batch: int | torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token `losses` reduced as the ops do it ("mean" divides by :func:`mean_denominator`)."""
    if reduction == "none":
        return losses
    total = losses.sum()
    if reduction == "sum":
        return total
    return total / mean_denominator(target, ignore_index, num_items_in_batch, total.dtype, weight)


def token_hits(argmax: torch.Tensor, target: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 0-dim ``(hits, count)``: how many of the targets that are not `ignore_index` equal
    `argmax`, and how many there are, on the device (what an accuracy over several batches sums)."""
    valid = target != ignore_index
    return ((argmax == target) & valid).sum(dtype=torch.float32), valid.sum(dtype=torch.float32)


def token_accuracy(argmax: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """fp32 0-dim: the fraction of the targets that are not `ignore_index` equal to `argmax`
    (0 when all are ignored), on the device."""
    hits, count = token_hits(argmax, target, ignore_index)
    return hits / count.clamp_min(1.0)


def cross_entropy_reference(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float | None = None,
    weight: torch.Tensor | None = None,
    token_scaling: bool = False,
    return_z_loss: bool = False,
    return_argmax: bool = False,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor | LossOutput:
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
    safe_target = torch.where(ignored | out_of_range, 0, target1d).long()
    w = None if weight is None else weight.detach().to(x2d.dtype)
    ce_rows = torch.nn.functional.cross_entropy(
        x2d, safe_target, weight=w, reduction="none", label_smoothing=label_smoothing
    )
    # The z-loss is not weighted, and its "mean" divides by the rows' count (Liger's convention).
    z_rows = z_loss_scale * torch.logsumexp(x2d, dim=-1).pow(2) if z_loss_scale else torch.zeros_like(ce_rows)
    if token_scaling:
        probability = x2d.log_softmax(-1).gather(1, safe_target[:, None])[:, 0].exp().detach()
        ce_rows, z_rows = ce_rows * probability, z_rows * probability
    # A product, not masked_fill: its gradient carries the NaN back into the row's logits.
    nan_rows = torch.where(out_of_range, float("nan"), 1.0).to(ce_rows.dtype)

    def reduced(rows, weight):
        rows = torch.where(ignored, 0.0, rows * nan_rows).view(target.shape)
        return reduce_losses(rows, target, ignore_index, reduction, num_items_in_batch, weight)

    loss = reduced(ce_rows, w) + reduced(z_rows, None)
    if not (return_z_loss or return_argmax):
        return loss
    out = LossOutput(loss)
    if return_z_loss:
        out = out._replace(z_loss=reduced(z_rows.detach(), None))
    if return_argmax:
        argmax = torch.where(ignored, -1, x2d.detach().argmax(-1)).view(target.shape)
        out = out._replace(argmax=argmax, accuracy=token_accuracy(argmax, target, ignore_index))
    return out


def _kernel_options(
    options: LossOptions, n_cols: int, writes_grad: bool, class_weight: ClassWeight | None, z_ratio: torch.Tensor | None
) -> dict:
    block, num_warps = vocab_block_config(n_cols, writes_grad)
    return dict(
        ignore_index=options.ignore_index,
        label_smoothing=float(options.label_smoothing),
        z_loss_scale=float(options.z_loss_scale),
        softcap=float(options.softcap) if options.softcap is not None else 1.0,
        HAS_SOFTCAP=options.softcap is not None,
        HAS_SMOOTHING=options.label_smoothing > 0,
        HAS_WEIGHT=class_weight is not None,
        HAS_Z_RATIO=z_ratio is not None,
        TOKEN_SCALING=bool(options.token_scaling),
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
    class_weight: ClassWeight | None = None,
    argmax: torch.Tensor | None = None,
    z_loss: torch.Tensor | None = None,
    z_ratio: torch.Tensor | None = None,
) -> None:
    """Write each row's fp32 loss and lse into `loss` and `lse`; with `grad`, also the gradient of
    ``sum(scale * loss)`` in the same pass. `scale` is 0-dim or one value per row; `grad` may be
    `logits2d` itself (its rows are then overwritten: only for a buffer nobody else reads). With
    `argmax` (int64, one per row) and `z_loss` (fp32, one per row), also each row's argmax and
    z-loss term, in the same pass. `z_ratio` (0-dim fp32) multiplies the z-loss term's `scale`
    (a weighted mean's divisor over the z-loss's: see :func:`has_two_divisors`)."""
    n_rows, n_cols = logits2d.shape
    write_grad = grad is not None
    _ce_fwd_kernel[(n_rows,)](
        logits2d, target1d, loss, lse,
        grad if write_grad else logits2d, scale if write_grad else lse,
        *_weight_pointers(class_weight, lse), z_ratio if z_ratio is not None else lse,
        argmax if argmax is not None else target1d, z_loss if z_loss is not None else lse,
        n_cols, logits2d.stride(0), grad.stride(0) if write_grad else 0,
        _scale_stride(scale) if write_grad else 0,
        WRITE_ARGMAX=argmax is not None,
        WRITE_Z_LOSS=z_loss is not None,
        WRITE_GRAD=write_grad,
        **_kernel_options(options, n_cols, write_grad, class_weight, z_ratio if write_grad else None),
    )


def _weight_pointers(class_weight: ClassWeight | None, placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Without weights the kernels never read these: any fp32 tensor stands in.
    return (placeholder, placeholder) if class_weight is None else class_weight


def _scale_stride(scale: torch.Tensor) -> int:
    return scale.stride(0) if scale.dim() else 0


def cross_entropy_backward(logits, target, lse, scale, options, class_weight=None, z_ratio=None):
    """The logits' gradient, of the logits' shape, by the backward kernel; `scale` is 0-dim or one
    value per row (the loss's gradient), `z_ratio` as in :func:`cross_entropy_rows`."""
    logits2d, target1d = rows_view(logits), target.reshape(-1)
    n_rows, n_cols = logits2d.shape
    grad = torch.empty((n_rows, n_cols), dtype=logits2d.dtype, device=logits2d.device)
    _ce_bwd_kernel[(n_rows,)](
        logits2d, target1d, lse, grad, scale, *_weight_pointers(class_weight, lse),
        z_ratio if z_ratio is not None else lse,
        n_cols, logits2d.stride(0), grad.stride(0), _scale_stride(scale),
        **_kernel_options(options, n_cols, True, class_weight, z_ratio),
    )
    return grad.view(logits.shape)


def _row_losses(logits, target, options, class_weight=None, want_z_loss=False, want_argmax=False):
    """Each row's fp32 loss (shape of `target`), lse (one per row), and if asked its z-loss term
    and argmax (shape of `target`; else None), by the forward kernel."""
    loss = torch.empty(target.shape, dtype=torch.float32, device=logits.device)
    lse = torch.empty(target.shape, dtype=torch.float32, device=logits.device)
    z_loss = torch.empty(target.shape, dtype=torch.float32, device=logits.device) if want_z_loss else None
    argmax = torch.empty(target.shape, dtype=torch.int64, device=logits.device) if want_argmax else None
    cross_entropy_rows(
        rows_view(logits), target.reshape(-1), loss.view(-1), lse.view(-1), options, class_weight=class_weight,
        argmax=None if argmax is None else argmax.view(-1), z_loss=None if z_loss is None else z_loss.view(-1),
    )
    return loss, lse, z_loss, argmax


# Rows a program of the reduction reads at a time.
REDUCE_BLOCK = 1024


@launched
@triton.jit
def _ce_reduce_kernel(
    loss_ptr, z_loss_ptr, target_ptr, class_weight_ptr, out_ptr,
    n_rows, n_classes, ignore_index,
    MEAN: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program writes (loss, z-loss, divisor, z-loss divisor) to out_ptr[0:4]: the sum of the
    rows' cross-entropy terms over the divisor plus the sum of their z-loss terms over the z-loss
    divisor (`loss`), and the latter alone. For "mean" the divisor is the count of rows whose target
    is not ignored (with class weights, the sum of their targets' weights), the z-loss divisor
    their count, each 1 where it is 0; for "sum" both are 1. With class weights and a z-loss the
    rows' z-loss terms must be given (`loss` holds both terms). One launch for what is otherwise
    six small torch ops and two sums."""
    loss_acc = tl.zeros((BLOCK,), dtype=tl.float32)
    z_loss_acc = tl.zeros((BLOCK,), dtype=tl.float32)
    count_acc = tl.zeros((BLOCK,), dtype=tl.float32)
    rows_acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_rows, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        in_rows = rows < n_rows
        loss_acc += tl.load(loss_ptr + rows, mask=in_rows, other=0.0)
        if HAS_Z_LOSS:
            z_loss_acc += tl.load(z_loss_ptr + rows, mask=in_rows, other=0.0)
        if MEAN:
            target = tl.load(target_ptr + rows, mask=in_rows, other=ignore_index)
            counted = in_rows & (target != ignore_index)
            if HAS_WEIGHT:
                # A target outside the classes weighs 0 here: its row's loss is NaN, and so the mean.
                in_vocab = counted & (target >= 0) & (target < n_classes)
                count_acc += tl.load(class_weight_ptr + target, mask=in_vocab, other=0.0)
            rows_acc += counted.to(tl.float32)
    divisor = 1.0
    z_divisor = 1.0
    if MEAN:
        rows = tl.sum(rows_acc, axis=0)
        z_divisor = tl.where(rows == 0.0, 1.0, rows)
        divisor = z_divisor
        if HAS_WEIGHT:
            count = tl.sum(count_acc, axis=0)
            divisor = tl.where(count == 0.0, 1.0, count)
    z_loss = tl.sum(z_loss_acc, axis=0)
    loss = tl.sum(loss_acc, axis=0)
    if MEAN and HAS_WEIGHT and HAS_Z_LOSS:
        loss = (loss - z_loss) / divisor + z_loss / z_divisor
    else:
        loss = loss / divisor
    tl.store(out_ptr, loss)
    tl.store(out_ptr + 1, z_loss / z_divisor)
    tl.store(out_ptr + 2, divisor)
    tl.store(out_ptr + 3, z_divisor)


def reduce_rows(loss, z_loss, target, reduction, ignore_index, class_weight):
    """(loss, z-loss, divisor, z-loss divisor), 0-dim fp32 each, of the per-row `loss` and `z_loss`
    (or None; needed with class weights and a z-loss) by :data:`_ce_reduce_kernel`, for reduction
    "mean" or "sum"."""
    out = torch.empty(4, dtype=torch.float32, device=loss.device)
    n_rows = loss.numel()
    _ce_reduce_kernel[(1,)](
        loss, z_loss if z_loss is not None else loss, target.reshape(-1),
        class_weight.weight if class_weight is not None else loss, out,
        n_rows, class_weight.weight.shape[0] if class_weight is not None else 0, ignore_index,
        MEAN=reduction == "mean",
        HAS_Z_LOSS=z_loss is not None,
        HAS_WEIGHT=class_weight is not None,
        BLOCK=min(REDUCE_BLOCK, next_power_of_2(n_rows)),
        num_warps=4,
    )
    return out.unbind()


def _reference_point(ctx, saved):
    logits, target, _ = saved
    options, reduction, class_weight, wanted = ctx.config
    return CROSS_ENTROPY, _reference_in_function_order, (logits, target, class_weight, options, reduction, wanted)


def _reference_in_function_order(logits, target, class_weight, options, reduction, wanted):
    out = cross_entropy_reference(
        logits, target, options.ignore_index, reduction, options.label_smoothing, options.z_loss_scale,
        options.softcap, None if class_weight is None else class_weight.weight, options.token_scaling, True, True,
    )
    return out.loss, out.z_loss, out.argmax


class _CrossEntropyFunction(torch.autograd.Function):
    """Returns (loss, z_loss, argmax), the last two None unless `wanted` (a pair of bools) asks
    for them; neither has a gradient."""

    @staticmethod
    def forward(ctx, logits, target, class_weight, options, reduction, wanted):
        want_z_loss, want_argmax = wanted
        two_divisors = has_two_divisors(reduction, class_weight, options)
        loss, lse, z_loss, argmax = _row_losses(logits, target, options, class_weight, want_z_loss or two_divisors,
                                                want_argmax)
        ctx.save_for_backward(logits, target, lse)
        ctx.config = (options, reduction, class_weight, wanted)
        ctx.z_ratio = None
        if reduction != "none":
            loss, reduced_z_loss, ctx.denominator, z_denominator = reduce_rows(
                loss, z_loss, target, reduction, options.ignore_index, class_weight
            )
            if two_divisors:
                ctx.z_ratio = ctx.denominator / z_denominator
            z_loss = reduced_z_loss if want_z_loss else None
        ctx.mark_non_differentiable(*(t for t in (z_loss, argmax) if t is not None))
        return loss, z_loss, argmax

    @staticmethod
    @torch.autograd.function.once_differentiable
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_output, *_):
        logits, target, lse = saved
        options, reduction, class_weight, _ = ctx.config
        if reduction == "none":
            scale = grad_output.reshape(-1)
        else:
            scale = grad_output / ctx.denominator if reduction == "mean" else grad_output
        grad = cross_entropy_backward(logits, target, lse, scale, options, class_weight, ctx.z_ratio)
        return grad, None, None, None, None, None


def check_loss_options(options: LossOptions, reduction: str) -> None:
    """ValueError for an option outside its domain."""
    ignore_index, label_smoothing, z_loss_scale, softcap, token_scaling = options
    check_ignore_index(ignore_index)
    check_choice("reduction", reduction, REDUCTIONS)
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if not isinstance(z_loss_scale, (int, float)) or z_loss_scale < 0:
        raise ValueError(f"z_loss_scale must be a non-negative float, got {z_loss_scale!r}")
    if softcap is not None and (not isinstance(softcap, (int, float)) or softcap <= 0):
        raise ValueError(f"softcap must be None or a positive float, got {softcap!r}")
    if not isinstance(token_scaling, bool):
        raise ValueError(f"token_scaling must be a bool, got {token_scaling!r}")


def check_flags(**flags: object) -> None:
    """Each of `flags` (name=value) is a bool."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")


def check_class_weight(name: str, weight: torch.Tensor | None, n_classes: int, device: torch.device) -> None:
    """`weight` is None or a ``(n_classes,)`` float tensor on `device`: one weight per class."""
    if weight is None:
        return
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{name} must be None or a ({n_classes},) float tensor, got {type(weight).__name__}")
    if not weight.is_floating_point():
        raise ValueError(f"{name} must be a float tensor of class weights, got {weight.dtype}")
    if weight.shape != (n_classes,):
        raise ValueError(f"{name} must have shape ({n_classes},), one weight per class, got {tuple(weight.shape)}")
    check_device(name, weight, device)


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


def _check(logits, target, options, reduction, weight) -> None:
    check_float("logits", logits)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty last (vocabulary) dim, got shape {tuple(logits.shape)}")
    check_target(target, logits.shape[:-1], logits.device, "logits")
    check_loss_options(options, reduction)
    check_class_weight("weight", weight, logits.shape[-1], logits.device)


def loss_output(loss, z_loss, argmax, target, ignore_index, wanted):
    """The public result: `loss` alone, or a :class:`LossOutput` with what `wanted` (return_z_loss,
    return_argmax) asks for."""
    want_z_loss, want_argmax = wanted
    if not (want_z_loss or want_argmax):
        return loss
    return LossOutput(
        loss,
        z_loss if want_z_loss else None,
        argmax if want_argmax else None,
        token_accuracy(argmax, target, ignore_index) if want_argmax else None,
    )


def _cross_entropy_kernel(
    logits, target, ignore_index, reduction, label_smoothing, z_loss_scale, softcap, weight, token_scaling,
    return_z_loss, return_argmax,
):
    options = LossOptions(ignore_index, label_smoothing, z_loss_scale, softcap, token_scaling)
    wanted = (return_z_loss, return_argmax)
    loss, z_loss, argmax = _CrossEntropyFunction.apply(logits, target, class_weights(weight), options, reduction, wanted)
    return loss_output(loss, z_loss, argmax, target, ignore_index, wanted)


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
    return _row_losses(logits, target, LossOptions(ignore_index, label_smoothing, z_loss_scale, softcap))[:2]


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


def _cross_entropy_compiled(
    logits, target, ignore_index, reduction, label_smoothing, z_loss_scale, softcap, weight, token_scaling,
    return_z_loss, return_argmax,
):
    if weight is not None or token_scaling or return_z_loss or return_argmax:
        # Not library ops yet: inside torch.compile these options run the reference.
        return cross_entropy_reference(
            logits, target, ignore_index, reduction, label_smoothing, z_loss_scale, softcap, weight, token_scaling,
            return_z_loss, return_argmax,
        )
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
    weight: torch.Tensor | None = None,
    token_scaling: bool = False,
    return_z_loss: bool = False,
    return_argmax: bool = False,
) -> torch.Tensor | LossOutput:
    """Cross-entropy of `logits` against class indices `target`, with the class dim last.

    Args:
        logits: ``(..., V)`` float16/bfloat16/float32 (float64 runs the reference); need not be
            contiguous. Any V (262144 and more): rows are walked in blocks.
        target: ``(...)`` int64/int32 class indices; rows equal to `ignore_index` add nothing.
            A target outside ``[0, V)`` gives its row a NaN loss and gradient (checked on the
            device; ``TIGON_DEBUG=1`` raises a ValueError naming it instead).
        ignore_index: target value to skip.
        reduction: ``"mean"`` over the non-ignored rows (with `weight`: divided by the sum of
            their targets' weights), ``"sum"``, or ``"none"`` (shape of `target`).
        label_smoothing: eps in [0, 1], as in ``torch.nn.functional.cross_entropy``.
        z_loss_scale: adds ``z_loss_scale * logsumexp(logits)**2`` to each non-ignored row's loss.
            torch defines no z-loss; as in Liger's kernel it is not weighted by `weight`, and a
            "mean" divides its sum by the count of non-ignored rows even where the cross-entropy
            divides by their weights.
        softcap: if set, the logits become ``softcap * tanh(logits / softcap)`` first (Gemma 2).
        weight: ``(V,)`` float class weights, exactly as ``torch.nn.functional.cross_entropy``'s
            `weight` (label smoothing included); constants: no gradient reaches them.
        token_scaling: multiply each row's loss (z-loss included) by its target's probability
            ``softmax(logits)[target]``, detached: the gradient is the scaled row's, with no
            gradient through the scale.
        return_z_loss: also return the z-loss term on its own (see :class:`LossOutput`).
        return_argmax: also return each row's argmax and the token accuracy, computed in the
            forward pass over the row (no extra pass over the logits).

    Returns:
        The loss in fp32 (the logits' dtype if that is float64); with `return_z_loss` or
        `return_argmax`, a :class:`LossOutput` holding it. A "mean" over an all-ignored batch
        is 0, where torch gives NaN. A NaN or +inf logit in a row that is not ignored makes that
        row's loss NaN, as in torch (the module docstring has the details). The gradient is written
        to a fresh buffer in backward.
    """
    options = LossOptions(ignore_index, label_smoothing, z_loss_scale, softcap, token_scaling)
    _check(logits, target, options, reduction, weight)
    check_flags(return_z_loss=return_z_loss, return_argmax=return_argmax)
    if debug_enabled():
        check_target_range(target, logits.shape[-1], ignore_index)
    return CROSS_ENTROPY(
        None, logits, target, ignore_index, reduction, label_smoothing, z_loss_scale, softcap, weight, token_scaling,
        return_z_loss, return_argmax,
    )
