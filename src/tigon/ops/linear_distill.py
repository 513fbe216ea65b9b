"""Knowledge-distillation losses between a student's and a frozen teacher's LM heads, from both
models' hidden states, without either model's logits.

Per scored token, with p = softmax(student logits / T), q = softmax(teacher logits / T) over the
shared vocabulary:

    forward_kl   KL(q || p) = sum q (log q - log p)
    reverse_kl   KL(p || q) = sum p (log p - log q)
    jsd          beta KL(q || m) + (1 - beta) KL(p || m),  m = beta q + (1 - beta) p
                 (the generalised JSD of GKD, Agarwal et al. 2024, as TRL's GKD and distillation
                 trainers and Liger's fused JSD write it: beta = 0 is forward_kl, beta = 1 reverse_kl)
    tvd          (1/2) sum |p - q|

and loss = (1 - hard_weight) * mean divergence + hard_weight * mean cross-entropy of the student's
untempered logits to `target`, the means over the scored tokens (those whose target is not
ignore_index; all of them without a target) or over `num_items_in_batch`.

How it runs. The tokens run in chunks of C rows (both chunks of logits within
`max_chunk_bytes`). Per chunk: one GEMM for the teacher's logits (no gradient), one for the
student's, then one Triton program per row that reads both rows, keeps the online logsumexp of
each (and for the KLs the cross term, so their divergence is known after one pass; JSD and TVD
need a second pass for the per-row sum their gradient subtracts), and writes over the student's
logits its gradient ``d loss / d logits`` (the divergence's and the cross-entropy's, already
divided by the token count, a device scalar: no host sync). The student's gradient GEMMs
dH = G @ W and dW += G.T @ H follow, each only when wanted (a frozen student head costs no
weight-gradient GEMM). So the teacher costs one GEMM of its width and the student three of its
own, with no recompute; backward scales the gradients by the upstream gradient. The student and
the teacher may differ in hidden size and dtype, not in vocabulary.

Extra memory: the two logits chunks plus O(N) fp32 scalars.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tigon.ops._checks import (
    KERNEL_DTYPES, check_choice, check_device, check_divisor, check_ignore_index, check_target, is_number, rows_view,
)
from tigon.ops._chunked_head import (
    as_device_scalar, autocast_head, backprop_head, check_chunk_bytes, check_head, chunk_rows, head_grad_needs,
    head_grads_fake, head_grads_out, head_logits, register_forward_grads_autograd, scaled_forward_grads,
)
from tigon.ops._dispatch import Op, backward_fallback, library_op, tl, triton
from tigon.ops._launch import launched, next_power_of_2

LOSSES = ("forward_kl", "reverse_kl", "jsd", "tvd")
_KINDS = {name: kind for kind, name in enumerate(LOSSES)}
DEFAULT_BETA = 0.5  # GKD's (and TRL's GKDConfig) default interpolation
# Both logits chunks together: 512 rows at V = 128256 in bf16 (250.5 MiB), inside the 256 MiB the
# op may take beyond its gradients. The student's weight-gradient GEMM has K = chunk rows, so a
# larger chunk is faster (`tigon bench --ops linear_distill_budget` gives the curve).
DEFAULT_MAX_CHUNK_BYTES = 251 * 2**20
# The row kernel holds blocks of both models' rows at once: 8 elements per thread and array (half
# a one-row gradient pass's 16) keep its registers from spilling. Not tuned on a GPU yet.
MAX_BLOCK, ELEMENTS_PER_THREAD = 4096, 8


@launched
@triton.jit
def _distill_rows_kernel(
    student_ptr, teacher_ptr, target_ptr, divergence_ptr, nll_ptr, scale_ptr,
    n_cols, student_stride, teacher_stride, ignore_index,
    inv_temperature, beta, log_beta, log_1m_beta, soft_weight, hard_weight,
    KIND: tl.constexpr,
    HAS_TARGET: tl.constexpr,
    RAW_LSE: tl.constexpr,
    HAS_HARD: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # KIND: 0 forward KL, 1 reverse KL, 2 JSD, 3 TVD. The student's row is read, then overwritten
    # with its gradient element by element by the same thread, so it may be written in place.
    row = tl.program_id(0).to(tl.int64)
    student_ptr += row * student_stride
    teacher_ptr += row * teacher_stride
    if HAS_TARGET:
        target = tl.load(target_ptr + row)
        row_cols = tl.where(target != ignore_index, n_cols, 0)  # an ignored row reads nothing
    else:
        row_cols = n_cols
    valid = row_cols > 0
    cols = tl.arange(0, BLOCK)

    # Online logsumexp of both rows (and of the untempered student row for the cross-entropy);
    # for the KLs also the cross term, sum e^(z - m) (z_t - z_s) under the side that weighs it.
    s_max = float("-inf")
    s_sum = 0.0
    t_max = float("-inf")
    t_sum = 0.0
    r_max = float("-inf")
    r_sum = 0.0
    cross = 0.0
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        mask = offs < row_cols
        x = tl.load(student_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(teacher_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        gap = (y - x) * inv_temperature  # z_t - z_s, 0 off the row
        zs = tl.where(mask, x * inv_temperature, float("-inf"))
        zt = tl.where(mask, y * inv_temperature, float("-inf"))
        s_new = tl.maximum(s_max, tl.max(zs, axis=0))
        t_new = tl.maximum(t_max, tl.max(zt, axis=0))
        # While every value seen is -inf there is no finite shift; 0 keeps exp() at 0, not NaN.
        s_shift = tl.where(s_new == float("-inf"), 0.0, s_new)
        t_shift = tl.where(t_new == float("-inf"), 0.0, t_new)
        s_rescale = tl.exp(s_max - s_shift)
        t_rescale = tl.exp(t_max - t_shift)
        es = tl.exp(zs - s_shift)
        et = tl.exp(zt - t_shift)
        if KIND == 0:
            cross = cross * t_rescale + tl.sum(et * gap, axis=0)
        if KIND == 1:
            cross = cross * s_rescale - tl.sum(es * gap, axis=0)
        s_sum = s_sum * s_rescale + tl.sum(es, axis=0)
        t_sum = t_sum * t_rescale + tl.sum(et, axis=0)
        s_max = s_new
        t_max = t_new
        if RAW_LSE:
            xr = tl.where(mask, x, float("-inf"))
            r_new = tl.maximum(r_max, tl.max(xr, axis=0))
            r_shift = tl.where(r_new == float("-inf"), 0.0, r_new)
            r_sum = r_sum * tl.exp(r_max - r_shift) + tl.sum(tl.exp(xr - r_shift), axis=0)
            r_max = r_new
    # An ignored row has no terms: finite stand-ins keep the passes below quiet there (its outputs
    # are 0 whatever they give).
    s_sum = tl.where(valid, s_sum, 1.0)
    t_sum = tl.where(valid, t_sum, 1.0)
    lse_s = tl.where(valid, s_max + tl.log(s_sum), 0.0)
    lse_t = tl.where(valid, t_max + tl.log(t_sum), 0.0)

    if KIND == 0:
        divergence = cross / t_sum + lse_s - lse_t
    elif KIND == 1:
        divergence = cross / s_sum + lse_t - lse_s
    else:
        # The gradient subtracts a per-row sum: JSD's KL(p || m), TVD's sum p sign(p - q).
        divergence = 0.0
        aux = 0.0
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < row_cols
            log_p = tl.load(student_ptr + offs, mask=mask, other=0.0).to(tl.float32) * inv_temperature - lse_s
            log_q = tl.load(teacher_ptr + offs, mask=mask, other=0.0).to(tl.float32) * inv_temperature - lse_t
            p = tl.exp(log_p)
            q = tl.exp(log_q)
            if KIND == 2:
                a = log_p + log_1m_beta
                b = log_q + log_beta
                high = tl.maximum(a, b)
                log_m = high + tl.log(tl.exp(a - high) + tl.exp(b - high))
                student_term = p * (log_p - log_m)
                term = beta * q * (log_q - log_m) + (1.0 - beta) * student_term
                aux += tl.sum(tl.where(mask, student_term, 0.0), axis=0)
            else:
                term = 0.5 * tl.abs(p - q)
                aux += tl.sum(tl.where(mask & (p != q), tl.where(p > q, p, -p), 0.0), axis=0)
            divergence += tl.sum(tl.where(mask, term, 0.0), axis=0)
    tl.store(divergence_ptr + row, tl.where(valid, divergence, 0.0))

    if HAS_TARGET:
        if RAW_LSE:
            lse_hard = tl.where(valid, r_max + tl.log(tl.where(valid, r_sum, 1.0)), 0.0)
        else:
            lse_hard = lse_s  # temperature 1: the tempered and the untempered logits coincide
        # A target outside [0, V) that is not ignore_index has no logit: NaN, not a read out of bounds.
        in_vocab = (target >= 0) & (target < row_cols)
        x_target = tl.load(student_ptr + target, mask=in_vocab, other=float("nan")).to(tl.float32)
        tl.store(nll_ptr + row, tl.where(valid, lse_hard - x_target, 0.0))

    if WRITE_GRAD:
        scale = tl.load(scale_ptr).to(tl.float32)  # 1 / the tokens the means divide by
        soft = soft_weight * scale * inv_temperature
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < row_cols
            x = tl.load(student_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            log_p = x * inv_temperature - lse_s
            p = tl.exp(log_p)
            log_q = tl.load(teacher_ptr + offs, mask=mask, other=0.0).to(tl.float32) * inv_temperature - lse_t
            if KIND == 0:
                d = p - tl.exp(log_q)
            elif KIND == 1:
                d = p * (log_p - log_q - divergence)
            elif KIND == 2:
                a = log_p + log_1m_beta
                b = log_q + log_beta
                high = tl.maximum(a, b)
                log_m = high + tl.log(tl.exp(a - high) + tl.exp(b - high))
                d = (1.0 - beta) * p * (log_p - log_m - aux)
            else:
                q = tl.exp(log_q)
                d = 0.5 * p * (tl.where(p > q, 1.0, tl.where(p < q, -1.0, 0.0)) - aux)
            grad = soft * d
            if HAS_HARD:
                if RAW_LSE:
                    p_hard = tl.exp(x - lse_hard)
                else:
                    p_hard = p
                grad += hard_weight * scale * (p_hard - tl.where(offs == target, 1.0, 0.0))
            tl.store(student_ptr + offs, tl.where(valid, grad, 0.0).to(student_ptr.dtype.element_ty), mask=offs < n_cols)


class DistillOptions(NamedTuple):
    """The divergence and its constants, resolved: jsd at beta 0 or 1 is forward_kl or reverse_kl."""

    loss: str
    beta: float
    temperature: float
    hard_weight: float
    ignore_index: int


def _per_token_divergence(log_p, log_q, options):
    """Each row's divergence between the student's log-probs `log_p` and the teacher's `log_q`."""
    p, q = log_p.exp(), log_q.exp()
    if options.loss == "forward_kl":
        return (q * (log_q - log_p)).sum(-1)
    if options.loss == "reverse_kl":
        return (p * (log_p - log_q)).sum(-1)
    if options.loss == "tvd":
        return 0.5 * (p - q).abs().sum(-1)
    beta = options.beta
    log_m = torch.logaddexp(log_p + math.log(1.0 - beta), log_q + math.log(beta))
    return beta * (q * (log_q - log_m)).sum(-1) + (1.0 - beta) * (p * (log_p - log_m)).sum(-1)


