"""Policy-gradient losses of the GRPO family (GRPO, DAPO, Dr. GRPO, BNPO, GSPO, CISPO, SAPO, LUSPO,
VESPO) from the LM head's hidden states, without the logits.

B sampled completions of T tokens each, scored where `mask` is set. Per scored token i of
completion s, with logp_i its log-probability under the policy (logits / temperature), old_i
the sampling policy's, ref_i the reference model's and A the advantage (per completion, or per
token):

    rho          = exp(logp_i - old_i)                                token-level importance
                 = exp(mean over s's scored tokens of (logp - old))   sequence-level (GSPO)
    policy_i     = -min(min(rho, delta) A, clip(rho, 1 - eps_low, 1 + eps_high) A)
                   grpo, dapo, dr_grpo, bnpo, gspo, luspo (delta: INTELLECT-2's two-sided
                   clipping, default none)
                 = -sg(min(rho, eps_high)) A logp_i                   cispo (MiniMax-M1: eps_high
                                                                      caps the ratio itself)
                 = -sigmoid(tau (rho - 1)) (4 / tau) A                sapo (tau_pos where A > 0,
                                                                      tau_neg elsewhere)
                 = -sg(phi(w_s)) A logp_i                             vespo
    kl_i         = exp(ref_i - logp_i) - (ref_i - logp_i) - 1          k3 (Schulman); times rho
                                                                      with kl_bias_correction
    loss         = sum_i w_i (v_i policy_i + beta kl_i)

sg() stops the gradient. VESPO's weight is phi(w) = e^lambda w^k e^(-lambda w) (k, lambda by the
sign of A, k_pos/lambda_pos where A >= 0) of the completion's whole ratio w_s = prod_i
rho_i v_i, each log factor clamped to [-20, 20] (v_i's below at log 1e-8) and log w_s to
[log 1e-8, 20]. v_i is the sampler's weight for rollouts from another engine (vLLM): with
`sampling_log_probs` s_i, v = exp(old_i - s_i) per token, or exp(sum over s's scored tokens)
per completion, truncated to [C_min, C_max] or set to 0 outside it (TRL's
vllm_importance_sampling_mode); 1 without (VESPO takes it into w_s instead).

The weights w_i are TRL's GRPOTrainer normalisations (trl 1.16 `_compute_loss`):

    grpo, gspo, sapo      1 / (B n_s)             each completion's token mean, then the mean over B
    bnpo                  1 / N                   the token mean over the batch (N scored tokens)
    dr_grpo               1 / (B L)               L = max_completion_length (default T)
    dapo, cispo, vespo    1 / num_items_in_batch  the token mean over the global batch (default N)
    luspo                 1 / B                   each completion's token sum, then the mean over B

gspo is grpo's normalisation with sequence-level importance (Zheng et al. 2025), luspo GSPO's
loss weighted by length (sequence level by default); the others take either level. Without
`old_log_probs` (one policy update per generation, TRL's default) old = logp detached: rho is 1
and only its gradient remains.

How it runs. The loss is a sum over tokens of terms whose derivative c_i = dloss/dlogp_i is known
once logp_i is (token level), or once the whole completion's logps are (sequence level: rho
depends on all of them; so do VESPO's w_s and, without `old_log_probs`, a per-completion sampler
weight, whatever the level; with them v is formed once, before the chunks). Per chunk of rows: one
GEMM for the logits, a Triton pass for each row's logp, lse and entropy (linear_log_probs'
kernels), c_i in closed form (a few torch ops over the chunk's tokens), a second Triton pass that
turns the logits into ``c_i (onehot - softmax) / T`` in place, and the gradient GEMMs dH = G @ W
and dW += G.T @ H: three GEMMs, no recompute, the gradients formed in forward and scaled by the
upstream gradient in backward. Token-level chunks are any rows (`max_chunk_bytes`, default 224
MiB). Sequence-level chunks hold whole completions, so that the one pass (three GEMMs) still
works: a completion's logits cost more memory than the token-level chunk (263 MB for 1024 tokens
at V = 128256 in bf16) but far less than a fourth GEMM over the batch costs time, so the default
budget grows to one completion (up to 1.5 GiB). Past that, or past an explicit budget, the head
runs two passes: logps first, then the gradients with the known c_i, one GEMM more. A frozen head
(LoRA) never needs whole completions: forward forms each row's unit gradient
``(onehot - p) / T @ W`` while its logits are at hand and scales it by c_i at the end (two GEMMs,
any level).

Extra memory: the logits chunk plus O(B T) fp32 scalars. Unscored tokens add nothing, whatever
old, ref or the advantage hold there (the kernels never read their logits), but their rows still
take their share of the GEMMs: packing them out, as TRL's fused head does, needs their count on
the host, a sync. NaN in a scored token's hidden state gives a NaN loss and NaN gradients.
"""

