"""Per-token log-probabilities (and entropies) of the LM head's softmax, without the logits.

    z_i      = (h_i @ W.T + b) / T
    logp_i   = log_softmax(z_i)[t_i]                 0 where t_i == ignore_index
    H_i      = -sum_j p_ij log p_ij                  (return_entropy; 0 where ignored)

and, without gradient (return_stats, what TRL's fused LM head also reports): the mean of z_i over
the vocabulary, whether t_i is its first argmax, and log sum_j p_ij^2 (0 / False where ignored).

This is what every preference loss and TRL's trainers score sequences with. The N tokens run in
chunks of C rows sized by `max_chunk_bytes`, as in linear_cross_entropy: per chunk one cuBLAS GEMM
into a private (C, V) buffer, then one Triton pass per row keeps its logp, lse and entropy (fp32):
the log-prob passes of :mod:`tigon.ops._chunked_head`, which the RL and preference losses share.

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

from tigon.ops._checks import check_ignore_index, check_target, rows_view
from tigon.ops._chunked_head import (
    LOG_PROB_CHUNK_BYTES, autocast_head, check_chunk_bytes, check_head, chunk_rows, chunked_grads, chunked_log_probs,
    head_grad_needs, head_grads_fake, head_grads_out,
)
from tigon.ops._dispatch import Op, backward_fallback, empty_if, library_op

DEFAULT_MAX_CHUNK_BYTES = LOG_PROB_CHUNK_BYTES


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
                hidden2d, weight, bias, target1d, lse, entropy, None, grad_entropy, options.ignore_index,
                options.temperature, rows, (True, False, False), grad_hidden,
            )[0]
        grads = (grad_hidden, None, None)
    elif grad_logp is None and grad_entropy is None:
        grads = (None, None, None)
    else:
        grads = chunked_grads(
            hidden2d, weight, bias, target1d, lse, entropy, grad_logp, grad_entropy, options.ignore_index,
            options.temperature, rows, needs,
        )
    grad_hidden, grad_weight, grad_bias = grads
    return (None if grad_hidden is None else grad_hidden.view(hidden.shape)), grad_weight, grad_bias


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
        weight: ``(V, H)`` (the LM head), dtype of `hidden`; under autocast any float dtype: `hidden`,
            `weight` and `bias` are cast to autocast's dtype as ``F.linear``'s operands would be.
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
    autocast, hidden, weight, bias = autocast_head(hidden, weight, bias)
    _check(hidden, weight, target, bias, options, max_chunk_bytes)
    return LINEAR_LOG_PROBS.without_autocast(
        autocast, None, hidden, weight, target, bias, ignore_index, temperature, return_entropy, return_stats, max_chunk_bytes
    )
