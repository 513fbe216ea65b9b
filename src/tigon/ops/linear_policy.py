"""Clipped policy-gradient losses (GRPO and its DAPO, Dr. GRPO, BNPO and GSPO variants) from the
LM head's hidden states, without the logits.

B sampled completions of T tokens each, scored where `mask` is set. Per scored token i of
completion s, with logp_i its log-probability under the policy (logits / temperature), old_i
the sampling policy's, ref_i the reference model's and A the advantage (per completion, or per
token):

    rho          = exp(logp_i - old_i)                                token-level importance
                 = exp(mean over s's scored tokens of (logp - old))   sequence-level (GSPO)
    policy_i     = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)
    kl_i         = exp(ref_i - logp_i) - (ref_i - logp_i) - 1          k3 (Schulman); times rho
                                                                      with kl_bias_correction
    loss         = sum_i w_i (policy_i + beta kl_i)

The weights w_i are TRL's GRPOTrainer normalisations (trl 1.16 `_compute_loss`):

    grpo, gspo   1 / (B n_s)             each completion's token mean, then the mean over B
    bnpo         1 / N                   the token mean over the batch (N scored tokens)
    dr_grpo      1 / (B L)               L = max_completion_length (default T)
    dapo         1 / num_items_in_batch  the token mean over the global batch (default N)

gspo is grpo's normalisation with sequence-level importance (Zheng et al. 2025); the others take
either level. Without `old_log_probs` (one policy update per generation, TRL's default) old =
logp detached: rho is 1 and only its gradient remains.

How it runs. The loss is a sum over tokens of terms whose derivative c_i = dloss/dlogp_i is known
once logp_i is (token level), or once the whole completion's logps are (sequence level: rho
depends on all of them). Per chunk of rows: one GEMM for the logits, a Triton pass for each row's
logp, lse and entropy (linear_log_probs' kernels), c_i in closed form (a few torch ops over the
chunk's tokens), a second Triton pass that turns the logits into ``c_i (onehot - softmax) / T``
in place, and the gradient GEMMs dH = G @ W and dW += G.T @ H: three GEMMs, no recompute, the
gradients formed in forward and scaled by the upstream gradient in backward. Token-level chunks
are any rows (`max_chunk_bytes`, default 224 MiB). Sequence-level chunks hold whole completions,
so that the one pass (three GEMMs) still works: a completion's logits cost more memory than the
token-level chunk (263 MB for 1024 tokens at V = 128256 in bf16) but far less than a fourth GEMM
over the batch costs time, so the default budget grows to one completion (up to 1.5 GiB). Past
that, or past an explicit budget, the head runs two passes: logps first, then the gradients with
the known c_i, one GEMM more. A frozen head (LoRA) never needs whole completions: forward forms
each row's unit gradient ``(onehot - p) / T @ W`` while its logits are at hand and scales it by
c_i at the end (two GEMMs, any level).

Extra memory: the logits chunk plus O(B T) fp32 scalars. Unscored tokens add nothing, whatever
old, ref or the advantage hold there (the kernels never read their logits), but their rows still
take their share of the GEMMs: packing them out, as TRL's fused head does, needs their count on
the host, a sync. NaN in a scored token's hidden state gives a NaN loss and NaN gradients.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tigon.ops._checks import check_choice, check_device, check_divisor, check_float, check_target, is_number, rows_view
from tigon.ops._chunked_head import autocast_head
from tigon.ops._chunked_head import (
    LOG_PROB_CHUNK_BYTES, as_device_scalar, backprop_head, check_chunk_bytes, check_head, chunk_rows, chunked_grads,
    chunked_log_probs, head_grad_needs, head_grads_fake, head_grads_out, log_prob_grad_rows, log_prob_rows,
    logits_chunks, register_forward_grads_autograd, scaled_forward_grads,
)
from tigon.ops._dispatch import Op, backward_fallback, library_op
from tigon.ops.linear_log_probs import linear_log_probs_reference

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "gspo")
LEVELS = ("token", "sequence")
# Written as the target of unscored tokens so the kernels skip them: no token id, and it fits int32.
UNSCORED = -(2**31)
# Sequence-level chunks hold whole completions: the default budget grows to one completion's
# logits up to this (6144 tokens at V = 128256 in bf16, as linear_preference's default).
MAX_SEQUENCE_CHUNK_BYTES = 3 * 2**29


class PolicyOptions(NamedTuple):
    """The loss and its constants, resolved (no None left)."""

    loss_type: str
    level: str
    beta: float
    epsilon_low: float
    epsilon_high: float
    temperature: float
    kl_bias_correction: bool


class PolicyTokens(NamedTuple):
    """Per-token inputs, flat over the B x T tokens (fp32, fp64 for fp64 hidden states; `scored`
    bool); None where not given."""

    scored: torch.Tensor
    weights: torch.Tensor  # the normalisation w_i, 0 where unscored
    advantages: torch.Tensor
    old: torch.Tensor | None
    ref: torch.Tensor | None


def _grouped(level: str, seq_len: int, *flat: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Flat per-token tensors as (groups, group length): the importance ratio is shared by a group,
    a whole completion at sequence level, one token at token level."""
    width = seq_len if level == "sequence" else 1
    return [None if t is None else t.view(-1, width) for t in flat]


