"""The LM head in chunks: what the fused linear losses (linear_cross_entropy, linear_log_probs,
linear_preference_loss, linear_policy_loss, linear_distill_loss) share.

None of them holds the (N, V) logits: each runs the N rows in chunks of C rows (the chunk plan,
:func:`chunk_rows`), per chunk one cuBLAS GEMM into a private (C, V) buffer (:func:`logits_chunks`),
one or two Triton passes over each row of it, and the gradient GEMMs over the d/dlogits written in
place (:func:`backprop_head`). Here are those shared pieces: the chunk plan, the per-row
log-softmax passes (each row's log-probability, lse, entropy and statistics, and the gradient over
the logits of any per-row weighting of them) with their loops over the chunks, the scaling of
gradients formed in forward by the upstream gradient, read on the device, and the head's argument
checks. Each loss's file holds its own objective and autograd on top of them.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch

from tigon.ops._checks import check_device, check_float, check_vector
from tigon.ops._dispatch import autocast_dtype, empty_if, tl, triton
from tigon.ops._launch import cdiv, launched, multiprocessor_count, vocab_block_config

CHUNK_ROW_MULTIPLE = 64  # whole GEMM tiles along the chunk's rows
# The logits chunk's budget of the losses that score it with the log-prob passes alone
# (linear_log_probs, linear_policy_loss): 896 rows at V = 128256 in bf16 (219 MiB), inside the
# 256 MiB such an op may take beyond its gradients. Backward's weight-gradient GEMM has K = chunk
# rows, so a larger chunk is faster (see BENCHMARKS.md for the curve over budgets).
LOG_PROB_CHUNK_BYTES = 224 * 2**20
SCALE_BLOCK = 4096


def chunk_rows(max_chunk_bytes: int, vocab: int, dtype: torch.dtype) -> int:
    """Rows per logits chunk: as many as `max_chunk_bytes` holds, rounded down to whole GEMM
    tiles, and at least one."""
    rows = max(1, max_chunk_bytes // (vocab * dtype.itemsize))
    return rows - rows % CHUNK_ROW_MULTIPLE if rows >= CHUNK_ROW_MULTIPLE else rows


@launched
@triton.jit
def _log_prob_stats_kernel(
    logits_ptr, target_ptr, logp_ptr, lse_ptr, entropy_ptr, stats_ptr,
    n_cols, row_stride, stats_stride, ignore_index, inv_temperature,
    HAS_ENTROPY: tl.constexpr,
    HAS_STATS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * row_stride
    target = tl.load(target_ptr + row)
    valid = target != ignore_index
    row_cols = tl.where(valid, n_cols, 0)  # an ignored row reads nothing
    cols = tl.arange(0, BLOCK)

    # Online logsumexp of z = x / T with the running max m; for the entropy also
    # w = sum e^(z - m) (z - m), so that H = log(s) - w / s needs no large cancelling terms.
    # tl.max skips NaN on the GPU, but a NaN still reaches s (and w) through exp(), which no
    # clamp touches afterwards: a NaN logit gives NaN outputs.
    row_max = float("-inf")
    sum_exp = 0.0
    shifted_sum = 0.0
    # The statistics: sum z, sum e^(2 (z - m)) and the max of z before the target's column.
    z_sum = 0.0
    square_sum = 0.0
    max_before = float("-inf")
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        mask = offs < row_cols
        z = tl.load(logits_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_temperature
        new_max = tl.maximum(row_max, tl.max(z, axis=0))
        # While every value seen is -inf there is no finite shift; 0 keeps exp() at 0, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(row_max - shift)
        e = tl.exp(z - shift)
        if HAS_ENTROPY:
            # Terms kept so far were shifted by the old max: each gains (m_old - m_new).
            moved = (tl.where(row_max == float("-inf"), shift, row_max) - shift) * sum_exp
            shifted_sum = rescale * (shifted_sum + moved) + tl.sum(tl.where(mask, z - shift, 0.0) * e, axis=0)
        if HAS_STATS:
            z_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
            square_sum = square_sum * rescale * rescale + tl.sum(e * e, axis=0)
            max_before = tl.maximum(max_before, tl.max(tl.where(offs < target, z, float("-inf")), axis=0))
        sum_exp = sum_exp * rescale + tl.sum(e, axis=0)
        row_max = new_max
    # An ignored row has no terms; 1 keeps log() quiet there (its outputs are 0 whatever it gives).
    sum_exp = tl.where(valid, sum_exp, 1.0)
    lse = row_max + tl.log(sum_exp)

    # A target outside [0, V) that is not ignore_index has no logit: NaN, not a read out of bounds.
    in_vocab = (target >= 0) & (target < row_cols)
    z_target = tl.load(logits_ptr + target, mask=in_vocab, other=float("nan")).to(tl.float32) * inv_temperature
    tl.store(logp_ptr + row, tl.where(valid, z_target - lse, 0.0))
    tl.store(lse_ptr + row, tl.where(valid, lse, 0.0))
    if HAS_ENTROPY:
        tl.store(entropy_ptr + row, tl.where(valid, tl.log(sum_exp) - shifted_sum / sum_exp, 0.0))
    if HAS_STATS:
        # The first argmax, as torch.argmax picks it: no earlier column as large. A NaN in the
        # row (which tl.max may skip) reaches sum_exp and makes it no argmax.
        top1 = valid & (z_target >= row_max) & (z_target > max_before) & (sum_exp == sum_exp)
        square_sum = tl.where(valid, square_sum, 1.0)
        tl.store(stats_ptr + row, tl.where(valid, z_sum / n_cols, 0.0))
        tl.store(stats_ptr + stats_stride + row, tl.where(top1, 1.0, 0.0))
        tl.store(stats_ptr + 2 * stats_stride + row,
                 tl.where(valid, tl.log(square_sum) - 2.0 * tl.log(sum_exp), 0.0))


@launched
@triton.jit
def _log_prob_grad_kernel(
    logits_ptr, grad_ptr, target_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr,
    n_cols, logits_row_stride, grad_row_stride, grad_logp_stride, grad_entropy_stride,
    ignore_index, inv_temperature,
    HAS_LOGP_GRAD: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # d/dx_j = (g ([j == t] - p_j) - e p_j (log p_j + H)) / T. Each element is read and then
    # written by the same thread, so grad_ptr may equal logits_ptr.
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * logits_row_stride
    grad_ptr += row * grad_row_stride
    target = tl.load(target_ptr + row)
    valid = target != ignore_index
    read_cols = tl.where(valid, n_cols, 0)
    lse = tl.load(lse_ptr + row)
    if HAS_LOGP_GRAD:
        g = tl.load(grad_logp_ptr + row * grad_logp_stride).to(tl.float32) * inv_temperature
    if HAS_ENTROPY_GRAD:
        e = tl.load(grad_entropy_ptr + row * grad_entropy_stride).to(tl.float32) * inv_temperature
        entropy = tl.load(entropy_ptr + row)
    cols = tl.arange(0, BLOCK)
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        x = tl.load(logits_ptr + offs, mask=offs < read_cols, other=0.0).to(tl.float32)
        log_p = x * inv_temperature - lse
        p = tl.exp(log_p)
        grad = tl.zeros([BLOCK], dtype=tl.float32)
        if HAS_LOGP_GRAD:
            grad += g * (tl.where(offs == target, 1.0, 0.0) - p)
        if HAS_ENTROPY_GRAD:
            grad -= e * p * (log_p + entropy)
        tl.store(grad_ptr + offs, tl.where(valid, grad, 0.0).to(grad_ptr.dtype.element_ty), mask=offs < n_cols)


@launched
@triton.jit
def _scale_in_place_kernel(x_ptr, scale_ptr, n_elements, BLOCK: tl.constexpr):
    # grad_output is read on the device: when it is 1 every program returns at once, with no host
    # sync and no pass over the gradient.
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n_elements, step):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n_elements
            x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
            tl.store(x_ptr + offs, (x * scale).to(x_ptr.dtype.element_ty), mask=mask)


def head_logits(hidden_rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out = hidden_rows @ weight.T + bias`` in the input dtype (fp32 accumulation), as F.linear."""
    if bias is None:
        torch.mm(hidden_rows, weight.t(), out=out)
    else:
        torch.addmm(bias, hidden_rows, weight.t(), out=out)