from __future__ import annotations

import math
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

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "gspo", "cispo", "sapo", "luspo", "vespo")
# The losses whose policy term is the clipped surrogate min(rho A, clip(rho) A).
CLIPPED = ("grpo", "dapo", "dr_grpo", "bnpo", "gspo", "luspo")
LEVELS = ("token", "sequence")
SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# Written as the target of unscored tokens so the kernels skip them: no token id, and it fits int32.
UNSCORED = -(2**31)
# Sequence-level chunks hold whole completions: the default budget grows to one completion's
# logits up to this (6144 tokens at V = 128256 in bf16, as linear_preference's default).
MAX_SEQUENCE_CHUNK_BYTES = 3 * 2**29
# VESPO's bounds on log w (TRL's, after the paper's code): w in [1e-8, e^20].
_VESPO_LOG_MIN, _VESPO_LOG_MAX = math.log(1e-8), 20.0


class PolicyOptions(NamedTuple):
    """The loss and its constants, resolved (no None left: an absent bound is +-inf)."""

    loss_type: str
    level: str
    beta: float
    epsilon_low: float
    epsilon_high: float
    temperature: float
    kl_bias_correction: bool
    delta: float  # two-sided clipping's cap on the ratio (inf: none)
    sapo_temperatures: tuple[float, float]  # (positive, non-positive advantages)
    vespo: tuple[float, float, float, float]  # (k_pos, lambda_pos, k_neg, lambda_neg)
    sampling_mode: str  # the sampler's importance weight: one of SAMPLING_MODES
    sampling_clip: tuple[float, float]  # its [C_min, C_max]


class PolicyTokens(NamedTuple):
    """Per-token inputs, flat over the B x T tokens (fp32, fp64 for fp64 hidden states; `scored`
    bool); None where not given."""

    scored: torch.Tensor
    weights: torch.Tensor  # the normalisation w_i, 0 where unscored
    advantages: torch.Tensor
    old: torch.Tensor | None
    ref: torch.Tensor | None
    sampling: torch.Tensor | None  # the sampling engine's log-probs (vLLM's), without `old`
    sampling_weight: torch.Tensor | None  # with `old`: the sampler's weight v, formed up front


def whole_completions(options: PolicyOptions, tokens: PolicyTokens) -> bool:
    """Whether a token's d loss / d logp needs its whole completion's logps: a sequence-level
    ratio, VESPO's sequence weight, or a sequence-level sampler weight that compares the sampler
    with the current policy (no `old`)."""
    sequence_weight = tokens.sampling is not None and options.sampling_mode.startswith("sequence")
    return options.level == "sequence" or options.loss_type == "vespo" or sequence_weight


def _grouped(options, tokens, seq_len, *flat):
    """Flat per-token tensors as (groups, group length): whole completions where a token's
    coefficient needs them (:func:`whole_completions`), single tokens otherwise."""
    width = seq_len if whole_completions(options, tokens) else 1
    return [None if t is None else t.view(-1, width) for t in flat]


def _by_sign(positive, like, if_true, if_false):
    # A fill, not torch.where on two Python floats (which gives the default dtype, not fp64).
    return torch.where(positive, torch.full_like(like, if_true), if_false)


class _Ratios(NamedTuple):
    rho: torch.Tensor  # the policy's importance ratio: per token, or per group at sequence level
    sampling: torch.Tensor | None  # the sampler's truncated (or masked) weight v, detached
    phi: torch.Tensor | None  # VESPO's gamma weight, detached


def _sampling_weight(options, scored, old, sampling):
    """The sampler's weight v of (G, L) tensors, whole completions for the sequence modes (one
    column then): exp(old - sampler) truncated to, or zeroed outside, [C_min, C_max]."""
    # TRL: a token the sampler left without a log-prob (NaN) is not corrected (its weight is 1).
    gap = torch.nan_to_num(torch.where(scored, old - sampling, 0.0), nan=0.0)
    if options.sampling_mode.startswith("sequence"):
        gap = gap.sum(-1, keepdim=True)
    weight = torch.exp(gap)
    low, high = options.sampling_clip
    if options.sampling_mode.endswith("truncate"):
        return weight.clamp(low, high)
    return torch.where((weight < low) | (weight > high), 0.0, weight)