def _importance_ratio(logp, scored, old):
    """rho per group, (G, 1). Without `old` it is exp(logp - logp.detach()): 1, with rho's gradient."""
    base = logp.detach() if old is None else old
    log_ratio = torch.where(scored, logp - base, 0.0).sum(-1, keepdim=True)
    return torch.exp(log_ratio / scored.sum(-1, keepdim=True).clamp(min=1))


def _k3(logp, ref):
    gap = ref - logp
    return torch.exp(gap) - gap - 1.0


def _clipped(options, rho, advantages):
    """Where the clip is active (the min takes the clipped term, whose gradient is 0)."""
    low = (rho < 1.0 - options.epsilon_low) & (advantages < 0)
    high = (rho > 1.0 + options.epsilon_high) & (advantages > 0)
    return low, high


def _objective(options, logp, scored, weights, advantages, old, ref):
    """The loss from grouped (G, L) tensors, written as its formula (autograd differentiates it on
    the reference path)."""
    rho = _importance_ratio(logp, scored, old)
    clipped = rho.clamp(1.0 - options.epsilon_low, 1.0 + options.epsilon_high)
    per_token = -torch.minimum(rho * advantages, clipped * advantages)
    if options.beta:
        kl = _k3(logp, ref)
        per_token = per_token + options.beta * (kl * rho if options.kl_bias_correction else kl)
    return torch.where(scored, weights * per_token, 0.0).sum()


def _coefficients(options, logp, scored, weights, advantages, old, ref):
    """d loss / d logp for grouped (G, L) tensors, in closed form: through rho, which each token
    of a group moves by rho / n_group, and through the token's own KL term."""
    rho = _importance_ratio(logp, scored, old)
    low, high = _clipped(options, rho, advantages)
    d_rho = torch.where(low | high, 0.0, -advantages)
    own = None
    if options.beta:
        d_kl = 1.0 - torch.exp(ref - logp)
        if options.kl_bias_correction:
            d_rho = d_rho + options.beta * _k3(logp, ref)
            own = options.beta * d_kl * rho
        else:
            own = options.beta * d_kl
    n_group = scored.sum(-1, keepdim=True).clamp(min=1)
    through_rho = torch.where(scored, weights * d_rho, 0.0).sum(-1, keepdim=True) * (rho / n_group)
    coefficients = through_rho if own is None else through_rho + weights * own
    return torch.where(scored, coefficients, 0.0)


class _Plan(NamedTuple):
    rows: int  # rows of one logits chunk (whole completions when the one pass needs them)
    two_pass: bool  # whole completions needed but longer than a chunk