def log_prob_rows(
    logits2d: torch.Tensor, target1d: torch.Tensor, logp: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor | None,
    ignore_index: int, inv_temperature: float, stats: torch.Tensor | None = None,
) -> None:
    """Write each row's fp32 logp, lse of z = logits / T, (if `entropy` is given) entropy and (if
    `stats`, a (3, rows) view, is given) its mean z, top-1 flag as 0/1 and log sum p^2."""
    n_rows, n_cols = logits2d.shape
    block, num_warps = vocab_block_config(n_cols, False)
    _log_prob_stats_kernel[(n_rows,)](
        logits2d, target1d, logp, lse, entropy if entropy is not None else lse, stats if stats is not None else lse,
        n_cols, logits2d.stride(0), stats.stride(0) if stats is not None else 0, ignore_index, float(inv_temperature),
        HAS_ENTROPY=entropy is not None, HAS_STATS=stats is not None, BLOCK=block, num_warps=num_warps,
    )


def log_prob_grad_rows(
    logits2d: torch.Tensor, target1d: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor | None,
    grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None, ignore_index: int, inv_temperature: float,
    out: torch.Tensor,
) -> None:
    """Write into `out` the gradient over the logits of ``sum(grad_logp * logp + grad_entropy * H)``;
    each upstream gradient is None, 0-dim or one value per row. `out` may be `logits2d` itself."""
    n_rows, n_cols = logits2d.shape
    block, num_warps = vocab_block_config(n_cols, True)
    _log_prob_grad_kernel[(n_rows,)](
        logits2d, out, target1d, lse, entropy if entropy is not None else lse,
        grad_logp if grad_logp is not None else lse, grad_entropy if grad_entropy is not None else lse,
        n_cols, logits2d.stride(0), out.stride(0), _stride(grad_logp), _stride(grad_entropy),
        ignore_index, float(inv_temperature),
        HAS_LOGP_GRAD=grad_logp is not None, HAS_ENTROPY_GRAD=grad_entropy is not None,
        BLOCK=block, num_warps=num_warps,
    )