def _distill_reference(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
                       target, scale, options):
    """(loss, mean divergence, mean cross-entropy or None) from the materialised logits."""
    logits = F.linear(student_hidden, student_weight, student_bias)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logits = logits.to(dtype)
    with torch.no_grad():
        teacher_logits = F.linear(teacher_hidden, teacher_weight, teacher_bias).to(dtype)
    log_p = torch.log_softmax(logits / options.temperature, dim=-1)
    log_q = torch.log_softmax(teacher_logits / options.temperature, dim=-1)
    divergence = _per_token_divergence(log_p, log_q, options)
    scale = scale.to(dtype)
    if target is None:  # every token scored, and no cross-entropy (hard_weight is 0)
        divergence = divergence.sum() * scale
        return divergence, divergence.detach(), None
    valid = target != options.ignore_index
    picked = torch.where(valid, target, 0).long().unsqueeze(-1)
    nll = torch.logsumexp(logits, dim=-1) - logits.gather(-1, picked).squeeze(-1)
    divergence = torch.where(valid, divergence, 0.0).sum() * scale
    nll = torch.where(valid, nll, 0.0).sum() * scale
    loss = (1.0 - options.hard_weight) * divergence + options.hard_weight * nll
    return loss, divergence.detach(), nll.detach()


def _distill_rows(student_logits, teacher_logits, target1d, divergence, nll, scale, options, write_grad):
    """One Triton program per row: the row's divergence and cross-entropy, and with `write_grad`
    the gradient over `student_logits`, written in place."""
    n_rows, n_cols = student_logits.shape
    block = min(MAX_BLOCK, next_power_of_2(n_cols))
    num_warps = max(1, min(16, block // (32 * ELEMENTS_PER_THREAD)))
    beta = options.beta
    has_target = target1d is not None
    _distill_rows_kernel[(n_rows,)](
        student_logits, teacher_logits, target1d if has_target else divergence, divergence,
        nll if has_target else divergence, scale,
        n_cols, student_logits.stride(0), teacher_logits.stride(0), options.ignore_index,
        1.0 / options.temperature, float(beta), math.log(beta) if beta > 0 else 0.0,
        math.log(1.0 - beta) if beta < 1 else 0.0, 1.0 - options.hard_weight, float(options.hard_weight),
        KIND=_KINDS[options.loss], HAS_TARGET=has_target, RAW_LSE=has_target and options.temperature != 1.0,
        HAS_HARD=has_target and options.hard_weight > 0, WRITE_GRAD=write_grad, BLOCK=block, num_warps=num_warps,
    )


def _distill_pass(student2d, student_weight, student_bias, teacher2d, teacher_weight, teacher_bias, target1d,
                  scale, options, rows, needs):
    """Per-row fp32 divergence and cross-entropy (None without a target), and the gradients
    (hidden, weight, bias) of the student for those in `needs`."""
    n_rows, vocab = student2d.shape[0], student_weight.shape[0]
    device = student2d.device
    need_hidden, need_weight, need_bias = needs
    divergence = torch.empty(n_rows, dtype=torch.float32, device=device)
    nll = torch.empty(n_rows, dtype=torch.float32, device=device) if target1d is not None else None
    grad_hidden = torch.empty(student2d.shape, dtype=student2d.dtype, device=device) if need_hidden else None
    grad_weight = torch.empty(student_weight.shape, dtype=student_weight.dtype, device=device) if need_weight else None
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if need_bias else None
    rows = min(rows, n_rows)
    student_buffer = torch.empty((rows, vocab), dtype=student2d.dtype, device=device)
    teacher_buffer = torch.empty((rows, vocab), dtype=teacher2d.dtype, device=device)
    for start in range(0, n_rows, rows):
        end = min(start + rows, n_rows)
        chunk = slice(start, end)
        logits, teacher_logits = student_buffer[: end - start], teacher_buffer[: end - start]
        head_logits(teacher2d[chunk], teacher_weight, teacher_bias, teacher_logits)
        head_logits(student2d[chunk], student_weight, student_bias, logits)
        _distill_rows(
            logits, teacher_logits, target1d[chunk] if target1d is not None else None, divergence[chunk],
            nll[chunk] if nll is not None else None, scale, options, any(needs),
        )
        if any(needs):
            backprop_head(
                logits, student2d[chunk], student_weight, grad_hidden[chunk] if need_hidden else None,
                grad_weight, grad_bias, first=start == 0,
            )
    if grad_bias is not None:
        grad_bias = grad_bias.to(student_bias.dtype)
    return divergence, nll, (grad_hidden, grad_weight, grad_bias)


def _reference_in_function_order(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                                 teacher_bias, target, scale, options, *_):
    return _distill_reference(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                              teacher_bias, target, scale, options)


def _reference_point(ctx, saved):
    options, rows = ctx.config
    return LINEAR_DISTILL_LOSS, _reference_in_function_order, (*saved, options, rows, None)


def _loss_and_pass(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, target,
                   scale, options, rows, needs):
    """(loss, mean divergence, mean cross-entropy or 0, the student's gradients for `needs`) by the kernels."""
    divergence, nll, grads = _distill_pass(
        rows_view(student_hidden), student_weight, student_bias, rows_view(teacher_hidden), teacher_weight,
        teacher_bias, target.reshape(-1) if target is not None else None, scale, options, rows, needs,
    )
    divergence = divergence.sum() * scale
    nll = nll.sum() * scale if nll is not None else torch.zeros_like(divergence)
    return (1.0 - options.hard_weight) * divergence + options.hard_weight * nll, divergence, nll, grads


def _rows(student_hidden, student_weight, teacher_hidden, max_chunk_bytes):
    """Rows per chunk: the student's share of the budget, so that both chunks together fit it."""
    student_size, teacher_size = student_hidden.dtype.itemsize, teacher_hidden.dtype.itemsize
    return chunk_rows(max_chunk_bytes // (student_size + teacher_size) * student_size, student_weight.shape[0],
                      student_hidden.dtype)


class _LinearDistillFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
                target, scale, options, rows, grad_enabled):
        # needs_input_grad follows requires_grad even under no_grad, when no backward can come.
        needs = tuple(grad_enabled and need for need in ctx.needs_input_grad[:3])
        loss, divergence, nll, grads = _loss_and_pass(
            student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, target, scale,
            options, rows, needs,
        )
        ctx.save_for_backward(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                              teacher_bias, target, scale)
        ctx.config = (options, rows)
        ctx.grads = grads if any(needs) else None
        ctx.mark_non_differentiable(divergence, nll)
        return loss, divergence, nll

    @staticmethod
    @torch.autograd.function.once_differentiable
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_loss, _grad_divergence, _grad_nll):
        hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, target, scale = saved
        options, rows = ctx.config
        grads = scaled_forward_grads(ctx, grad_loss, hidden, lambda: _distill_pass(
            rows_view(hidden), weight, bias, rows_view(teacher_hidden), teacher_weight, teacher_bias,
            target.reshape(-1) if target is not None else None, scale, options, rows, tuple(ctx.needs_input_grad[:3]),
        )[2])
        return (*grads, *[None] * 8)