def plan_chunks(whole_sequences, n_seq, seq_len, vocab, dtype, max_chunk_bytes) -> _Plan:
    """Chunks of any rows, or of whole completions where a sequence-level ratio meets a head that
    needs its weight gradient (the one pass); two passes when a completion exceeds the budget."""
    if not whole_sequences:
        return _Plan(chunk_rows(max_chunk_bytes or LOG_PROB_CHUNK_BYTES, vocab, dtype), False)
    sequence_bytes = seq_len * vocab * dtype.itemsize
    if max_chunk_bytes is None:
        max_chunk_bytes = max(LOG_PROB_CHUNK_BYTES, min(sequence_bytes, MAX_SEQUENCE_CHUNK_BYTES))
    sequences = min(n_seq, max_chunk_bytes // sequence_bytes)
    if sequences:
        return _Plan(sequences * seq_len, False)
    return _Plan(chunk_rows(max_chunk_bytes, vocab, dtype), True)


def _rows_of(tokens: PolicyTokens, rows: slice) -> list[torch.Tensor | None]:
    return [None if t is None else t[rows] for t in tokens]


def _policy_pass(hidden2d, weight, bias, target1d, tokens, options, plan, seq_len, needs):
    """Per-row fp32 logp and entropy, and the gradients (hidden, weight, bias) of the loss for
    those in `needs` (None for the others)."""
    inv_temperature = 1.0 / options.temperature
    need_hidden, need_weight, need_bias = needs
    device = hidden2d.device
    hidden_only = need_hidden and not need_weight and not need_bias
    if not any(needs) or hidden_only or plan.two_pass:
        grad_hidden = torch.empty(hidden2d.shape, dtype=hidden2d.dtype, device=device) if hidden_only else None
        logp, lse, entropy = chunked_log_probs(
            hidden2d, weight, bias, target1d, plan.rows, UNSCORED, inv_temperature, True, grad_hidden
        )
        if not any(needs):
            return logp, entropy, (None, None, None)
        coefficients = _coefficients(options, *_grouped(options.level, seq_len, logp, *tokens)).view(-1)
        if hidden_only:
            return logp, entropy, (grad_hidden.mul_(coefficients.unsqueeze(1)), None, None)
        grads = chunked_grads(
            hidden2d, weight, bias, target1d, lse, None, coefficients, None, UNSCORED, options.temperature, plan.rows,
            needs,
        )
        return logp, entropy, grads

    n_rows = hidden2d.shape[0]
    grad_hidden = torch.empty(hidden2d.shape, dtype=hidden2d.dtype, device=device) if need_hidden else None
    grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=device) if need_weight else None
    grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=device) if need_bias else None
    logp = torch.empty(n_rows, dtype=torch.float32, device=device)
    entropy = torch.empty(n_rows, dtype=torch.float32, device=device)
    lse = torch.empty(min(plan.rows, n_rows), dtype=torch.float32, device=device)
    for start, end, logits in logits_chunks(hidden2d, weight, bias, plan.rows):
        rows = slice(start, end)
        target_c, lse_c = target1d[rows], lse[: end - start]
        log_prob_rows(logits, target_c, logp[rows], lse_c, entropy[rows], UNSCORED, inv_temperature)
        coefficients = _coefficients(options, *_grouped(options.level, seq_len, logp[rows], *_rows_of(tokens, rows)))
        log_prob_grad_rows(
            logits, target_c, lse_c, None, coefficients.view(-1), None, UNSCORED, inv_temperature, out=logits
        )
        backprop_head(
            logits, hidden2d[rows], weight, grad_hidden[rows] if need_hidden else None, grad_weight, grad_bias,
            first=start == 0,
        )
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return logp, entropy, (grad_hidden, grad_weight, grad_bias)


def _policy_reference(hidden, weight, target, bias, tokens, options):
    """(loss, flat logp, flat entropy) from the materialised logits."""
    logp, entropy = linear_log_probs_reference(hidden, weight, target, bias, UNSCORED, options.temperature, True)
    logp = logp.reshape(-1)
    loss = _objective(options, *_grouped(options.level, target.shape[-1], logp, *tokens))
    return loss, logp, entropy.reshape(-1)


def _reference_in_function_order(hidden, weight, bias, target, tokens, options, *_):
    return _policy_reference(hidden, weight, target, bias, tokens, options)


def _reference_point(ctx, saved):
    options, plan = ctx.config
    return LINEAR_POLICY_LOSS, _reference_in_function_order, (*saved, ctx.tokens, options, plan, None)


def _loss_and_pass(hidden, weight, bias, target, tokens, options, plan, needs):
    """(loss, flat logp, flat entropy, the gradients for `needs`) by the kernels."""
    seq_len = target.shape[-1]
    logp, entropy, grads = _policy_pass(rows_view(hidden), weight, bias, target.reshape(-1), tokens, options, plan,
                                        seq_len, needs)
    return _objective(options, *_grouped(options.level, seq_len, logp, *tokens)), logp, entropy, grads