def _ratios(options, logp, scored, advantages, old, sampling, weight) -> _Ratios:
    """The ratios of grouped (G, L) tensors. Without `old`, old = logp detached: rho is 1 with
    rho's gradient, and the sampler's weight compares the sampler with the current policy."""
    base = logp.detach() if old is None else old
    log_ratio = torch.where(scored, logp - base, 0.0)
    if options.level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True) / scored.sum(-1, keepdim=True).clamp(min=1)
    if sampling is not None:
        weight = _sampling_weight(options, scored, base, sampling)
    phi = None
    if options.loss_type == "vespo":
        # VESPO's w: the completion's whole ratio (a product over its tokens, not GSPO's geometric
        # mean) times the sampler's token weights, in log space; phi(w) = e^lambda w^k e^(-lambda w).
        log_w = torch.where(scored, (logp.detach() - base).clamp(-20.0, 20.0), 0.0).sum(-1, keepdim=True)
        if weight is not None:
            log_w = log_w + torch.where(scored, weight.log().clamp(_VESPO_LOG_MIN, 20.0), 0.0).sum(-1, keepdim=True)
        log_w = log_w.clamp(_VESPO_LOG_MIN, _VESPO_LOG_MAX)
        k_pos, lambda_pos, k_neg, lambda_neg = options.vespo
        nonnegative = advantages >= 0
        k = _by_sign(nonnegative, advantages, k_pos, k_neg)
        lam = _by_sign(nonnegative, advantages, lambda_pos, lambda_neg)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return _Ratios(torch.exp(log_ratio), weight, phi)


def _sapo_temperature(options, advantages):
    return _by_sign(advantages > 0, advantages, *options.sapo_temperatures)


def _k3(logp, ref):
    gap = ref - logp
    return torch.exp(gap) - gap - 1.0


def _clipped(options, rho, advantages):
    """Where the clip is active (the min takes the clipped term, whose gradient is 0), as TRL
    counts it: the high side on the ratio after two-sided clipping's cap."""
    low = (rho < 1.0 - options.epsilon_low) & (advantages < 0)
    capped = rho if options.delta == math.inf else rho.clamp(max=options.delta)
    high = (capped > 1.0 + options.epsilon_high) & (advantages > 0)
    return low, high


def _objective(options, logp, scored, weights, advantages, old, ref, sampling, given_weight):
    """The loss from grouped (G, L) tensors, written as its formula (autograd differentiates it on
    the reference path)."""
    rho, weight, phi = _ratios(options, logp, scored, advantages, old, sampling, given_weight)
    loss_type = options.loss_type
    if loss_type == "cispo":
        policy = -rho.detach().clamp(max=options.epsilon_high) * advantages * logp
    elif loss_type == "sapo":
        tau = _sapo_temperature(options, advantages)
        policy = -torch.sigmoid(tau * (rho - 1.0)) * (4.0 / tau) * advantages
    elif loss_type == "vespo":
        policy = -phi * advantages * logp
    else:
        clipped = rho.clamp(1.0 - options.epsilon_low, 1.0 + options.epsilon_high)
        policy = -torch.minimum(rho.clamp(max=options.delta) * advantages, clipped * advantages)
    if weight is not None and loss_type != "vespo":  # VESPO's phi holds the sampler's weight
        policy = policy * weight
    if options.beta:
        kl = _k3(logp, ref)
        policy = policy + options.beta * (kl * rho if options.kl_bias_correction else kl)
    return torch.where(scored, weights * policy, 0.0).sum()