def _metrics(divergence, nll):
    metrics = {"divergence": divergence}
    if nll is not None:
        metrics["cross_entropy"] = nll
    return metrics


def linear_distill_loss_reference(
    student_hidden, student_weight, teacher_hidden, teacher_weight, target, student_bias, teacher_bias, scale, options
):
    """The loss and metrics with both models' logits in memory: the fallback (arguments resolved as
    :func:`linear_distill_loss` resolves them; `scale` is the means' 1 / token count)."""
    loss, divergence, nll = _distill_reference(
        student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, target, scale,
        options,
    )
    return loss, _metrics(divergence, nll)


def _linear_distill_kernel(
    student_hidden, student_weight, teacher_hidden, teacher_weight, target, student_bias, teacher_bias, scale,
    options, max_chunk_bytes,
):
    loss, divergence, nll = _LinearDistillFunction.apply(
        student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, target, scale,
        options, _rows(student_hidden, student_weight, teacher_hidden, max_chunk_bytes), torch.is_grad_enabled(),
    )
    return loss, _metrics(divergence, nll if target is not None else None)


def _reference(student_hidden, student_weight, teacher_hidden, teacher_weight, target, student_bias, teacher_bias,
               scale, options, max_chunk_bytes):
    """:func:`linear_distill_loss_reference` with the kernel's arguments."""
    return linear_distill_loss_reference(
        student_hidden, student_weight, teacher_hidden, teacher_weight, target, student_bias, teacher_bias, scale,
        options,
    )