class _LinearPolicyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, tokens, options, plan, grad_enabled):
        # needs_input_grad follows requires_grad even under no_grad, when no backward can come.
        needs = tuple(grad_enabled and need for need in ctx.needs_input_grad[:3])
        loss, logp, entropy, grads = _loss_and_pass(hidden, weight, bias, target, tokens, options, plan, needs)
        ctx.save_for_backward(hidden, weight, bias, target)
        ctx.tokens, ctx.config = tokens, (options, plan)
        ctx.grads = grads if any(needs) else None
        ctx.mark_non_differentiable(logp, entropy)
        return loss, logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_loss, _grad_logp, _grad_entropy):
        hidden, weight, bias, target = saved
        options, plan = ctx.config
        grads = scaled_forward_grads(ctx, grad_loss, hidden, lambda: _policy_pass(
            rows_view(hidden), weight, bias, target.reshape(-1), ctx.tokens, options, plan, target.shape[-1],
            tuple(ctx.needs_input_grad[:3]),
        )[2])
        return (*grads, *[None] * 5)


def policy_metrics(
    options: PolicyOptions,
    logp: torch.Tensor,
    entropy: torch.Tensor,
    tokens: PolicyTokens,
    seq_len: int,
    per_sequence_advantages: bool,
) -> dict[str, torch.Tensor]:
    """TRL's GRPO metrics from the flat per-token logp and entropy, detached, without a host sync:
    token means over the scored tokens, except the clip fractions of a sequence-level ratio with
    per-completion advantages (one flag per completion, averaged over all B, as TRL does)."""
    logp, entropy = logp.detach(), entropy.detach()
    scored = tokens.scored.view(-1, seq_len)
    counts = scored.sum(-1).to(logp.dtype)
    total = counts.sum().clamp(min=1)
    rho = _importance_ratio(*_grouped(options.level, seq_len, logp, tokens.scored, tokens.old))
    if options.level == "token":
        rho = rho.view(scored.shape)
    advantages = tokens.advantages.view(scored.shape)
    if options.level == "sequence" and per_sequence_advantages:
        advantages = advantages[:, :1]
    low, high = _clipped(options, rho, advantages)

    def token_mean(x):
        return torch.where(scored, x, 0.0).sum() / total

    def batch_mean(flag):
        return flag.to(logp.dtype).mean() if flag.shape[1] == 1 else token_mean(flag.to(logp.dtype))

    def per_sequence(flag):
        flag = flag.to(logp.dtype)
        return flag[:, 0] if flag.shape[1] == 1 else torch.where(scored, flag, 0.0).sum(-1) / counts

    def nan_extreme(x, reduce, fill):
        # TRL's nanmin / nanmax over the completions (an empty one's mean is 0/0): NaN if all are.
        missing = torch.isnan(x)
        return torch.where(missing.all(), float("nan"), reduce(torch.where(missing, fill, x)))

    metrics = {}
    if tokens.ref is not None:
        kl = _k3(logp.view(scored.shape), tokens.ref.view(scored.shape))
        metrics["kl"] = token_mean(kl * rho if options.kl_bias_correction else kl)
    metrics["entropy"] = token_mean(entropy.view(scored.shape))
    metrics["clip_ratio/low_mean"] = batch_mean(low)
    metrics["clip_ratio/high_mean"] = batch_mean(high)
    metrics["clip_ratio/region_mean"] = batch_mean(low | high)
    metrics["clip_ratio/low_min"] = nan_extreme(per_sequence(low), torch.amin, float("inf"))
    metrics["clip_ratio/high_max"] = nan_extreme(per_sequence(high), torch.amax, float("-inf"))
    return metrics


def linear_policy_loss_reference(hidden, weight, target, bias, tokens, options, per_sequence_advantages):
    """The loss and metrics with the whole logits in memory: the fallback (arguments resolved as
    :func:`linear_policy_loss` resolves them; unscored targets are UNSCORED)."""
    loss, logp, entropy = _policy_reference(hidden, weight, target, bias, tokens, options)
    return loss, policy_metrics(options, logp, entropy, tokens, target.shape[-1], per_sequence_advantages)