def _coefficients(options, logp, scored, weights, advantages, old, ref, sampling, given_weight):
    """d loss / d logp for grouped (G, L) tensors, in closed form: through rho (at sequence level
    each token of a group moves it by rho / n_group), and through the token's own logp (CISPO's
    and VESPO's detached weights times logp, the KL term)."""
    rho, weight, phi = _ratios(options, logp, scored, advantages, old, sampling, given_weight)
    loss_type = options.loss_type
    d_rho = own = None
    if loss_type == "cispo":
        own = -rho.clamp(max=options.epsilon_high) * advantages
    elif loss_type == "vespo":
        own = -phi * advantages
    elif loss_type == "sapo":
        gate = torch.sigmoid(_sapo_temperature(options, advantages) * (rho - 1.0))
        d_rho = -4.0 * advantages * gate * (1.0 - gate)
    else:
        # -min(min(rho, delta) A, clip(rho) A) is constant in rho where the clip binds, and (delta
        # > 1) where the cap does: past delta (for A > 0 past the clip already, or the cap itself).
        low, high = _clipped(options, rho, advantages)
        held = low | high if options.delta == math.inf else low | high | (rho > options.delta)
        d_rho = torch.where(held, 0.0, -advantages)
    if weight is not None and loss_type != "vespo":
        d_rho, own = (None if d is None else d * weight for d in (d_rho, own))
    if options.beta:
        d_kl = options.beta * (1.0 - torch.exp(ref - logp))
        if options.kl_bias_correction:
            bias = options.beta * _k3(logp, ref)
            d_rho = bias if d_rho is None else d_rho + bias
            d_kl = d_kl * rho
        own = d_kl if own is None else own + d_kl
    coefficients = 0.0
    if d_rho is not None:
        if options.level == "sequence":
            n_group = scored.sum(-1, keepdim=True).clamp(min=1)
            coefficients = torch.where(scored, weights * d_rho, 0.0).sum(-1, keepdim=True) * (rho / n_group)
        else:
            coefficients = weights * d_rho * rho
    if own is not None:
        coefficients = coefficients + weights * own
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
        coefficients = _coefficients(options, *_grouped(options, tokens, seq_len, logp, *tokens)).view(-1)
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
        coefficients = _coefficients(options, *_grouped(options, tokens, seq_len, logp[rows], *_rows_of(tokens, rows)))
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
    loss = _objective(options, *_grouped(options, tokens, target.shape[-1], logp, *tokens))
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
    return _objective(options, *_grouped(options, tokens, seq_len, logp, *tokens)), logp, entropy, grads


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
    per-completion advantages and VESPO's weight with those (one value per completion, averaged
    over all B, as TRL does). The clip fractions for the clipped losses, ``cispo_clip_ratio``
    and ``vespo/phi_seq_mean`` for those losses, none for sapo (TRL's)."""
    logp, entropy = logp.detach(), entropy.detach()
    scored = tokens.scored.view(-1, seq_len)
    counts = scored.sum(-1).to(logp.dtype)
    total = counts.sum().clamp(min=1)
    advantages = tokens.advantages.view(scored.shape)
    rho, _, phi = _ratios(options, logp.view(scored.shape), scored, advantages,
                          *(None if t is None else t.view(scored.shape)
                            for t in (tokens.old, tokens.sampling, tokens.sampling_weight)))
    if per_sequence_advantages:  # TRL's flags and weights are then one per completion
        advantages = advantages[:, :1]
        phi = None if phi is None else phi[:, :1]

    def token_mean(x):
        return torch.where(scored, x, 0.0).sum() / total

    def batch_mean(x):
        # One value per completion (both ratio and advantage per completion) averages over all B, as TRL does.
        return x.to(logp.dtype).mean() if x.shape[1] == 1 else token_mean(x.to(logp.dtype))

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
    if options.loss_type == "cispo":
        metrics["cispo_clip_ratio"] = batch_mean((rho > options.epsilon_high) & (advantages > 0))
    if phi is not None:
        metrics["vespo/phi_seq_mean"] = batch_mean(phi)
    if options.loss_type not in CLIPPED:
        return metrics
    low, high = _clipped(options, rho, advantages)
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


def _plan(hidden, weight, target, whole, head_grad, max_chunk_bytes):
    n_seq, seq_len = target.shape
    return plan_chunks(whole and head_grad, n_seq, seq_len, weight.shape[0], hidden.dtype, max_chunk_bytes)


def _linear_policy_kernel(hidden, weight, target, bias, tokens, options, per_sequence_advantages, max_chunk_bytes):
    head_grad = torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad))
    plan = _plan(hidden, weight, target, whole_completions(options, tokens), head_grad, max_chunk_bytes)
    loss, logp, entropy = _LinearPolicyFunction.apply(
        hidden, weight, bias, target, tokens, options, plan, torch.is_grad_enabled()
    )
    return loss, policy_metrics(options, logp, entropy, tokens, target.shape[1], per_sequence_advantages)


