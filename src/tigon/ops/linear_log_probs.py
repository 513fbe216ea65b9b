"""Per-token log-probabilities (and entropies) of the LM head's softmax, without the logits.

    z_i      = (h_i @ W.T + b) / T
    logp_i   = log_softmax(z_i)[t_i]                 0 where t_i == ignore_index
    H_i      = -sum_j p_ij log p_ij                  (return_entropy; 0 where ignored)

and, without gradient (return_stats, what TRL's fused LM head also reports): the mean of z_i over
the vocabulary, whether t_i is its first argmax, and log sum_j p_ij^2 (0 / False where ignored).

This is what every preference loss and TRL's trainers score sequences with. The N tokens run in
chunks of C rows sized by `max_chunk_bytes`, as in linear_cross_entropy: per chunk one cuBLAS GEMM
into a private (C, V) buffer, then one Triton pass per row keeps its logp, lse and entropy (fp32).

The per-token upstream gradients g (of logp) and e (of H) arrive only in backward, and

    d/dz_ij = g_i ([j == t_i] - p_ij) - e_i p_ij (log p_ij + H_i)

so the weight gradient, a sum over i of g_i-weighted rows, cannot be formed before g exists:
backward recomputes each chunk's logits (one GEMM more than the materialised version, which keeps
the logits instead), writes d/dlogits over them in place and runs the gradient GEMMs. When only
`hidden` needs a gradient (a frozen head: LoRA, or the reference pass), the logp part is linear
in g per row, so forward writes the unscaled ``([j == t] - p) / T`` over its chunk and forms
``grad_hidden`` for g = 1 at once; backward then only scales its rows by g (and recomputes for
the entropy's gradient only when the entropy got one). A frozen weight never costs a
weight-gradient GEMM.

Extra memory: the logits chunk plus O(N) fp32 scalars (the g = 1 ``grad_hidden`` of the frozen
path is the gradient buffer itself).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from tigon.ops._checks import check_device, check_float, check_vector, rows_view
from tigon.ops._dispatch import Op, backward_fallback, empty_if, library_op, tl, triton
from tigon.ops._launch import launched
from tigon.ops.cross_entropy import check_target, vocab_block_config
from tigon.ops.linear_cross_entropy import _scale_in_place, chunk_rows

# The logits chunk's budget: 896 rows at V = 128256 in bf16 (219 MiB), inside the 256 MiB that
# the op may take beyond its gradients. Backward's weight-gradient GEMM has K = chunk rows, so a
# larger chunk is faster (see BENCHMARKS.md for the curve over budgets).
DEFAULT_MAX_CHUNK_BYTES = 224 * 2**20


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


class LogProbOptions(NamedTuple):
    ignore_index: int = -100
    temperature: float = 1.0
    return_entropy: bool = False
    return_stats: bool = False


class LogProbStats(NamedTuple):
    """Per-token statistics of the softmax that :func:`linear_log_probs` returns with
    ``return_stats`` (no gradient; 0 / False where the target is ignored).

    Attributes:
        mean_logits: fp32, the mean over the vocabulary of ``logits / temperature``.
        is_top1: bool, whether the target is the first most likely token.
        log_sum_sq_probs: fp32, ``log(sum_v p_v ** 2)``.
    """

    mean_logits: torch.Tensor
    is_top1: torch.Tensor
    log_sum_sq_probs: torch.Tensor


def stats_of(rows: torch.Tensor, shape: torch.Size) -> LogProbStats:
    """The kernels' (3, N) fp32 statistics (mean, top-1 as 0/1, log sum p^2) as LogProbStats of `shape`."""
    return LogProbStats(rows[0].view(shape), rows[1].view(shape) > 0, rows[2].view(shape))