# Inside torch.compile: both heads' chunk loop (the loss and the student's gradients, formed in
# forward) as a library op.
def _loss_fake(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, target,
               scale, loss, beta, temperature, hard_weight, ignore_index, max_chunk_bytes, need_hidden, need_weight,
               need_bias):
    return (
        *(student_hidden.new_empty((), dtype=torch.float32) for _ in range(3)),
        *head_grads_fake(student_hidden, student_weight, student_bias, (need_hidden, need_weight, need_bias)),
    )


@library_op(
    "linear_distill_loss",
    "(Tensor student_hidden, Tensor student_weight, Tensor? student_bias, Tensor teacher_hidden, "
    "Tensor teacher_weight, Tensor? teacher_bias, Tensor? target, Tensor scale, str loss, float beta, "
    "float temperature, float hard_weight, int ignore_index, int max_chunk_bytes, bool need_hidden, "
    "bool need_weight, bool need_bias) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _loss_fake,
)
def _loss_op(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, target, scale,
             loss, beta, temperature, hard_weight, ignore_index, max_chunk_bytes, need_hidden, need_weight, need_bias):
    """(loss, mean divergence, mean cross-entropy or 0, the student's gradients or empty)."""
    options = DistillOptions(loss, beta, temperature, hard_weight, ignore_index)
    rows = _rows(student_hidden, student_weight, teacher_hidden, max_chunk_bytes)
    total, divergence, nll, grads = _loss_and_pass(
        student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, target, scale,
        options, rows, (need_hidden, need_weight, need_bias),
    )
    return total, divergence, nll, *head_grads_out(student_hidden, grads)