def _stride(t: torch.Tensor | None) -> int:
    return t.stride(0) if t is not None and t.dim() else 0


def backprop_head(
    dlogits: torch.Tensor, hidden_rows: torch.Tensor, weight: torch.Tensor, grad_hidden_rows: torch.Tensor | None,
    grad_weight: torch.Tensor | None, grad_bias: torch.Tensor | None, first: bool, accumulate_hidden: bool = False,
) -> None:
    """Run the head's gradient GEMMs for one chunk's d/dlogits, each only for a gradient that is
    wanted: rows of grad_hidden (written, or added to), grad_weight (written on the `first` chunk,
    then added to, in the weight's dtype) and the fp32 grad_bias."""
    if grad_hidden_rows is not None:
        if accumulate_hidden:
            grad_hidden_rows.addmm_(dlogits, weight)
        else:
            torch.mm(dlogits, weight, out=grad_hidden_rows)
    if grad_weight is not None:
        if first:
            torch.mm(dlogits.t(), hidden_rows, out=grad_weight)
        else:
            grad_weight.addmm_(dlogits.t(), hidden_rows)
    if grad_bias is not None:
        grad_bias += dlogits.sum(0, dtype=torch.float32)


def logits_chunks(
    hidden2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(start, end, logits)`` for consecutive chunks of at most `rows` rows; `logits` is
    one private buffer, overwritten chunk after chunk (the caller may write over it)."""
    n_rows = hidden2d.shape[0]
    buffer = torch.empty((min(rows, n_rows), weight.shape[0]), dtype=hidden2d.dtype, device=hidden2d.device)
    for start in range(0, n_rows, rows):
        end = min(start + rows, n_rows)
        logits = buffer[: end - start]
        head_logits(hidden2d[start:end], weight, bias, logits)
        yield start, end, logits


def chunked_log_probs(
    hidden2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target1d: torch.Tensor, rows: int,
    ignore_index: int, inv_temperature: float, with_entropy: bool = False, grad_hidden: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row fp32 (logp, lse, entropy or None) in chunks of `rows`. With `grad_hidden` (N, H),
    also writes into it the gradient of ``sum(logp)`` w.r.t. the hidden rows; with `stats` (3, N),
    the rows' statistics (:func:`log_prob_rows`)."""
    n_rows = hidden2d.shape[0]
    device = hidden2d.device
    logp = torch.empty(n_rows, dtype=torch.float32, device=device)
    lse = torch.empty(n_rows, dtype=torch.float32, device=device)
    entropy = torch.empty(n_rows, dtype=torch.float32, device=device) if with_entropy else None
    one = torch.ones((), dtype=torch.float32, device=device) if grad_hidden is not None else None
    for start, end, logits in logits_chunks(hidden2d, weight, bias, rows):
        target_c, lse_c = target1d[start:end], lse[start:end]
        log_prob_rows(
            logits, target_c, logp[start:end], lse_c, entropy[start:end] if with_entropy else None,
            ignore_index, inv_temperature, stats[:, start:end] if stats is not None else None,
        )
        if grad_hidden is not None:
            log_prob_grad_rows(logits, target_c, lse_c, None, one, None, ignore_index, inv_temperature, out=logits)
            torch.mm(logits, weight, out=grad_hidden[start:end])
    return logp, lse, entropy


def chunked_grads(
    hidden2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target1d: torch.Tensor, lse: torch.Tensor,
    entropy: torch.Tensor | None, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None,
    ignore_index: int, temperature: float, rows: int, needs: Sequence[bool], grad_hidden: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Recompute the logits chunk by chunk and return the gradients (hidden, weight, bias) of
    ``sum(grad_logp * logp + grad_entropy * H)`` for those in `needs` (None for the others), in
    chunks of `rows`. A given `grad_hidden` is added to instead of a fresh one being written."""
    need_hidden, need_weight, need_bias = needs
    device = hidden2d.device
    accumulate = grad_hidden is not None
    if need_hidden and grad_hidden is None:
        grad_hidden = torch.empty(hidden2d.shape, dtype=hidden2d.dtype, device=device)
    grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=device) if need_weight else None
    grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=device) if need_bias else None
    inv_temperature = 1.0 / temperature
    for start, end, logits in logits_chunks(hidden2d, weight, bias, rows):
        log_prob_grad_rows(
            logits, target1d[start:end], lse[start:end],
            entropy[start:end] if entropy is not None else None,
            grad_logp[start:end] if grad_logp is not None else None,
            grad_entropy[start:end] if grad_entropy is not None else None,
            ignore_index, inv_temperature, out=logits,
        )
        backprop_head(
            logits, hidden2d[start:end], weight,
            grad_hidden[start:end] if need_hidden else None, grad_weight, grad_bias,
            first=start == 0, accumulate_hidden=accumulate,
        )
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return grad_hidden if need_hidden else None, grad_weight, grad_bias


def scale_in_place(t: torch.Tensor, scale: torch.Tensor) -> None:
    """Multiply `t` by the 0-dim `scale` in place, reading `scale` on the device: no host sync, and
    no pass over `t` when it is 1."""
    n_blocks = cdiv(t.numel(), SCALE_BLOCK)
    programs = max(1, min(n_blocks, 8 * multiprocessor_count(t.device)))
    _scale_in_place_kernel[(programs,)](t, scale, t.numel(), BLOCK=SCALE_BLOCK, num_warps=8)


def scaled_forward_grads(
    ctx: Any, grad_loss: torch.Tensor, hidden: torch.Tensor, recompute: Callable[[], Sequence[torch.Tensor | None]]
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The head's gradients (hidden, weight, bias; None where not formed) that a fused loss formed
    in forward (``ctx.grads``, for an upstream gradient of 1, hidden's as rows), scaled in place by
    `grad_loss`, read on the device; hidden's in the shape of `hidden`. Handed over once: a second
    backward through a retained graph gets them from `recompute()`."""
    if ctx.grads is not None:
        grads, ctx.grads = ctx.grads, None
    else:
        grads = recompute()
    for grad in grads:
        if grad is not None:
            scale_in_place(grad, grad_loss)
    grad_hidden, grad_weight, grad_bias = grads
    return (None if grad_hidden is None else grad_hidden.view(hidden.shape)), grad_weight, grad_bias


def register_forward_grads_autograd(op: Any) -> None:
    """Autograd for a fused loss's library op whose first three inputs are (hidden, weight, bias),
    whose last three say which of them need a gradient, and whose last three outputs are those
    gradients (formed in forward for an upstream gradient of 1) after the loss, its first output."""

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*output[-3:])
        ctx.needs, ctx.n_inputs = inputs[-3:], len(inputs)

    def backward(ctx, grad_loss, *_):
        grads = [grad * grad_loss if need else None for grad, need in zip(ctx.saved_tensors, ctx.needs)]
        return (*grads, *[None] * (ctx.n_inputs - 3))

    op.register_autograd(backward, setup_context=setup_context)


def head_grads_fake(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, needs: Sequence[bool]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A library op's fake gradients of the head (hidden, weight, bias): empty where not needed."""
    need_hidden, need_weight, need_bias = needs
    return (empty_if(need_hidden, hidden), empty_if(need_weight, weight),
            empty_if(need_bias, weight, weight.shape[:1], None if bias is None else bias.dtype))


def head_grads_out(
    hidden: torch.Tensor, grads: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head's gradients (hidden's as rows or in its shape; None where not formed) as a library
    op returns them: hidden's in its shape, an empty tensor for each one not formed."""
    grad_hidden, grad_weight, grad_bias = grads
    return (hidden.new_empty(0) if grad_hidden is None else grad_hidden.view(hidden.shape),
            *(hidden.new_empty(0) if grad is None else grad for grad in (grad_weight, grad_bias)))


def head_grad_needs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> list[bool]:
    """Which of the head's tensors a library op must form a gradient for, decided when tracing."""
    grad_enabled = torch.is_grad_enabled()
    return [grad_enabled and t is not None and t.requires_grad for t in (hidden, weight, bias)]


def autocast_head(hidden: Any, *tensors: torch.Tensor | None) -> tuple[Any, ...]:
    """``(dtype, hidden, *tensors)``: under autocast, `dtype` is the one it would run a linear on
    `hidden`'s device in, and `hidden` and `tensors` (the heads' hidden states, weights and biases;
    None stays None) are cast to it as autocast casts F.linear's operands (float64 stays, as
    autocast leaves it); the fused loss then runs with autocast off
    (:meth:`~tigon.ops._dispatch.Op.without_autocast`), its GEMMs in the operands' dtype: the
    logits rounded as the unfused ``F.linear`` under autocast rounds them, the loss in fp32, and
    an fp32 weight's gradient cast back to fp32 by autograd. Without autocast, ``(None, hidden,
    *tensors)`` as given (mixed dtypes are then refused by :func:`check_head`)."""
    dtype = autocast_dtype(hidden) if isinstance(hidden, torch.Tensor) else None
    if dtype is None:
        return None, hidden, *tensors

    def cast(t):
        is_cast = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
        return t.to(dtype) if is_cast else t

    return dtype, cast(hidden), *map(cast, tensors)


def check_head(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, names: tuple[str, str, str]
) -> None:
    """`weight` is a (V, H) head for `hidden` (..., H) of its dtype and device, `bias` None or (V,)."""
    hidden_name, weight_name, bias_name = names
    check_float(hidden_name, hidden)
    if hidden.dim() == 0:
        raise ValueError(f"{hidden_name} must have at least one dimension (the hidden size), got a scalar")
    check_float(weight_name, weight)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(
            f"{weight_name} must have shape (vocab, {hidden.shape[-1]}) with vocab >= 1 to match the last dim "
            f"of {hidden_name}, got {tuple(weight.shape)}"
        )
    check_device(weight_name, weight, hidden.device)
    if weight.dtype != hidden.dtype:
        raise ValueError(f"{weight_name} must have the dtype of {hidden_name} ({hidden.dtype}), got {weight.dtype}")
    if bias is not None:
        check_vector(bias_name, bias, weight.shape[0], hidden.device)
        if bias.dtype != hidden.dtype:
            raise ValueError(f"{bias_name} must have the dtype of {hidden_name} ({hidden.dtype}), got {bias.dtype}")


def check_chunk_bytes(max_chunk_bytes: int) -> None:
    """`max_chunk_bytes` is a positive int: a chunk's budget."""
    if not isinstance(max_chunk_bytes, int) or isinstance(max_chunk_bytes, bool) or max_chunk_bytes <= 0:
        raise ValueError(f"max_chunk_bytes must be a positive int, got {max_chunk_bytes!r}")


def as_device_scalar(
    value: float | torch.Tensor | None, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor | None:
    """A float or 0-dim tensor (a KL baseline, a loss's divisor) as a 0-dim tensor on `device`,
    without a gradient or a host sync; None stays None."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.device == device:
        return value.detach().to(dtype)
    # A float, or a CPU tensor (reading host memory is no device sync; copying it over would be).
    return torch.full((), float(value), dtype=dtype, device=device)