def linear_log_probs_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    return_entropy: bool = False,
    return_stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The op with the whole logits in memory: the test oracle and the fallback."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    log_p = torch.log_softmax(z, dim=-1)
    valid = target != ignore_index
    index = torch.where(valid, target, 0).long()
    picked = log_p.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    zero = torch.zeros((), dtype=log_p.dtype, device=log_p.device)
    out: list[Any] = [torch.where(valid, picked, zero)]
    if return_entropy:
        out.append(torch.where(valid, -(log_p.exp() * log_p).sum(-1), zero))
    if return_stats:
        with torch.no_grad():
            # argmax of a row holding NaN is the NaN's column; the kernels call such a row no argmax.
            top1 = valid & (z.argmax(-1) == index) & ~z.isnan().any(-1)
            out.append(LogProbStats(torch.where(valid, z.mean(-1), zero), top1,
                                    torch.where(valid, torch.logsumexp(2 * log_p, -1), zero)))
    return out[0] if len(out) == 1 else tuple(out)


def head_logits(hidden_rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out = hidden_rows @ weight.T + bias`` in the input dtype (fp32 accumulation), as F.linear."""
    if bias is None:
        torch.mm(hidden_rows, weight.t(), out=out)
    else:
        torch.addmm(bias, hidden_rows, weight.t(), out=out)


def log_prob_rows(
    logits2d: torch.Tensor,
    target1d: torch.Tensor,
    logp: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    ignore_index: int,
    inv_temperature: float,
    stats: torch.Tensor | None = None,
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
    logits2d: torch.Tensor,
    target1d: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    ignore_index: int,
    inv_temperature: float,
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
    dlogits: torch.Tensor,
    hidden_rows: torch.Tensor,
    weight: torch.Tensor,
    grad_hidden_rows: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
    grad_bias: torch.Tensor | None,
    first: bool,
    accumulate_hidden: bool = False,
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


def logits_chunks(hidden2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int):
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
    hidden2d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target1d: torch.Tensor,
    rows: int,
    ignore_index: int,
    inv_temperature: float,
    with_entropy: bool = False,
    grad_hidden: torch.Tensor | None = None,
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
    hidden2d, weight, bias, target1d, lse, entropy, grad_logp, grad_entropy, options, rows, needs, grad_hidden=None
):
    """Recompute the logits chunk by chunk and return the gradients (hidden, weight, bias) of
    ``sum(grad_logp * logp + grad_entropy * H)`` for those in `needs`. A given `grad_hidden` is
    added to instead of a fresh one being written."""
    need_hidden, need_weight, need_bias = needs
    device = hidden2d.device
    accumulate = grad_hidden is not None
    if need_hidden and grad_hidden is None:
        grad_hidden = torch.empty(hidden2d.shape, dtype=hidden2d.dtype, device=device)
    grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=device) if need_weight else None
    grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=device) if need_bias else None
    inv_temperature = 1.0 / options.temperature
    for start, end, logits in logits_chunks(hidden2d, weight, bias, rows):
        log_prob_grad_rows(
            logits, target1d[start:end], lse[start:end],
            entropy[start:end] if entropy is not None else None,
            grad_logp[start:end] if grad_logp is not None else None,
            grad_entropy[start:end] if grad_entropy is not None else None,
            options.ignore_index, inv_temperature, out=logits,
        )
        backprop_head(
            logits, hidden2d[start:end], weight,
            grad_hidden[start:end] if need_hidden else None, grad_weight, grad_bias,
            first=start == 0, accumulate_hidden=accumulate,
        )
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return grad_hidden if need_hidden else None, grad_weight, grad_bias


def _forward(hidden, weight, bias, target, options, rows, unit_grad):
    """Per-row fp32 (logp, lse, entropy or None, (3, N) statistics or None) and, with `unit_grad`,
    the (N, H) gradient of ``sum(logp)`` w.r.t. the hidden rows (else None)."""
    hidden2d = rows_view(hidden)
    grad_hidden = torch.empty(hidden2d.shape, dtype=hidden.dtype, device=hidden.device) if unit_grad else None
    stats = torch.empty((3, hidden2d.shape[0]), dtype=torch.float32, device=hidden.device) if options.return_stats else None
    logp, lse, entropy = chunked_log_probs(
        hidden2d, weight, bias, target.reshape(-1), rows, options.ignore_index, 1.0 / options.temperature,
        options.return_entropy, grad_hidden, stats,
    )
    return logp, lse, entropy, stats, grad_hidden


def log_prob_grads(hidden, weight, bias, target, lse, entropy, grad_logp, grad_entropy, unit_grad_hidden, options,
                   rows, needs):
    """The gradients (hidden, weight, bias; None where `needs` says so) for the upstream gradients of
    logp and entropy (each None when it has none). `unit_grad_hidden`: the (N, H) gradient of
    ``sum(logp)`` formed in forward when only hidden needs one, or None; it is scaled in place."""
    target1d = target.reshape(-1)
    valid = target1d != options.ignore_index
    zero = torch.zeros((), dtype=torch.float32, device=target.device)
    # An ignored token's outputs are constants: its upstream gradients (whatever they hold) add nothing.
    if grad_logp is not None:
        grad_logp = torch.where(valid, grad_logp.reshape(-1).float(), zero)
    if grad_entropy is not None:
        grad_entropy = torch.where(valid, grad_entropy.reshape(-1).float(), zero)
    hidden2d = rows_view(hidden)
    if unit_grad_hidden is not None:
        grad_hidden = unit_grad_hidden.zero_() if grad_logp is None else unit_grad_hidden.mul_(grad_logp.unsqueeze(1))
        if grad_entropy is not None:
            grad_hidden = chunked_grads(
                hidden2d, weight, bias, target1d, lse, entropy, None, grad_entropy, options, rows,
                (True, False, False), grad_hidden,
            )[0]
        grads = (grad_hidden, None, None)
    elif grad_logp is None and grad_entropy is None:
        grads = (None, None, None)
    else:
        grads = chunked_grads(hidden2d, weight, bias, target1d, lse, entropy, grad_logp, grad_entropy, options, rows, needs)
    grad_hidden, grad_weight, grad_bias = grads
    return (None if grad_hidden is None else grad_hidden.view(hidden.shape)), grad_weight, grad_bias


def scaled_forward_grads(ctx, grad_loss, recompute):
    """The gradients a fused loss formed in forward (``ctx.grads``, for an upstream gradient of 1),
    scaled in place by `grad_loss`, read on the device. Handed over once: a second backward through
    a retained graph gets them from `recompute()`."""
    if ctx.grads is not None:
        grads, ctx.grads = ctx.grads, None
    else:
        grads = recompute()
    for grad in grads:
        if grad is not None:
            _scale_in_place(grad, grad_loss)
    return grads


def register_forward_grads_autograd(op) -> None:
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


def head_grads_fake(hidden, weight, bias, needs):
    """A library op's fake gradients of the head (hidden, weight, bias): empty where not needed."""
    need_hidden, need_weight, need_bias = needs
    return (empty_if(need_hidden, hidden), empty_if(need_weight, weight),
            empty_if(need_bias, weight, weight.shape[:1], None if bias is None else bias.dtype))


def head_grads_out(hidden, grads):
    """The head's gradients (hidden's as rows or in its shape; None where not formed) as a library
    op returns them: hidden's in its shape, an empty tensor for each one not formed."""
    grad_hidden, grad_weight, grad_bias = grads
    return (hidden.new_empty(0) if grad_hidden is None else grad_hidden.view(hidden.shape),
            *(hidden.new_empty(0) if grad is None else grad for grad in (grad_weight, grad_bias)))


def head_grad_needs(hidden, weight, bias) -> list[bool]:
    """Which of the head's tensors a library op must form a gradient for, decided when tracing."""
    grad_enabled = torch.is_grad_enabled()
    return [grad_enabled and t is not None and t.requires_grad for t in (hidden, weight, bias)]


def _reference_in_function_order(hidden, weight, bias, target, options, *_):
    return linear_log_probs_reference(hidden, weight, target, bias, *options)


def _reference_point(ctx, saved):
    hidden, weight, bias, target = saved[:4]
    options, rows = ctx.config
    return LINEAR_LOG_PROBS, _reference_in_function_order, (hidden, weight, bias, target, options, rows, None)


class _LinearLogProbsFunction(torch.autograd.Function):
    """(logp, then entropy with return_entropy, then the (3, ...) statistics with return_stats)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, options, rows, grad_enabled):
        # needs_input_grad follows requires_grad even under no_grad, when no backward can come.
        needs = [grad_enabled and need for need in ctx.needs_input_grad[:3]]
        # Only hidden needs a gradient: its logp part is linear in the upstream gradient per row,
        # so it is formed now, while each chunk's logits are at hand.
        logp, lse, entropy, stats, ctx.grad_hidden = _forward(
            hidden, weight, bias, target, options, rows, needs[0] and not needs[1] and not needs[2]
        )
        ctx.set_materialize_grads(False)  # an unused entropy gets no gradient (and costs no pass)
        ctx.save_for_backward(hidden, weight, bias, target, lse, entropy)
        ctx.config = (options, rows)
        out = [logp.view(target.shape)]
        if options.return_entropy:
            out.append(entropy.view(target.shape))
        if options.return_stats:
            out.append(stats.view(3, *target.shape))
            ctx.mark_non_differentiable(out[-1])
        return out[0] if len(out) == 1 else tuple(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_logp, *more):
        hidden, weight, bias, target, lse, entropy = saved
        options, rows = ctx.config
        grad_entropy = more[0] if options.return_entropy else None
        unit_grad_hidden, ctx.grad_hidden = ctx.grad_hidden, None  # handed over once (retain_graph recomputes)
        grads = log_prob_grads(
            hidden, weight, bias, target, lse, entropy, grad_logp, grad_entropy, unit_grad_hidden, options, rows,
            ctx.needs_input_grad[:3],
        )
        return (*grads, None, None, None, None)


def check_head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, names: tuple[str, str, str]) -> None:
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
    if not isinstance(max_chunk_bytes, int) or isinstance(max_chunk_bytes, bool) or max_chunk_bytes <= 0:
        raise ValueError(f"max_chunk_bytes must be a positive int, got {max_chunk_bytes!r}")


def check_ignore_index(ignore_index: int) -> None:
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")


def _check(hidden, weight, target, bias, options, max_chunk_bytes) -> None:
    check_head(hidden, weight, bias, ("hidden", "weight", "bias"))
    check_target(target, hidden.shape[:-1], hidden.device, "hidden")
    check_ignore_index(options.ignore_index)
    temperature = options.temperature
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a positive float, got {temperature!r}")
    for name in ("return_entropy", "return_stats"):
        if not isinstance(getattr(options, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(options, name)!r}")
    check_chunk_bytes(max_chunk_bytes)


def _reference(hidden, weight, target, bias, ignore_index, temperature, return_entropy, return_stats, max_chunk_bytes):
    """:func:`linear_log_probs_reference` with the public function's arguments."""
    return linear_log_probs_reference(hidden, weight, target, bias, ignore_index, temperature, return_entropy,
                                      return_stats)


def _with_stats(out, return_stats: bool, shape: torch.Size):
    """The Function's (or library op's) outputs with the (3, ...) statistics as LogProbStats."""
    if not return_stats:
        return out
    *front, stats = out
    return (*front, stats_of(stats.reshape(3, -1), shape))


def _linear_log_probs_kernel(hidden, weight, target, bias, ignore_index, temperature, return_entropy, return_stats,
                             max_chunk_bytes):
    options = LogProbOptions(ignore_index, float(temperature), return_entropy, return_stats)
    rows = chunk_rows(max_chunk_bytes, weight.shape[0], hidden.dtype)
    out = _LinearLogProbsFunction.apply(hidden, weight, bias, target, options, rows, torch.is_grad_enabled())
    return _with_stats(out, return_stats, target.shape)


# Inside torch.compile: the chunk loops as library ops (the chunk size picked from the real sizes),
# with the Function's gradients.
_OPTIONS_SCHEMA = "int ignore_index, float temperature"


def _forward_fake(hidden, weight, bias, target, ignore_index, temperature, return_entropy, return_stats,
                  max_chunk_bytes, unit_grad):
    per_row = [hidden.new_empty(target.shape, dtype=torch.float32) for _ in range(2)]
    entropy = hidden.new_empty(target.shape if return_entropy else (0,), dtype=torch.float32)
    stats = hidden.new_empty((3, *target.shape) if return_stats else (0,), dtype=torch.float32)
    return (*per_row, entropy, stats, empty_if(unit_grad, hidden))


@library_op(
    "linear_log_probs",
    f"(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, {_OPTIONS_SCHEMA}, bool return_entropy, "
    "bool return_stats, int max_chunk_bytes, bool unit_grad) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    _forward_fake,
)
def _forward_op(hidden, weight, bias, target, ignore_index, temperature, return_entropy, return_stats,
                max_chunk_bytes, unit_grad):
    """(logp, lse, entropy or empty, the (3, ...) statistics or empty, the unit hidden gradient or
    empty), per row of `target`'s shape."""
    rows = chunk_rows(max_chunk_bytes, weight.shape[0], hidden.dtype)
    options = LogProbOptions(ignore_index, temperature, return_entropy, return_stats)
    logp, lse, entropy, stats, grad_hidden = _forward(hidden, weight, bias, target, options, rows, unit_grad)
    nothing = hidden.new_empty(0, dtype=torch.float32)
    return (
        logp.view(target.shape), lse.view(target.shape),
        entropy.view(target.shape) if return_entropy else nothing,
        stats.view(3, *target.shape) if return_stats else nothing,
        grad_hidden.view(hidden.shape) if unit_grad else hidden.new_empty(0),
    )


def _backward_fake(hidden, weight, bias, target, lse, entropy, grad_logp, grad_entropy, unit_grad_hidden,
                   ignore_index, temperature, max_chunk_bytes, need_hidden, need_weight, need_bias):
    return head_grads_fake(hidden, weight, bias, (need_hidden, need_weight, need_bias))


@library_op(
    "linear_log_probs_backward",
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor lse, Tensor? entropy, Tensor? grad_logp, "
    f"Tensor? grad_entropy, Tensor? unit_grad_hidden, {_OPTIONS_SCHEMA}, int max_chunk_bytes, bool need_hidden, "
    "bool need_weight, bool need_bias) -> (Tensor, Tensor, Tensor)",
    _backward_fake,
)
def _backward_op(hidden, weight, bias, target, lse, entropy, grad_logp, grad_entropy, unit_grad_hidden,
                 ignore_index, temperature, max_chunk_bytes, need_hidden, need_weight, need_bias):
    rows = chunk_rows(max_chunk_bytes, weight.shape[0], hidden.dtype)
    options = LogProbOptions(ignore_index, temperature, entropy is not None)
    # The unit gradient is an input of this op, which must not write over it.
    unit = None if unit_grad_hidden is None else unit_grad_hidden.reshape(-1, hidden.shape[-1]).clone()
    grads = log_prob_grads(
        hidden, weight, bias, target, lse.reshape(-1), None if entropy is None else entropy.reshape(-1),
        grad_logp, grad_entropy, unit, options, rows, (need_hidden, need_weight, need_bias),
    )
    return head_grads_out(hidden, grads)


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, target, ignore_index, temperature, return_entropy, _, max_chunk_bytes, unit_grad = inputs
    _, lse, entropy, _, unit_grad_hidden = output
    ctx.save_for_backward(
        hidden, weight, bias, target, lse, entropy if return_entropy else None, unit_grad_hidden if unit_grad else None
    )
    ctx.options = (ignore_index, temperature, max_chunk_bytes)


def _op_backward(ctx, grad_logp, _grad_lse, grad_entropy, _grad_stats, _grad_unit):
    hidden, weight, bias, target, lse, entropy, unit_grad_hidden = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]
    grads = _backward_op(
        hidden, weight, bias, target, lse, entropy, grad_logp, grad_entropy if entropy is not None else None,
        unit_grad_hidden, *ctx.options, *needs,
    )
    return (*(g if need else None for g, need in zip(grads, needs)), *[None] * 7)