register_forward_grads_autograd(_loss_op)


def _linear_distill_compiled(
    student_hidden, student_weight, teacher_hidden, teacher_weight, target, student_bias, teacher_bias, scale,
    options, max_chunk_bytes,
):
    loss, divergence, nll, *_ = _loss_op(
        student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, target, scale,
        options.loss, *(float(value) for value in options[1:4]), options.ignore_index, max_chunk_bytes,
        *head_grad_needs(student_hidden, student_weight, student_bias),
    )
    return loss, _metrics(divergence, nll if target is not None else None)


LINEAR_DISTILL_LOSS = Op("linear_distill_loss", _linear_distill_kernel, _reference, compiled=_linear_distill_compiled)


def _mean_scale(target, ignore_index, n_tokens, num_items_in_batch, device, dtype):
    """1 / the token count the means divide by, as a 0-dim `dtype` tensor on `device` (no host sync)."""
    if num_items_in_batch is not None:
        return 1.0 / as_device_scalar(num_items_in_batch, device, dtype)
    if target is None:
        return torch.full((), 1.0 / max(1, n_tokens), dtype=dtype, device=device)
    return 1.0 / (target != ignore_index).sum(dtype=dtype).clamp(min=1)


def _check(student_hidden, student_weight, teacher_hidden, teacher_weight, target, student_bias, teacher_bias,
           options, beta_given, num_items_in_batch, max_chunk_bytes) -> str | None:
    check_choice("loss", options.loss, LOSSES)
    check_head(student_hidden, student_weight, student_bias, ("student_hidden", "student_weight", "student_bias"))
    check_head(teacher_hidden, teacher_weight, teacher_bias, ("teacher_hidden", "teacher_weight", "teacher_bias"))
    device = student_hidden.device
    check_device("teacher_hidden", teacher_hidden, device)
    if teacher_hidden.shape[:-1] != student_hidden.shape[:-1]:
        raise ValueError(
            f"teacher_hidden must hold the tokens of student_hidden {tuple(student_hidden.shape[:-1])} "
            f"(its own hidden size last), got {tuple(teacher_hidden.shape)}"
        )
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(
            f"teacher_weight must have the student's vocabulary ({student_weight.shape[0]}), got {teacher_weight.shape[0]}"
        )
    if target is not None:
        check_target(target, student_hidden.shape[:-1], device, "student_hidden")
    if beta_given and options.loss != "jsd":
        raise ValueError(f"beta is the JSD's interpolation; loss {options.loss!r} has none")
    if not is_number(options.beta) or not 0.0 <= options.beta <= 1.0:
        raise ValueError(f"beta must be a float in [0, 1], got {options.beta!r}")
    if not is_number(options.temperature) or not options.temperature > 0:
        raise ValueError(f"temperature must be a positive float, got {options.temperature!r}")
    if not is_number(options.hard_weight) or not 0.0 <= options.hard_weight <= 1.0:
        raise ValueError(f"hard_weight must be a float in [0, 1], got {options.hard_weight!r}")
    if options.hard_weight and target is None:
        raise ValueError("hard_weight mixes in the cross-entropy to target: target must be given")
    check_ignore_index(options.ignore_index)
    if num_items_in_batch is not None:
        check_divisor("num_items_in_batch", num_items_in_batch)
    check_chunk_bytes(max_chunk_bytes)
    if teacher_hidden.dtype not in KERNEL_DTYPES:  # the student's dtype is the dispatcher's to check
        return f"teacher_hidden dtype {teacher_hidden.dtype} runs on the reference"
    return None