def _reference(hidden, weight, target, bias, tokens, options, per_sequence_advantages, max_chunk_bytes):
    """:func:`linear_policy_loss_reference` with the kernel's arguments."""
    return linear_policy_loss_reference(hidden, weight, target, bias, tokens, options, per_sequence_advantages)


# Inside torch.compile: the policy's pass (the loss and its gradients, formed in forward) as a
# library op; the per-token inputs and the metrics are torch ops around it. The options travel as
# PolicyOptions' fields in order (its pairs and quadruple as float lists).
def _loss_fake(hidden, weight, bias, target, scored, weights, advantages, old, ref, sampling, sampling_weight,
               *options_and_rest):
    n_tokens = scored.shape[0]
    return (
        hidden.new_empty((), dtype=torch.float32), hidden.new_empty((n_tokens,), dtype=torch.float32),
        hidden.new_empty((n_tokens,), dtype=torch.float32),
        *head_grads_fake(hidden, weight, bias, options_and_rest[-3:]),
    )


@library_op(
    "linear_policy_loss",
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor scored, Tensor weights, Tensor advantages, "
    "Tensor? old, Tensor? ref, Tensor? sampling, Tensor? sampling_weight, str loss_type, str level, float beta, "
    "float epsilon_low, float epsilon_high, float temperature, bool kl_bias_correction, float delta, "
    "float[] sapo_temperatures, float[] vespo, str sampling_mode, float[] sampling_clip, int? max_chunk_bytes, "
    "bool need_hidden, bool need_weight, bool need_bias) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _loss_fake,
)
def _loss_op(hidden, weight, bias, target, scored, weights, advantages, old, ref, sampling, sampling_weight, loss_type,
             level, beta, epsilon_low, epsilon_high, temperature, kl_bias_correction, delta, sapo_temperatures, vespo,
             sampling_mode, sampling_clip, max_chunk_bytes, need_hidden, need_weight, need_bias):
    """(loss, flat logp, flat entropy, the gradients of hidden, weight and bias or empty)."""
    options = PolicyOptions(loss_type, level, beta, epsilon_low, epsilon_high, temperature, kl_bias_correction, delta,
                            tuple(sapo_temperatures), tuple(vespo), sampling_mode, tuple(sampling_clip))
    tokens = PolicyTokens(scored, weights, advantages, old, ref, sampling, sampling_weight)
    plan = _plan(hidden, weight, target, whole_completions(options, tokens), need_weight or need_bias, max_chunk_bytes)
    loss, logp, entropy, grads = _loss_and_pass(
        hidden, weight, bias, target, tokens, options, plan, (need_hidden, need_weight, need_bias)
    )
    return loss, logp, entropy, *head_grads_out(hidden, grads)


register_forward_grads_autograd(_loss_op)


def _linear_policy_compiled(hidden, weight, target, bias, tokens, options, per_sequence_advantages, max_chunk_bytes):
    def as_op_argument(value):
        if isinstance(value, tuple):
            return [float(v) for v in value]
        return value if isinstance(value, (str, bool)) else float(value)

    loss, logp, entropy, *_ = _loss_op(
        hidden, weight, bias, target, *tokens, *map(as_op_argument, options), max_chunk_bytes,
        *head_grad_needs(hidden, weight, bias),
    )
    return loss, policy_metrics(options, logp, entropy, tokens, target.shape[1], per_sequence_advantages)


LINEAR_POLICY_LOSS = Op("linear_policy_loss", _linear_policy_kernel, _reference, compiled=_linear_policy_compiled)


def _token_weights(loss_type, scored, max_completion_length, num_items_in_batch, dtype):
    """w_i of each loss type (module docstring), 0 where unscored; no host sync."""
    n_seq = scored.shape[0]
    counts = scored.sum(-1, dtype=dtype)
    if loss_type in ("grpo", "gspo", "sapo"):
        weight = 1.0 / (n_seq * counts.clamp(min=1)).unsqueeze(1)
    elif loss_type == "bnpo":
        weight = 1.0 / counts.sum().clamp(min=1)
    elif loss_type == "dr_grpo":
        weight = 1.0 / max(1, n_seq * max_completion_length)
    elif loss_type == "luspo":
        weight = 1.0 / n_seq
    elif num_items_in_batch is None:  # dapo, cispo, vespo
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