def _plan(hidden, weight, target, level, head_grad, max_chunk_bytes):
    n_seq, seq_len = target.shape
    return plan_chunks(level == "sequence" and head_grad, n_seq, seq_len, weight.shape[0], hidden.dtype, max_chunk_bytes)


def _linear_policy_kernel(hidden, weight, target, bias, tokens, options, per_sequence_advantages, max_chunk_bytes):
    head_grad = torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad))
    plan = _plan(hidden, weight, target, options.level, head_grad, max_chunk_bytes)
    loss, logp, entropy = _LinearPolicyFunction.apply(
        hidden, weight, bias, target, tokens, options, plan, torch.is_grad_enabled()
    )
    return loss, policy_metrics(options, logp, entropy, tokens, target.shape[1], per_sequence_advantages)


def _reference(hidden, weight, target, bias, tokens, options, per_sequence_advantages, max_chunk_bytes):
    """:func:`linear_policy_loss_reference` with the kernel's arguments."""
    return linear_policy_loss_reference(hidden, weight, target, bias, tokens, options, per_sequence_advantages)


# Inside torch.compile: the policy's pass (the loss and its gradients, formed in forward) as a
# library op; the per-token inputs and the metrics are torch ops around it.
def _loss_fake(hidden, weight, bias, target, scored, weights, advantages, old, ref, loss_type, level, beta, epsilon_low,
               epsilon_high, temperature, kl_bias_correction, max_chunk_bytes, need_hidden, need_weight, need_bias):
    n_tokens = scored.shape[0]
    return (
        hidden.new_empty((), dtype=torch.float32), hidden.new_empty((n_tokens,), dtype=torch.float32),
        hidden.new_empty((n_tokens,), dtype=torch.float32),
        *head_grads_fake(hidden, weight, bias, (need_hidden, need_weight, need_bias)),
    )


@library_op(
    "linear_policy_loss",
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor scored, Tensor weights, Tensor advantages, "
    "Tensor? old, Tensor? ref, str loss_type, str level, float beta, float epsilon_low, float epsilon_high, "
    "float temperature, bool kl_bias_correction, int? max_chunk_bytes, bool need_hidden, bool need_weight, "
    "bool need_bias) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _loss_fake,
)
def _loss_op(hidden, weight, bias, target, scored, weights, advantages, old, ref, loss_type, level, beta, epsilon_low,
             epsilon_high, temperature, kl_bias_correction, max_chunk_bytes, need_hidden, need_weight, need_bias):
    """(loss, flat logp, flat entropy, the gradients of hidden, weight and bias or empty)."""
    options = PolicyOptions(loss_type, level, beta, epsilon_low, epsilon_high, temperature, kl_bias_correction)
    plan = _plan(hidden, weight, target, level, need_weight or need_bias, max_chunk_bytes)
    tokens = PolicyTokens(scored, weights, advantages, old, ref)
    loss, logp, entropy, grads = _loss_and_pass(
        hidden, weight, bias, target, tokens, options, plan, (need_hidden, need_weight, need_bias)
    )
    return loss, logp, entropy, *head_grads_out(hidden, grads)


register_forward_grads_autograd(_loss_op)


def _linear_policy_compiled(hidden, weight, target, bias, tokens, options, per_sequence_advantages, max_chunk_bytes):
    loss, logp, entropy, *_ = _loss_op(
        hidden, weight, bias, target, *tokens, options.loss_type, options.level,
        *(float(value) for value in options[2:6]), options.kl_bias_correction, max_chunk_bytes,
        *head_grad_needs(hidden, weight, bias),
    )
    return loss, policy_metrics(options, logp, entropy, tokens, target.shape[1], per_sequence_advantages)


LINEAR_POLICY_LOSS = Op("linear_policy_loss", _linear_policy_kernel, _reference, compiled=_linear_policy_compiled)


def _token_weights(loss_type, scored, max_completion_length, num_items_in_batch, dtype):
    """w_i of each loss type (module docstring), 0 where unscored; no host sync."""
    n_seq = scored.shape[0]
    counts = scored.sum(-1, dtype=dtype)
    if loss_type in ("grpo", "gspo"):
        weight = 1.0 / (n_seq * counts.clamp(min=1)).unsqueeze(1)
    elif loss_type == "bnpo":
        weight = 1.0 / counts.sum().clamp(min=1)
    elif loss_type == "dr_grpo":
        weight = 1.0 / max(1, n_seq * max_completion_length)
    elif num_items_in_batch is None:  # dapo
        weight = 1.0 / counts.sum().clamp(min=1)
    else:
        weight = 1.0 / as_device_scalar(num_items_in_batch, scored.device, dtype)
    if not isinstance(weight, torch.Tensor):  # a fill, not a copy from the host (which would sync)
        weight = torch.full((), weight, dtype=dtype, device=scored.device)
    return torch.where(scored, weight, 0.0)