_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


def _linear_log_probs_compiled(hidden, weight, target, bias, ignore_index, temperature, return_entropy, return_stats,
                               max_chunk_bytes):
    needs = head_grad_needs(hidden, weight, bias)
    logp, _, entropy, stats, _ = _forward_op(
        hidden, weight, bias, target, ignore_index, float(temperature), return_entropy, return_stats, max_chunk_bytes,
        needs[0] and not needs[1] and not needs[2],
    )
    out = (logp, *([entropy] if return_entropy else []), *([stats] if return_stats else []))
    return _with_stats(out, return_stats, target.shape) if len(out) > 1 else logp


LINEAR_LOG_PROBS = Op("linear_log_probs", _linear_log_probs_kernel, _reference, compiled=_linear_log_probs_compiled)


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    temperature: float = 1.0,
    return_entropy: bool = False,
    return_stats: bool = False,
    max_chunk_bytes: int | None = None,
) -> torch.Tensor | tuple[Any, ...]:
    """``log_softmax((hidden @ weight.T + bias) / temperature)[target]`` per token, without ever
    holding the (N, V) logits.

    Args:
        hidden: ``(..., H)`` float16/bfloat16/float32 (float64 runs the reference).
        weight: ``(V, H)`` (the LM head), dtype of `hidden`.
        target: ``(...)`` int64/int32 token ids, aligned with `hidden` (position i scores
            target i: shift labels first). A target outside ``[0, V)`` gives NaN (no host sync
            to check it).
        bias: optional ``(V,)``.
        ignore_index: target value whose outputs are 0 (and pass no gradient).
        temperature: the logits are divided by it before the softmax.
        return_entropy: also return each token's entropy of that softmax (differentiable).
        return_stats: also return, without gradient, :class:`LogProbStats`: each token's mean
            tempered logit, whether its target is the most likely token, and ``log sum p^2``
            (what TRL's fused LM head reports), computed in the same pass over the logits.
        max_chunk_bytes: the most bytes one chunk of logits may take (at least one row);
            default ``DEFAULT_MAX_CHUNK_BYTES``. Larger is faster and uses more memory.

    Returns:
        fp32 log-probabilities of the shape of `target` (float64 for float64 inputs); with
        `return_entropy` and/or `return_stats` a tuple ``(log_probs, entropy, stats)`` of those
        asked for, in that order. Differentiable in hidden, weight and bias for any upstream
        gradients; no host sync. Inside torch.compile the same kernels run as the library ops
        ``tigon::linear_log_probs`` and ``_backward`` (there a returned entropy always passes its
        gradient, zero if unused).
    """
    if max_chunk_bytes is None:
        max_chunk_bytes = DEFAULT_MAX_CHUNK_BYTES
    options = LogProbOptions(ignore_index, temperature, return_entropy, return_stats)
    _check(hidden, weight, target, bias, options, max_chunk_bytes)
    return LINEAR_LOG_PROBS(
        None, hidden, weight, target, bias, ignore_index, temperature, return_entropy, return_stats, max_chunk_bytes
    )