def _check_variant(options, given) -> None:
    """The constants of two-sided clipping, SAPO, VESPO and the sampler's weight."""
    delta = given["delta"]
    if delta is not None:
        if options.loss_type not in CLIPPED:
            raise ValueError(
                f"delta caps the ratio of the clipped losses ({', '.join(CLIPPED)}), not {options.loss_type!r}"
            )
        if not is_number(delta) or not delta > 1:
            raise ValueError(f"delta must be a float > 1 (INTELLECT-2 takes it above 1 + epsilon_high), got {delta!r}")
    for name, value in zip(("sapo_temperature_pos", "sapo_temperature_neg"), options.sapo_temperatures):
        if not is_number(value) or not value > 0:
            raise ValueError(f"{name} must be a positive float, got {value!r}")
    if len(options.vespo) != 4:
        raise ValueError(f"vespo_gamma must be (k_pos, lambda_pos, k_neg, lambda_neg), got {options.vespo!r}")
    for name, value in zip(("k_pos", "lambda_pos", "k_neg", "lambda_neg"), options.vespo):
        if not is_number(value) or not (value > 0 if name.startswith("lambda") else value >= 0):
            raise ValueError(f"vespo's {name} must be a {'positive' if name.startswith('lambda') else 'non-negative'} "
                             f"float, got {value!r}")
    check_choice("importance_sampling_mode", options.sampling_mode, SAMPLING_MODES)
    if options.loss_type == "vespo" and given["sampling_log_probs"] and options.sampling_mode.startswith("sequence"):
        raise ValueError("VESPO folds the sampler's per-token weights into its own: importance_sampling_mode must be "
                         f"'token_truncate' or 'token_mask', got {options.sampling_mode!r}")
    for name, value in zip(("importance_sampling_clip_min", "importance_sampling_clip_max"), given["sampling_clip"]):
        if value is not None and (not is_number(value) or not value >= 0):
            raise ValueError(f"{name} must be a non-negative float or None, got {value!r}")
    low, high = options.sampling_clip
    if low > high:
        raise ValueError(f"importance_sampling_clip_min ({low}) must not exceed importance_sampling_clip_max ({high})")