def _per_token(name, values, shape, device, dtype):
    """A (B, T) per-token input as flat `dtype`, detached."""
    check_float(name, values)
    if values.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)} (one value per completion token), got {tuple(values.shape)}")
    check_device(name, values, device)
    return values.detach().to(dtype).reshape(-1)


def _check(hidden, weight, target, bias, advantages, mask, options, given, max_chunk_bytes) -> None:
    check_choice("loss_type", options.loss_type, LOSS_TYPES)
    check_choice("importance_level", options.level, LEVELS)
    if options.loss_type == "gspo" and options.level != "sequence":
        raise ValueError("loss_type 'gspo' is GRPO with a sequence-level ratio: importance_level must be 'sequence' (or None)")
    check_head(hidden, weight, bias, ("hidden", "weight", "bias"))
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape (completions, tokens, hidden size), got {tuple(hidden.shape)}")
    check_target(target, hidden.shape[:-1], hidden.device, "hidden")
    n_seq, seq_len = target.shape
    if n_seq == 0 or seq_len == 0:
        raise ValueError(f"hidden must hold at least one completion of at least one token, got shape {tuple(hidden.shape)}")
    check_float("advantages", advantages)
    if advantages.shape not in ((n_seq,), (n_seq, seq_len)):
        raise ValueError(
            f"advantages must have shape ({n_seq},) (one per completion) or ({n_seq}, {seq_len}), got {tuple(advantages.shape)}"
        )
    check_device("advantages", advantages, hidden.device)
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.shape != target.shape or mask.dtype.is_complex:
            raise ValueError(f"mask must be a tensor of shape {tuple(target.shape)} (nonzero where a token is scored), got {mask!r}")
        check_device("mask", mask, hidden.device)
    if not is_number(options.beta) or options.beta < 0:
        raise ValueError(f"beta must be a non-negative float, got {options.beta!r}")
    if options.beta and not given["ref_log_probs"]:
        raise ValueError(f"beta = {options.beta} weighs the KL to the reference: ref_log_probs must be given")
    for name in ("epsilon_low", "epsilon_high"):
        value = getattr(options, name)
        if not is_number(value) or value < 0:
            raise ValueError(f"{'epsilon' if name == 'epsilon_low' else name} must be a non-negative float, got {value!r}")
    temperature = options.temperature
    if not is_number(temperature) or not temperature > 0:
        raise ValueError(f"temperature must be a positive float, got {temperature!r}")
    if not isinstance(options.kl_bias_correction, bool):
        raise ValueError(f"kl_bias_correction must be a bool, got {options.kl_bias_correction!r}")
    length = given["max_completion_length"]
    if length is not None:
        if options.loss_type != "dr_grpo":
            raise ValueError(f"max_completion_length is Dr. GRPO's divisor: loss_type must be 'dr_grpo', got {options.loss_type!r}")
        if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
            raise ValueError(f"max_completion_length must be a positive int, got {length!r}")
    items = given["num_items_in_batch"]
    if items is not None:
        if options.loss_type != "dapo":
            raise ValueError(f"num_items_in_batch is DAPO's divisor: loss_type must be 'dapo', got {options.loss_type!r}")
        check_divisor("num_items_in_batch", items)
    if max_chunk_bytes is not None:
        check_chunk_bytes(max_chunk_bytes)