def linear_distill_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    loss: str = "jsd",
    beta: float | None = None,
    temperature: float = 1.0,
    hard_weight: float = 0.0,
    ignore_index: int = -100,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    max_chunk_bytes: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A distillation loss between the student's LM head over its hidden states and the frozen
    teacher's over its own, never holding either model's logits. Formulas: this module's docstring.

    Args:
        student_hidden: ``(..., H_s)`` float16/bfloat16/float32 (float64 runs the reference).
        student_weight, student_bias: the student's head, ``(V, H_s)`` and optional ``(V,)``, in
            the student's dtype; under autocast any float dtype: both heads' operands are cast to
            autocast's dtype as ``F.linear``'s would be (an fp32 head under the HF Trainer's bf16).
        teacher_hidden: ``(..., H_t)``, the same tokens (H_t may differ from H_s).
        teacher_weight, teacher_bias: the teacher's head, ``(V, H_t)`` and optional ``(V,)``, in
            the teacher's dtype. The teacher gets no gradient.
        target: optional ``(...)`` int64/int32 token ids: tokens whose target is `ignore_index`
            are not scored, and `hard_weight` scores the student's cross-entropy to them. Without
            it every token is scored.
        loss: forward_kl (KL(teacher || student)), reverse_kl, jsd or tvd.
        beta: the JSD's interpolation in [0, 1] (loss="jsd" only; default 0.5).
        temperature: both models' logits are divided by it for the divergence.
        hard_weight: in [0, 1]: loss = (1 - hard_weight) * divergence + hard_weight *
            cross-entropy (of the untempered student logits; needs `target`).
        ignore_index: target value that is not scored.
        num_items_in_batch: the means' divisor, an int or 0-dim tensor (gradient accumulation
            that matches one large batch); default the scored tokens.
        max_chunk_bytes: the most bytes both chunks of logits together may take; default
            ``DEFAULT_MAX_CHUNK_BYTES``. Larger is faster and uses more memory.

    Returns:
        ``(loss, metrics)``: the fp32 loss, differentiable in the student's hidden, weight and
        bias (the gradients formed in forward), and detached 0-dim metrics, without a host sync:
        ``divergence`` (its mean) and, with a target, ``cross_entropy``. An all-ignored batch
        gives 0 and zero gradients. Inside torch.compile the same kernels run as the library op
        ``tigon::linear_distill_loss``.
    """
    if max_chunk_bytes is None:
        max_chunk_bytes = DEFAULT_MAX_CHUNK_BYTES
    beta_given = beta is not None
    beta = DEFAULT_BETA if beta is None else beta
    resolved = loss
    if loss == "jsd" and beta in (0, 1):  # the limits TRL and Liger take at the ends
        resolved = "forward_kl" if beta == 0 else "reverse_kl"
    options = DistillOptions(resolved, beta, temperature, hard_weight, ignore_index)
    autocast, student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias = autocast_head(
        student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias
    )
    unsupported = _check(
        student_hidden, student_weight, teacher_hidden, teacher_weight, target, student_bias, teacher_bias,
        options._replace(loss=loss), beta_given, num_items_in_batch, max_chunk_bytes,
    )
    device = student_hidden.device
    n_tokens = student_hidden.numel() // max(1, student_hidden.shape[-1])
    # fp32, or fp64 for fp64 hidden states (which run the reference)
    scale = _mean_scale(target, ignore_index, n_tokens, num_items_in_batch, device,
                        torch.promote_types(student_hidden.dtype, torch.float32))
    teacher = (teacher_hidden.detach(), teacher_weight.detach(), None if teacher_bias is None else teacher_bias.detach())
    return LINEAR_DISTILL_LOSS.without_autocast(
        autocast, unsupported, student_hidden, student_weight, teacher[0], teacher[1], target, student_bias, teacher[2], scale,
        options, max_chunk_bytes,
    )