def _check(hidden, weight, target, bias, advantages, mask, options, given, max_chunk_bytes) -> None:
    check_choice("loss_type", options.loss_type, LOSS_TYPES)
    check_choice("importance_level", options.level, LEVELS)
    if options.loss_type == "gspo" and options.level != "sequence":
        raise ValueError("loss_type 'gspo' is GRPO with a sequence-level ratio: importance_level must be 'sequence' (or None)")
    _check_variant(options, given)
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
        if options.loss_type not in ("dapo", "cispo", "vespo"):
            raise ValueError("num_items_in_batch is the divisor of DAPO, CISPO and VESPO: loss_type must be 'dapo', "
                             f"'cispo' or 'vespo', got {options.loss_type!r}")
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
    delta: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_gamma: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
    sampling_log_probs: torch.Tensor | None = None,
    importance_sampling_mode: str = "sequence_mask",
    importance_sampling_clip_min: float | None = None,
    importance_sampling_clip_max: float | None = 3.0,
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
        loss_type: grpo, dapo, dr_grpo, bnpo, gspo, cispo, sapo, luspo or vespo (for cispo,
            epsilon_high caps the ratio itself: ScaleRL uses 5).
        importance_level: "token" or "sequence" (GSPO's geometric mean of the token ratios);
            default "sequence" for gspo and luspo, "token" for the others.
        temperature: the logits are divided by it (as the sampler did).
        mask: ``(B, T)``, nonzero where a token is scored (TRL's completion mask); default all.
        max_completion_length: dr_grpo's L (default T).
        num_items_in_batch: the divisor of dapo, cispo and vespo, an int or 0-dim tensor: the scored tokens of the
            global batch (TRL's normaliser); default this batch's scored tokens.
        kl_bias_correction: multiply the KL term by the ratio (TRL's use_bias_correction_kl,
            True by default there; off here as in the GRPO paper).
        delta: two-sided clipping (INTELLECT-2): the unclipped ratio is capped at delta (> 1;
            the paper takes it above 1 + epsilon_high), which binds for negative advantages.
            Clipped losses only.
        sapo_temperature_pos, sapo_temperature_neg: SAPO's gate temperatures (TRL's defaults).
        vespo_gamma: VESPO's ``(k_pos, lambda_pos, k_neg, lambda_neg)`` (TRL's defaults).
        sampling_log_probs: ``(B, T)`` the sampling engine's log-probs (vLLM's) when it is not
            the trainer: the truncated importance-sampling weight v corrects for the mismatch
            (NaN where the engine gave none: not corrected).
        importance_sampling_mode: how v is formed (TRL's vllm_importance_sampling_mode):
            token_truncate, token_mask, sequence_truncate or sequence_mask (TRL's default;
            vespo takes the token modes only).
        importance_sampling_clip_min, importance_sampling_clip_max: v's bounds C_min and C_max
            (None: unbounded on that side).
        max_chunk_bytes: the most bytes one chunk of logits may take; default 224 MiB (at
            sequence level with a trainable head, grown to one whole completion up to 1.5 GiB).

    Returns:
        ``(loss, metrics)``: the fp32 loss, differentiable in hidden, weight and bias (the
        gradients formed in forward), and detached 0-dim fp32 metrics computed without a host
        sync, as TRL logs them: ``entropy`` (mean over the scored tokens), ``kl`` (when
        ref_log_probs is given), ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
        ``clip_ratio/region_mean``, ``clip_ratio/low_min``, ``clip_ratio/high_max`` (the
        clipped losses), ``cispo_clip_ratio`` (cispo), ``vespo/phi_seq_mean`` (vespo). An
        all-masked batch gives 0 and zero gradients. Inside torch.compile the same kernels run as
        the library op ``tigon::linear_policy_loss``, the metrics as torch ops around it.
    """
    if importance_level is None:
        importance_level = "sequence" if loss_type in ("gspo", "luspo") else "token"
    sampling_clip = (importance_sampling_clip_min, importance_sampling_clip_max)
    options = PolicyOptions(
        loss_type, importance_level, beta, epsilon, epsilon if epsilon_high is None else epsilon_high,
        temperature, kl_bias_correction, math.inf if delta is None else delta,
        (sapo_temperature_pos, sapo_temperature_neg), tuple(vespo_gamma), importance_sampling_mode,
        tuple(bound if bound is not None else math.inf * sign for bound, sign in zip(sampling_clip, (-1, 1))),
    )
    given = dict(ref_log_probs=ref_log_probs is not None, max_completion_length=max_completion_length,
                 num_items_in_batch=num_items_in_batch, delta=delta, sampling_log_probs=sampling_log_probs is not None,
                 sampling_clip=sampling_clip)
    autocast, hidden, weight, bias = autocast_head(hidden, weight, bias)
    _check(hidden, weight, target, bias, advantages, mask, options, given, max_chunk_bytes)
    shape, device = target.shape, hidden.device
    dtype = torch.promote_types(hidden.dtype, torch.float32)  # of the per-token math (fp64 for fp64)
    old = None if old_log_probs is None else _per_token("old_log_probs", old_log_probs, shape, device, dtype)
    ref = None if ref_log_probs is None else _per_token("ref_log_probs", ref_log_probs, shape, device, dtype)
    scored = torch.ones(shape, dtype=torch.bool, device=device) if mask is None else mask != 0
    sampling = sampler_weight = None
    if sampling_log_probs is not None:
        sampling = _per_token("sampling_log_probs", sampling_log_probs, shape, device, dtype)
        if old is not None:  # a constant: formed once, not per chunk (nor over whole completions)
            sampler_weight = _sampling_weight(options, scored, old.view(shape), sampling.view(shape))
            sampling, sampler_weight = None, sampler_weight.expand(shape).reshape(-1)
    advantages = advantages.detach().to(dtype)
    per_sequence_advantages = advantages.dim() == 1
    if per_sequence_advantages:
        advantages = advantages.unsqueeze(1)
    tokens = PolicyTokens(
        scored.reshape(-1),
        _token_weights(loss_type, scored, max_completion_length or shape[1], num_items_in_batch, dtype).reshape(-1),
        advantages.expand(shape).reshape(-1), old, ref, sampling, sampler_weight,
    )
    return LINEAR_POLICY_LOSS.without_autocast(
        autocast, None, hidden, weight, torch.where(scored, target, UNSCORED), bias, tokens, options,
        per_sequence_advantages, max_chunk_bytes,
    )