def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    advantages: torch.Tensor,
    *,
    ref_log_probs: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "grpo",
    importance_level: str | None = None,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    kl_bias_correction: bool = False,
    max_chunk_bytes: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A clipped policy-gradient loss (GRPO family) of the policy's LM head over its hidden states,
    never holding the logits. Formulas and normalisations: this module's docstring (TRL 1.16's
    GRPOTrainer semantics, before its division by the gradient-accumulation steps).

    Args:
        hidden: ``(B, T, H)`` hidden states of B completions, position t scoring token t
            (shift first). float16/bfloat16/float32 (float64 runs the reference).
        weight, bias: the policy's head, ``(V, H)`` and optional ``(V,)``, dtype of `hidden`.
        target: ``(B, T)`` int64/int32 completion token ids. A scored target outside
            ``[0, V)`` gives NaN (no host sync to check it).
        old_log_probs: ``(B, T)`` log-probs under the policy that sampled (no gradient), or
            None for the current policy's own, detached (on-policy: the ratio is 1).
        advantages: ``(B,)`` per completion, or ``(B, T)`` per token.
        ref_log_probs: ``(B, T)`` the reference model's log-probs; needed when beta > 0 (with
            beta = 0 they only feed the ``kl`` metric).
        beta: weight of the k3 KL to the reference.
        epsilon, epsilon_high: the clip range ``[1 - epsilon, 1 + epsilon_high]``
            (epsilon_high defaults to epsilon; DAPO's clip-higher uses 0.28).
        loss_type: grpo, dapo, dr_grpo, bnpo or gspo.
        importance_level: "token" or "sequence" (GSPO's geometric mean of the token ratios);
            default "sequence" for gspo, "token" for the others.
        temperature: the logits are divided by it (as the sampler did).
        mask: ``(B, T)``, nonzero where a token is scored (TRL's completion mask); default all.
        max_completion_length: dr_grpo's L (default T).
        num_items_in_batch: dapo's divisor, an int or 0-dim tensor: the scored tokens of the
            global batch (TRL's normaliser); default this batch's scored tokens.
        kl_bias_correction: multiply the KL term by the ratio (TRL's use_bias_correction_kl,
            True by default there; off here as in the GRPO paper).
        max_chunk_bytes: the most bytes one chunk of logits may take; default 224 MiB (at
            sequence level with a trainable head, grown to one whole completion up to 1.5 GiB).

    Returns:
        ``(loss, metrics)``: the fp32 loss, differentiable in hidden, weight and bias (the
        gradients formed in forward), and detached 0-dim fp32 metrics computed without a host
        sync, as TRL logs them: ``entropy`` (mean over the scored tokens), ``kl`` (when
        ref_log_probs is given), ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
        ``clip_ratio/region_mean``, ``clip_ratio/low_min``, ``clip_ratio/high_max``. An
        all-masked batch gives 0 and zero gradients. Inside torch.compile the same kernels run as
        the library op ``tigon::linear_policy_loss``, the metrics as torch ops around it.
    """
    if importance_level is None:
        importance_level = "sequence" if loss_type == "gspo" else "token"
    options = PolicyOptions(
        loss_type, importance_level, beta, epsilon, epsilon if epsilon_high is None else epsilon_high,
        temperature, kl_bias_correction,
    )
    given = dict(ref_log_probs=ref_log_probs is not None, max_completion_length=max_completion_length,
                 num_items_in_batch=num_items_in_batch)
    autocast, hidden, weight, bias = autocast_head(hidden, weight, bias)
    _check(hidden, weight, target, bias, advantages, mask, options, given, max_chunk_bytes)
    shape, device = target.shape, hidden.device
    dtype = torch.promote_types(hidden.dtype, torch.float32)  # of the per-token math (fp64 for fp64)
    old = None if old_log_probs is None else _per_token("old_log_probs", old_log_probs, shape, device, dtype)
    ref = None if ref_log_probs is None else _per_token("ref_log_probs", ref_log_probs, shape, device, dtype)
    scored = torch.ones(shape, dtype=torch.bool, device=device) if mask is None else mask != 0
    advantages = advantages.detach().to(dtype)
    per_sequence_advantages = advantages.dim() == 1
    if per_sequence_advantages:
        advantages = advantages.unsqueeze(1)
    tokens = PolicyTokens(
        scored.reshape(-1),
        _token_weights(loss_type, scored, max_completion_length or shape[1], num_items_in_batch, dtype).reshape(-1),
        advantages.expand(shape).reshape(-1), old, ref,
    )
    return LINEAR_POLICY_LOSS.without_autocast(
        autocast, None, hidden, weight, torch.where(scored, target, UNSCORED), bias, tokens, options,
        per_sequence_advantages, max_chunk_bytes,
    )
