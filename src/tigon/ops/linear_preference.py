"""Preference losses (DPO, IPO, hinge, robust DPO, SimPO, CPO, ORPO, KTO) from the LM head's
hidden states, without the logits.

Every method is a function of per-sequence statistics: the sum S of the policy's token
log-probabilities over the scored (non-ignored) tokens, the token count n, and for the methods
with a reference model the reference's sum R. The batch is 2B sequences (B chosen, then their B
rejected) or, for KTO, B unpaired ones with a desirable/undesirable label. Per pair (u = S - R,
z = beta (u_chosen - u_rejected), a = S / n, eps = label_smoothing):

    dpo     -(1 - eps) log sig(z) - eps log sig(-z)                    Rafailov et al. 2023 (cDPO eps)
    robust  (-(1 - eps) log sig(z) + eps log sig(-z)) / (1 - 2 eps)    Chowdhury et al. 2024
    hinge   max(0, 1 - z)                                              SLiC, Zhao et al. 2023
    ipo     (u_c / n_c - u_r / n_r - 1 / (2 beta))^2                   Azar et al. 2023 (per-token, as TRL)
    simpo   dpo's form at z = beta (a_c - a_r) - gamma                 Meng et al. 2024, no reference
    cpo     dpo's form at z = beta (S_c - S_r), plus the chosen NLL    Xu et al. 2024, no reference
    orpo    -beta log sig(log odds(a_c) - log odds(a_r)), odds = e^a / (1 - e^a),
            plus the chosen NLL                                        Hong et al. 2024, no reference
    kto     w_D (1 - sig(beta (u - z0))) if desirable,
            w_U (1 - sig(beta (z0 - u))) if not                        Ethayarajh et al. 2024

and the other DPO loss types of TRL's DPOTrainer (r = beta u, per side):

    apo_zero   1 - sig(r_c) + sig(r_r)                                 D'Oosterlinck et al. 2024
    apo_down   sig(r_c) + 1 - sig(z)                                   (the same paper)
    sppo_hard  (u_c - 1 / (2 beta))^2 + (u_r + 1 / (2 beta))^2         Wu et al. 2024, hard labels
    nca_pair   -log sig(r_c) - log sig(-r_c) / 2 - log sig(-r_r) / 2   Chen et al. 2024
    bco_pair   -log sig(r_c) - log sig(-r_r)                           Jung et al. 2024
    exo_pair   sig(z) (log sig(z) - log(1 - eps)) + sig(-z) (log sig(-z) - log eps)   Ji et al. 2024
    discopop   (1 - m) (-log sig(z)) + m e^-z, m = sig(z / tau)        Chris Lu et al. 2024

bco_pair is TRL's current form, with no baseline: TRL's DPOTrainer once subtracted a running mean
of the batch rewards (a RunningMoments it kept across steps) and has dropped it; tigon keeps no
state between calls either. With `average_log_probs` the per-token means S / n and R / n stand in
for the sums (dpo's loss types but ipo, cpo and kto; ipo, simpo and orpo average already).

and loss = sum of the B per-pair (per-sequence for KTO) terms / B + nll_weight * chosen NLL, the
NLL being -sum of the chosen sequences' S / their token count (the desirable ones for KTO), or, with
`nll_target`, the same over the chosen sequences' log-probs of that other target (ORPO's NLL over
prompt and answer, as TRL's ORPOTrainer takes it, while the odds ratio scores the answer). A pair
(or KTO sequence) with a sequence that has no scored token adds 0: a preference over an empty
answer is undefined, and this keeps it from giving NaN. z0, the KL baseline, is given or
estimated as max(0, mean u) over the batch, without gradient.

How it runs. The reference (its own hidden states and head, or `ref_log_probs` given) is scored
first, without gradient: one GEMM per chunk, per-row lse and target logit only. Then the policy,
in chunks of whole pairs (chosen i with rejected i): per chunk one GEMM for its logits, a Triton
pass for per-row logp, the per-sequence sums, the per-pair losses and their derivatives c_s =
dloss/dS_s (tiny torch math on the chunk's sequences: the pairs are independent once R, the
token counts and 1/B are known), a second Triton pass that turns the logits into
``c_s (onehot - softmax)`` in place, and the gradient GEMMs dH = G @ W and dW += G.T @ H. That is
three GEMMs over the policy's rows, with no recompute. When one pair's logits exceed
`max_chunk_bytes` (long sequences), or KTO estimates z0 from the whole batch, the policy runs in
two passes instead (sums first without gradient, then the gradients with the known c_s): one GEMM
more, memory still bounded. Gradients are formed in forward, as linear_cross_entropy does, and
backward scales them by the upstream gradient; a frozen head (LoRA) costs no weight-gradient GEMM.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tigon.ops._checks import (
    TARGET_DTYPES, check_choice, check_device, check_float, check_ignore_index, check_target, is_number, rows_view,
)
from tigon.ops._chunked_head import (
    as_device_scalar, autocast_head, backprop_head, check_chunk_bytes, check_head, chunk_rows, chunked_log_probs, head_grad_needs,
    head_grads_fake, head_grads_out, head_logits, log_prob_grad_rows, log_prob_rows, logits_chunks,
    register_forward_grads_autograd, scaled_forward_grads,
)
from tigon.ops._dispatch import Op, backward_fallback, library_op
from tigon.ops.linear_log_probs import linear_log_probs_reference

# TRL's DPO loss types beyond sigmoid (dpo), ipo, hinge and robust; all score against a reference.
DPO_LOSS_TYPES = ("apo_zero", "apo_down", "sppo_hard", "nca_pair", "bco_pair", "exo_pair", "discopop")
METHODS = ("dpo", "ipo", "hinge", "robust", "simpo", "cpo", "orpo", "kto", *DPO_LOSS_TYPES)
REFERENCE_METHODS = ("dpo", "ipo", "hinge", "robust", "kto", *DPO_LOSS_TYPES)
SMOOTHED_METHODS = ("dpo", "robust", "simpo", "cpo", "exo_pair")
# ipo, simpo and orpo score per-token means already.
AVERAGED_METHODS = tuple(m for m in METHODS if m not in ("ipo", "simpo", "orpo"))
# The reward-pair methods: a loss of z = beta (u_c - u_r) alone.
_MARGIN_METHODS = ("dpo", "robust", "hinge", "exo_pair", "discopop")
DEFAULT_TAU = 0.05  # DiscoPOP's temperature (TRL's discopop_tau)
# The chosen NLL is part of CPO's and ORPO's objective (weight 1 in both papers).
DEFAULT_NLL_WEIGHT = {"cpo": 1.0, "orpo": 1.0}
DEFAULT_GAMMA = 0.5  # SimPO's target reward margin (TRL's default)
# One pair's logits must fit one chunk for the one-pass scheme: 2 x 2048 tokens at V = 128256 in
# bf16 take 1.05 GB, Qwen's V = 151936 1.24 GB. Chunks hold whole pairs, so the buffer is only as
# large as the pairs it holds.
DEFAULT_MAX_CHUNK_BYTES = 3 * 2**29
# ...and no more pairs than fit in this: the chunk is alive at the training step's memory peak
# (the loss runs with every layer's activations held), and a pair of 2 x 1024 tokens already
# makes GEMMs of 2048 rows, as fast per row as longer ones.
PREFERRED_CHUNK_BYTES = 2**28


class PreferenceOptions(NamedTuple):
    """The method and its constants, resolved (no None left)."""

    method: str
    beta: float = 0.1
    label_smoothing: float = 0.0
    nll_weight: float = 0.0
    gamma: float = DEFAULT_GAMMA
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    tau: float = DEFAULT_TAU
    ignore_index: int = -100
    average_log_probs: bool = False


def _smoothed_log_sigmoid_loss(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    loss = -F.logsigmoid(z)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-z)
    return loss


def _log1mexp(a: torch.Tensor) -> torch.Tensor:
    """log(1 - e^a) for a < 0, accurate near 0 (expm1) and far below it (log1p)."""
    return torch.where(a > -math.log(2.0), torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


def _per_token(options: PreferenceOptions, values: torch.Tensor | None, counts: torch.Tensor) -> torch.Tensor | None:
    """The per-token means that stand in for the sums under `average_log_probs` (and the scale
    the sums' derivatives take from them)."""
    if values is None or not options.average_log_probs:
        return values
    return values / counts.clamp(min=1)


def unit_losses(
    options: PreferenceOptions,
    logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    counts: torch.Tensor,
    labels: torch.Tensor | None,
    kl: torch.Tensor | None,
) -> torch.Tensor:
    """The per-pair losses (per sequence for KTO) of whole units: `logps`, `ref_logps`, `counts`
    hold the units' chosen sequences then their rejected ones (KTO: the sequences, with `labels`)."""
    method, beta, eps = options.method, options.beta, options.label_smoothing
    logps, ref_logps = _per_token(options, logps, counts), _per_token(options, ref_logps, counts)
    if method == "kto":
        valid = counts > 0
        u = logps - ref_logps
        desirable = options.desirable_weight * (1.0 - torch.sigmoid(beta * (u - kl)))
        undesirable = options.undesirable_weight * (1.0 - torch.sigmoid(beta * (kl - u)))
        return torch.where(valid, torch.where(labels, desirable, undesirable), 0.0)
    chosen, rejected = logps.chunk(2)
    n_chosen, n_rejected = counts.chunk(2)
    valid = (n_chosen > 0) & (n_rejected > 0)
    if method in REFERENCE_METHODS:
        ref_chosen, ref_rejected = ref_logps.chunk(2)
        u_chosen, u_rejected = chosen - ref_chosen, rejected - ref_rejected
        z = beta * (u_chosen - u_rejected)
        r_chosen, r_rejected = beta * u_chosen, beta * u_rejected
    if method == "dpo":
        loss = _smoothed_log_sigmoid_loss(z, eps)
    elif method == "robust":
        loss = ((1.0 - eps) * -F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1.0 - 2.0 * eps)
    elif method == "hinge":
        loss = torch.relu(1.0 - z)
    elif method == "ipo":
        h = u_chosen / n_chosen.clamp(min=1) - u_rejected / n_rejected.clamp(min=1)
        loss = (h - 1.0 / (2.0 * beta)) ** 2
    elif method == "apo_zero":
        loss = 1.0 - torch.sigmoid(r_chosen) + torch.sigmoid(r_rejected)
    elif method == "apo_down":
        loss = torch.sigmoid(r_chosen) + 1.0 - torch.sigmoid(z)
    elif method == "sppo_hard":
        loss = (u_chosen - 0.5 / beta) ** 2 + (u_rejected + 0.5 / beta) ** 2
    elif method == "nca_pair":
        loss = -F.logsigmoid(r_chosen) - 0.5 * F.logsigmoid(-r_chosen) - 0.5 * F.logsigmoid(-r_rejected)
    elif method == "bco_pair":
        loss = -F.logsigmoid(r_chosen) - F.logsigmoid(-r_rejected)
    elif method == "exo_pair":
        # KL(softmax over the pair's two rewards || (1 - eps, eps)); eps > 0 keeps log eps finite.
        loss = (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
                + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps)))
    elif method == "discopop":
        mix = torch.sigmoid(z / options.tau)
        loss = (1.0 - mix) * -F.logsigmoid(z) + mix * torch.exp(-z)
    elif method == "simpo":
        z = beta * (chosen / n_chosen.clamp(min=1) - rejected / n_rejected.clamp(min=1)) - options.gamma
        loss = _smoothed_log_sigmoid_loss(z, eps)
    elif method == "cpo":
        loss = _smoothed_log_sigmoid_loss(beta * (chosen - rejected), eps)
    else:  # orpo
        loss = -beta * F.logsigmoid(_log_odds(chosen, rejected, n_chosen, n_rejected, valid))
    return torch.where(valid, loss, 0.0)


def _log_odds(chosen, rejected, n_chosen, n_rejected, valid):
    """ORPO's log odds ratio of the average log-probs (and those averages), per pair."""
    # An empty sequence's average would be 0, where log(1 - e^a) has no gradient: give the
    # masked-out pairs a harmless value so no NaN flows back through torch.where.
    a_chosen = torch.where(valid, chosen / n_chosen.clamp(min=1), -1.0)
    a_rejected = torch.where(valid, rejected / n_rejected.clamp(min=1), -1.0)
    return (a_chosen - a_rejected) - (_log1mexp(a_chosen) - _log1mexp(a_rejected))


def _chosen(options, logps, labels):
    """The chosen (KTO: desirable) sequences' values, zero elsewhere, for the NLL term."""
    if options.method == "kto":
        return torch.where(labels, logps, 0.0)
    return logps.chunk(2)[0]


def _objective(options, logps, ref_logps, counts, labels, kl, n_units, nll_tokens, nll_logps=None):
    """This group's share of the loss: its units' losses / B, plus its part of the chosen NLL (of
    `nll_logps`, the NLL target's sums, where there is one)."""
    total = unit_losses(options, logps, ref_logps, counts, labels, kl).sum() / n_units
    if options.nll_weight:
        nll_logps = logps if nll_logps is None else nll_logps
        total = total - options.nll_weight * _chosen(options, nll_logps, labels).sum() / nll_tokens
    return total


def _sigmoid_slope(x):
    """d sig(x) / dx."""
    s = torch.sigmoid(x)
    return s * (1.0 - s)


def _pair_slopes(method, beta, u_chosen, u_rejected):
    """d loss / d u of each side, for the loss types that score the two sides' rewards apart."""
    r_chosen, r_rejected = beta * u_chosen, beta * u_rejected
    if method == "apo_zero":
        return -beta * _sigmoid_slope(r_chosen), beta * _sigmoid_slope(r_rejected)
    if method == "apo_down":
        margin = beta * _sigmoid_slope(r_chosen - r_rejected)
        return beta * _sigmoid_slope(r_chosen) - margin, margin
    if method == "sppo_hard":
        return 2.0 * (u_chosen - 0.5 / beta), 2.0 * (u_rejected + 0.5 / beta)
    if method == "nca_pair":
        return beta * (0.5 * torch.sigmoid(r_chosen) - torch.sigmoid(-r_chosen)), 0.5 * beta * torch.sigmoid(r_rejected)
    # bco_pair
    return -beta * torch.sigmoid(-r_chosen), beta * torch.sigmoid(r_rejected)


def _margin_slope(options, z):
    """d loss / d z for the losses of one margin z (dpo, robust, hinge, exo_pair, discopop; simpo
    and cpo take dpo's form)."""
    method, eps = options.method, options.label_smoothing
    if method == "hinge":
        return -(z < 1.0).to(z.dtype)
    if method == "robust":
        return (-(1.0 - eps) * torch.sigmoid(-z) - eps * torch.sigmoid(z)) / (1.0 - 2.0 * eps)
    if method == "exo_pair":
        # sig(z) log sig(z) + sig(-z) log sig(-z) has derivative sig(z) sig(-z) z.
        return _sigmoid_slope(z) * (z + math.log(eps) - math.log1p(-eps))
    if method == "discopop":
        mix = torch.sigmoid(z / options.tau)
        decay = torch.exp(-z)
        return (mix * (1.0 - mix) / options.tau * (F.logsigmoid(z) + decay)
                - (1.0 - mix) * torch.sigmoid(-z) - mix * decay)
    # dpo, simpo, cpo: -(1 - eps) log sig(z) - eps log sig(-z)
    return -(1.0 - eps) * torch.sigmoid(-z) + eps * torch.sigmoid(z)


def _unit_coefficients(options, logps, ref_logps, counts, labels, kl):
    """d (sum of :func:`unit_losses`) / d logps in closed form: the kernels' per-sequence scale.
    (Autograd cannot run inside a library op's implementation, which records no graph.)"""
    method, beta = options.method, options.beta
    logps, ref_logps = _per_token(options, logps, counts), _per_token(options, ref_logps, counts)
    if method == "kto":
        rising = torch.sigmoid(beta * (logps - ref_logps - kl))
        falling = torch.sigmoid(beta * (kl - logps + ref_logps))
        d = torch.where(labels, -options.desirable_weight * beta * rising * (1.0 - rising),
                        options.undesirable_weight * beta * falling * (1.0 - falling))
        return _per_token(options, torch.where(counts > 0, d, 0.0), counts)
    chosen, rejected = logps.chunk(2)
    n_chosen, n_rejected = counts.chunk(2)
    valid = (n_chosen > 0) & (n_rejected > 0)
    per_chosen, per_rejected = n_chosen.clamp(min=1), n_rejected.clamp(min=1)
    if method in REFERENCE_METHODS:
        ref_chosen, ref_rejected = ref_logps.chunk(2)
        u_chosen, u_rejected = chosen - ref_chosen, rejected - ref_rejected
    if method == "ipo":
        slope = 2.0 * (u_chosen / per_chosen - u_rejected / per_rejected - 1.0 / (2.0 * beta))
        d_chosen, d_rejected = slope / per_chosen, -slope / per_rejected
    elif method == "orpo":
        a_chosen = torch.where(valid, chosen / per_chosen, -1.0)
        a_rejected = torch.where(valid, rejected / per_rejected, -1.0)
        slope = -beta * torch.sigmoid(-_log_odds(chosen, rejected, n_chosen, n_rejected, valid))
        # d log_odds / d a = 1 + e^a / (1 - e^a) = -1 / expm1(a)
        d_chosen = slope * (-1.0 / torch.expm1(a_chosen)) / per_chosen
        d_rejected = slope / torch.expm1(a_rejected) / per_rejected
    elif method in ("apo_zero", "apo_down", "sppo_hard", "nca_pair", "bco_pair"):
        d_chosen, d_rejected = _pair_slopes(method, beta, u_chosen, u_rejected)
    else:
        # loss(z), z linear in the sums: d loss / d z times dz / dS of each side.
        if method == "simpo":
            z = beta * (chosen / per_chosen - rejected / per_rejected) - options.gamma
            dz_chosen, dz_rejected = beta / per_chosen, -beta / per_rejected
        else:
            z = beta * ((u_chosen - u_rejected) if method != "cpo" else (chosen - rejected))
            dz_chosen, dz_rejected = beta, -beta
        slope = _margin_slope(options, z)
        d_chosen, d_rejected = slope * dz_chosen, slope * dz_rejected
    d = torch.cat([torch.where(valid, d_chosen, 0.0), torch.where(valid, d_rejected, 0.0)])
    return _per_token(options, d, counts)


def _objective_and_coefficients(options, logps, ref_logps, counts, labels, kl, n_units, nll_tokens, nll_logps=None):
    """The group objective and its derivative w.r.t. each sequence's log-prob sum (less the NLL's
    where it has a target of its own: that one scales other rows, :func:`_grad_chunk`)."""
    total = _objective(options, logps, ref_logps, counts, labels, kl, n_units, nll_tokens, nll_logps)
    coefficients = _unit_coefficients(options, logps, ref_logps, counts, labels, kl) / n_units
    if options.nll_weight and nll_logps is None:
        chosen = _chosen(options, torch.ones_like(logps), labels)
        if options.method != "kto":
            chosen = torch.cat([chosen, torch.zeros_like(chosen)])
        coefficients = coefficients - options.nll_weight * chosen / nll_tokens
    return total, coefficients


def _estimate_kl(options, logps, ref_logps, counts):
    """KTO's baseline from the batch itself: max(0, mean log ratio over non-empty sequences)."""
    valid = counts > 0
    ratio = torch.where(valid, _per_token(options, logps - ref_logps, counts), 0.0).sum() / valid.sum().clamp(min=1)
    return ratio.clamp(min=0).detach()


def _sequence_counts(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return (target != ignore_index).sum(-1).to(torch.float32)


def _nll_tokens(options, counts, labels):
    return _chosen(options, counts, labels).sum().clamp(min=1)


def _per_row(values: torch.Tensor, seq_len: int) -> torch.Tensor:
    return values[:, None].expand(-1, seq_len).reshape(-1)


class _Plan(NamedTuple):
    one_pass: bool
    units_per_chunk: int  # whole units per chunk (one pass)
    rows: int  # rows of the logits buffer


def plan_chunks(options, n_seq, seq_len, vocab, dtype, max_chunk_bytes, kl_given):
    """One pass in chunks of whole units when one unit's logits fit the budget (and KTO's baseline
    is given; as many units as fit in ``PREFERRED_CHUNK_BYTES``, at least one), else two passes
    over chunks of rows."""
    paired = options.method != "kto"
    n_units = n_seq // 2 if paired else n_seq
    unit_rows = (2 if paired else 1) * seq_len
    row_bytes = vocab * dtype.itemsize
    budget_rows = max(1, max_chunk_bytes // row_bytes)
    if unit_rows <= budget_rows and (paired or kl_given):
        preferred_rows = min(budget_rows, PREFERRED_CHUNK_BYTES // row_bytes)
        units = min(n_units, max(1, preferred_rows // unit_rows))
        return _Plan(True, units, units * unit_rows)
    return _Plan(False, 0, min(chunk_rows(max_chunk_bytes, vocab, dtype), n_seq * seq_len))


def _segments(options, u0, u1, n_units):
    """The sequence ranges of units [u0, u1): chosen then rejected for the paired methods."""
    if options.method == "kto":
        return [(u0, u1)]
    if u0 == 0 and u1 == n_units:  # every pair: one block of rows, nothing to gather
        return [(0, 2 * n_units)]
    return [(u0, u1), (n_units + u0, n_units + u1)]


def _take(x, segments, scale=1):
    parts = [x[a * scale:b * scale] for a, b in segments]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _score_chunk(logits, target_c, nll_c, logp_c, lse_c, ignore_index):
    """Per row of a chunk of logits: its lse (into `lse_c`), the fp32 log-prob of its target and,
    with an NLL target (`nll_c`), that one's too. The kernels score one target per row: the row's
    own, or, where it has none (a prompt token), the NLL's; the NLL's is then read from the
    chunk's logits (one gathered value per row)."""
    kernel_target = target_c if nll_c is None else torch.where(target_c != ignore_index, target_c, nll_c)
    log_prob_rows(logits, kernel_target, logp_c, lse_c, None, ignore_index, 1.0)
    if nll_c is None:
        return logp_c, None
    vocab = logits.shape[1]
    in_vocab = (nll_c >= 0) & (nll_c < vocab)
    picked = logits.gather(1, nll_c.clamp(0, vocab - 1)[:, None])[:, 0].float()
    nll_logp = torch.where(nll_c != ignore_index, torch.where(in_vocab, picked, math.nan) - lse_c, 0.0)
    return torch.where(target_c != ignore_index, logp_c, 0.0), nll_logp


def _grad_chunk(logits, target_c, nll_c, lse_c, coefficient_rows, nll_scale, ignore_index):
    """Write over a chunk's logits the gradient of ``sum_rows c_row logp(target) + nll_scale
    logp(nll target)``: one kernel pass at the target :func:`_score_chunk` scored, with the two
    coefficients added where a row has both targets, then the one-hot of the NLL's moved onto its
    own column where the two differ (two scattered values per row)."""
    if nll_c is None:
        log_prob_grad_rows(logits, target_c, lse_c, None, coefficient_rows, None, ignore_index, 1.0, out=logits)
        return
    own, nll = target_c != ignore_index, nll_c != ignore_index
    kernel_target = torch.where(own, target_c, nll_c)
    rows = torch.where(own, coefficient_rows, 0.0) + torch.where(nll, nll_scale, 0.0)
    log_prob_grad_rows(logits, kernel_target, lse_c, None, rows, None, ignore_index, 1.0, out=logits)
    vocab = logits.shape[1]
    moved = own & nll & (target_c != nll_c) & (target_c >= 0) & (target_c < vocab) & (nll_c >= 0) & (nll_c < vocab)
    shift = torch.where(moved, nll_scale, 0.0).to(logits.dtype)
    index = torch.arange(logits.shape[0], device=logits.device)
    logits.index_put_((index, nll_c.clamp(0, vocab - 1)), shift, accumulate=True)
    logits.index_put_((index, target_c.clamp(0, vocab - 1)), -shift, accumulate=True)


def _sums(values, seq_len):
    return None if values is None else values.view(-1, seq_len).sum(1)


def _policy_pass(hidden2d, weight, bias, target1d, ref_logps, counts, labels, kl, options, plan, seq_len, needs,
                 nll_target1d=None):
    """The loss, the per-sequence sums, the KL baseline used, the per-sequence sums of the NLL
    target's log-probs (None without one) and (for `needs`) the gradients."""
    n_seq = counts.shape[0]
    n_units = n_seq if options.method == "kto" else n_seq // 2
    separate_nll = nll_target1d is not None
    nll_counts = (_sequence_counts(nll_target1d.view(n_seq, seq_len), options.ignore_index) if separate_nll
                  else counts)
    nll_tokens = _nll_tokens(options, nll_counts, labels)
    # The NLL's coefficient per token of its own target (the sums' coefficients carry it otherwise).
    nll_scale = -options.nll_weight / nll_tokens if separate_nll else None
    need_hidden, need_weight, need_bias = needs
    device = hidden2d.device
    grad_hidden = torch.empty(hidden2d.shape, dtype=hidden2d.dtype, device=device) if need_hidden else None
    grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=device) if need_weight else None
    grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=device) if need_bias else None
    ignore_index = options.ignore_index
    nll_logps = torch.zeros(n_seq, dtype=torch.float32, device=device) if separate_nll else None

    if any(needs) and plan.one_pass:
        logps = torch.empty(n_seq, dtype=torch.float32, device=device)
        total = torch.zeros((), dtype=torch.float32, device=device)
        buffer = torch.empty((plan.rows, weight.shape[0]), dtype=hidden2d.dtype, device=device)
        logp_rows = torch.empty(plan.rows, dtype=torch.float32, device=device)
        lse_rows = torch.empty(plan.rows, dtype=torch.float32, device=device)
        for u0 in range(0, n_units, plan.units_per_chunk):
            segments = _segments(options, u0, min(u0 + plan.units_per_chunk, n_units), n_units)
            hidden_c, target_c = _take(hidden2d, segments, seq_len), _take(target1d, segments, seq_len)
            nll_c = _take(nll_target1d, segments, seq_len) if separate_nll else None
            rows = hidden_c.shape[0]
            logits, lse_c = buffer[:rows], lse_rows[:rows]
            head_logits(hidden_c, weight, bias, logits)
            logp_c, nll_logp_c = _score_chunk(logits, target_c, nll_c, logp_rows[:rows], lse_c, ignore_index)
            sums, nll_sums = _sums(logp_c, seq_len), _sums(nll_logp_c, seq_len)
            offset = 0
            for a, b in segments:
                logps[a:b] = sums[offset:offset + b - a]
                if separate_nll:
                    nll_logps[a:b] = nll_sums[offset:offset + b - a]
                offset += b - a
            part, coefficients = _objective_and_coefficients(
                options, sums, _take(ref_logps, segments) if ref_logps is not None else None,
                _take(counts, segments), _take(labels, segments) if labels is not None else None,
                kl, n_units, nll_tokens, nll_sums,
            )
            total += part
            _grad_chunk(logits, target_c, nll_c, lse_c, _per_row(coefficients, seq_len), nll_scale, ignore_index)
            backprop_head(logits, hidden_c, weight, None, grad_weight, grad_bias, first=u0 == 0)
            if need_hidden:
                offset = 0
                for a, b in segments:
                    rows_ab = (b - a) * seq_len
                    torch.mm(logits[offset:offset + rows_ab], weight, out=grad_hidden[a * seq_len:b * seq_len])
                    offset += rows_ab
    else:
        if separate_nll:
            logp = torch.empty(target1d.shape[0], dtype=torch.float32, device=device)
            lse = torch.empty_like(logp)
            nll_logp = torch.empty_like(logp)
            for start, end, logits in logits_chunks(hidden2d, weight, bias, plan.rows):
                logp[start:end], nll_logp[start:end] = _score_chunk(
                    logits, target1d[start:end], nll_target1d[start:end], logp[start:end], lse[start:end],
                    ignore_index,
                )
            nll_logps = _sums(nll_logp, seq_len)
        else:
            logp, lse, _ = chunked_log_probs(hidden2d, weight, bias, target1d, plan.rows, ignore_index, 1.0)
        logps = _sums(logp, seq_len)
        if kl is None and options.method == "kto":
            kl = _estimate_kl(options, logps, ref_logps, counts)
        context = (ref_logps, counts, labels, kl, n_units, nll_tokens, nll_logps)
        if not any(needs):
            total = _objective(options, logps, *context)
        else:
            total, coefficients = _objective_and_coefficients(options, logps, *context)
            coefficient_rows = _per_row(coefficients, seq_len)
            for start, end, logits in logits_chunks(hidden2d, weight, bias, plan.rows):
                _grad_chunk(logits, target1d[start:end], nll_target1d[start:end] if separate_nll else None,
                            lse[start:end], coefficient_rows[start:end], nll_scale, ignore_index)
                backprop_head(
                    logits, hidden2d[start:end], weight,
                    grad_hidden[start:end] if need_hidden else None, grad_weight, grad_bias, first=start == 0,
                )
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    if kl is None:
        kl = torch.zeros((), dtype=torch.float32, device=device)
    return total, logps, kl, nll_logps, (grad_hidden, grad_weight, grad_bias)


def _reference_in_function_order(hidden, weight, bias, target, ref_logps, labels, kl, nll_target, options, *_):
    return _policy_reference(hidden, weight, target, bias, ref_logps, labels, kl, options, nll_target)[:4]


def _reference_point(ctx, saved):
    options, plan = ctx.config
    return LINEAR_PREFERENCE_LOSS, _reference_in_function_order, (*saved, options, plan, None)


class _LinearPreferenceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ref_logps, labels, kl, nll_target, options, plan, grad_enabled):
        seq_len = target.shape[-1]
        hidden2d, target1d = rows_view(hidden), target.reshape(-1)
        counts = _sequence_counts(target, options.ignore_index)
        needs = tuple(grad_enabled and need for need in ctx.needs_input_grad[:3])
        total, logps, kl_used, nll_logps, grads = _policy_pass(
            hidden2d, weight, bias, target1d, ref_logps, counts, labels, kl, options, plan, seq_len, needs,
            None if nll_target is None else nll_target.reshape(-1),
        )
        ctx.save_for_backward(hidden, weight, bias, target, ref_logps, labels, kl, nll_target)
        ctx.config = (options, plan)
        ctx.grads = grads if any(needs) else None
        if nll_logps is None:
            nll_logps = logps.new_empty(0)
        ctx.mark_non_differentiable(logps, kl_used, nll_logps)
        return total, logps, kl_used, nll_logps

    @staticmethod
    @torch.autograd.function.once_differentiable
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_loss, _grad_logps, _grad_kl, _grad_nll):
        hidden, weight, bias, target, ref_logps, labels, kl, nll_target = saved
        options, plan = ctx.config
        grads = scaled_forward_grads(ctx, grad_loss, hidden, lambda: _policy_pass(
            rows_view(hidden), weight, bias, target.reshape(-1), ref_logps,
            _sequence_counts(target, options.ignore_index), labels, kl, options, plan, target.shape[-1],
            tuple(ctx.needs_input_grad[:3]), None if nll_target is None else nll_target.reshape(-1),
        )[4])
        return (*grads, *[None] * 8)


def _policy_reference(hidden, weight, target, bias, ref_logps, labels, kl, options, nll_target=None):
    """(loss, per-sequence sums, KL baseline, the NLL target's per-sequence sums or an empty
    tensor, the per-row mean logits) from the materialised logits."""
    logp, stats = linear_log_probs_reference(hidden, weight, target, bias, options.ignore_index, return_stats=True)
    logps = logp.sum(-1)
    counts = _sequence_counts(target, options.ignore_index).to(logps.dtype)
    nll_logps, nll_counts = None, counts
    if nll_target is not None:
        nll_logps = linear_log_probs_reference(hidden, weight, nll_target, bias, options.ignore_index).sum(-1)
        nll_counts = _sequence_counts(nll_target, options.ignore_index).to(logps.dtype)
    if ref_logps is not None:
        ref_logps = ref_logps.to(logps.dtype)
    if options.method == "kto":
        kl = _estimate_kl(options, logps, ref_logps, counts) if kl is None else kl.to(logps.dtype)
    n_units = counts.shape[0] if options.method == "kto" else counts.shape[0] // 2
    total = _objective(options, logps, ref_logps, counts, labels, kl, n_units,
                       _nll_tokens(options, nll_counts, labels), nll_logps)
    if kl is None:
        kl = torch.zeros((), dtype=logps.dtype, device=logps.device)
    return total, logps, kl, logps.new_empty(0) if nll_logps is None else nll_logps, stats.mean_logits


def logit_row_means(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Each row's mean logit, fp32, without the logits: mean_j (h W_j + b_j) = h mean(W) + mean(b),
    one matrix-vector product over the hidden states (the logits' own rounding aside)."""
    with torch.no_grad():
        vocab = weight.shape[0]
        column = (weight.sum(0, dtype=torch.float32) / vocab).to(hidden.dtype)
        means = torch.mv(rows_view(hidden), column).float().view(hidden.shape[:-1])
        if bias is not None:
            means = means + bias.sum(dtype=torch.float32) / vocab
        return means


def preference_metrics(
    options: PreferenceOptions,
    logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    target: torch.Tensor,
    labels: torch.Tensor | None,
    kl: torch.Tensor,
    row_logit_means: torch.Tensor,
    nll_logps: torch.Tensor | None = None,
    nll_target: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The implicit rewards, the chosen NLL and the mean logits from the per-sequence sums and the
    rows' mean logits, detached (no sync)."""
    logps = logps.detach()
    counts = _sequence_counts(target, options.ignore_index).to(logps.dtype)
    beta = options.beta
    scored = _per_token(options, logps, counts)
    if options.method in ("simpo", "orpo"):
        rewards = beta * logps / counts.clamp(min=1)
    elif options.method == "cpo":
        rewards = beta * scored
    else:
        rewards = beta * (scored - _per_token(options, ref_logps.to(logps.dtype), counts))
    if nll_target is None:
        chosen_nll = -_chosen(options, logps, labels).sum() / _nll_tokens(options, counts, labels)
    else:
        nll_counts = _sequence_counts(nll_target, options.ignore_index).to(logps.dtype)
        chosen_nll = -_chosen(options, nll_logps.detach(), labels).sum() / _nll_tokens(options, nll_counts, labels)
    # Over the scored tokens, as TRL's logits/chosen and logits/rejected.
    logit_sums = torch.where(target != options.ignore_index, row_logit_means.detach(), 0.0).sum(-1).to(logps.dtype)
    if options.method == "kto":
        desirable = labels.to(logps.dtype)
        chosen_rewards = torch.where(labels, rewards, 0.0).sum() / desirable.sum().clamp(min=1)
        rejected_rewards = torch.where(labels, 0.0, rewards).sum() / (1.0 - desirable).sum().clamp(min=1)
        chosen_logits = torch.where(labels, logit_sums, 0.0).sum() / torch.where(labels, counts, 0.0).sum().clamp(min=1)
        rejected_logits = (torch.where(labels, 0.0, logit_sums).sum()
                           / torch.where(labels, 0.0, counts).sum().clamp(min=1))
        return {
            "rewards": rewards, "logps": scored, "kl": kl.detach(),
            "chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards,
            "margin": chosen_rewards - rejected_rewards, "chosen_nll": chosen_nll,
            "chosen_logits_mean": chosen_logits, "rejected_logits_mean": rejected_logits,
        }
    chosen_rewards, rejected_rewards = rewards.chunk(2)
    chosen_logps, rejected_logps = scored.chunk(2)
    chosen_sums, rejected_sums = logit_sums.chunk(2)
    n_chosen, n_rejected = counts.chunk(2)
    metrics = {
        "chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards,
        "margin": chosen_rewards - rejected_rewards,
        "accuracy": (chosen_rewards > rejected_rewards).to(logps.dtype),
        "chosen_logps": chosen_logps, "rejected_logps": rejected_logps, "chosen_nll": chosen_nll,
        "chosen_logits_mean": chosen_sums.sum() / n_chosen.sum().clamp(min=1),
        "rejected_logits_mean": rejected_sums.sum() / n_rejected.sum().clamp(min=1),
    }
    if options.method == "orpo":
        metrics["log_odds_ratio"] = _log_odds(*logps.chunk(2), n_chosen, n_rejected, (n_chosen > 0) & (n_rejected > 0))
    return metrics


def linear_preference_loss_reference(
    hidden, weight, target, bias, ref_hidden, ref_weight, ref_bias, ref_log_probs, labels, kl_baseline, nll_target,
    options,
):
    """The loss and metrics with the whole logits in memory: the fallback (arguments resolved
    as :func:`linear_preference_loss` resolves them; `nll_target` for all 2B sequences, the
    rejected ones' ignored)."""
    with torch.no_grad():
        if ref_hidden is not None:
            ref_log_probs = linear_log_probs_reference(
                ref_hidden, ref_weight, target, ref_bias, options.ignore_index
            ).sum(-1)
    kl = as_device_scalar(kl_baseline, hidden.device, torch.promote_types(hidden.dtype, torch.float32))
    total, logps, kl, nll_logps, row_means = _policy_reference(
        hidden, weight, target, bias, ref_log_probs, labels, kl, options, nll_target
    )
    return total, preference_metrics(options, logps, ref_log_probs, target, labels, kl, row_means, nll_logps,
                                     nll_target)


def _score_reference(hidden, weight, target, ref_hidden, ref_weight, ref_bias, options, plan, max_chunk_bytes):
    """The reference model's per-sequence log-prob sums, fp32, without gradient."""
    n_seq, seq_len = target.shape
    with torch.no_grad():
        same_logits = ref_weight.shape[0] == weight.shape[0] and ref_hidden.dtype == hidden.dtype
        # The policy's chunk size where the logits match, so both passes reuse one buffer size.
        rows = plan.rows if same_logits else chunk_rows(max_chunk_bytes, ref_weight.shape[0], ref_hidden.dtype)
        return chunked_log_probs(
            rows_view(ref_hidden), ref_weight, ref_bias, target.reshape(-1), rows, options.ignore_index, 1.0
        )[0].view(n_seq, seq_len).sum(1)


def _plan(options, hidden, weight, target, max_chunk_bytes, kl):
    n_seq, seq_len = target.shape
    return plan_chunks(options, n_seq, seq_len, weight.shape[0], hidden.dtype, max_chunk_bytes, kl is not None)


def _linear_preference_kernel(
    hidden, weight, target, bias, ref_hidden, ref_weight, ref_bias, ref_log_probs, labels, kl_baseline, nll_target,
    options, max_chunk_bytes,
):
    kl = as_device_scalar(kl_baseline, hidden.device)
    plan = _plan(options, hidden, weight, target, max_chunk_bytes, kl)
    if ref_hidden is not None:
        ref_log_probs = _score_reference(hidden, weight, target, ref_hidden, ref_weight, ref_bias, options, plan,
                                         max_chunk_bytes)
    elif ref_log_probs is not None:
        ref_log_probs = ref_log_probs.detach().float()
    total, logps, kl_used, nll_logps = _LinearPreferenceFunction.apply(
        hidden, weight, bias, target, ref_log_probs, labels, kl, nll_target, options, plan, torch.is_grad_enabled()
    )
    return total, preference_metrics(options, logps, ref_log_probs, target, labels, kl_used,
                                     logit_row_means(hidden, weight, bias), nll_logps, nll_target)


def _reference(hidden, weight, target, bias, ref_hidden, ref_weight, ref_bias, ref_log_probs, labels, kl_baseline,
               nll_target, options, max_chunk_bytes):
    """:func:`linear_preference_loss_reference` with the kernel's arguments."""
    return linear_preference_loss_reference(
        hidden, weight, target, bias, ref_hidden, ref_weight, ref_bias, ref_log_probs, labels, kl_baseline,
        nll_target, options,
    )


# Inside torch.compile: the reference's scoring and the policy's pass (the loss and its gradients,
# formed in forward) as one library op; the metrics are torch ops around it.
def _loss_fake(hidden, weight, bias, target, ref_hidden, ref_weight, ref_bias, ref_log_probs, labels, kl, nll_target,
               method, beta, label_smoothing, nll_weight, gamma, desirable_weight, undesirable_weight, tau,
               ignore_index, average_log_probs, max_chunk_bytes, need_hidden, need_weight, need_bias):
    n_seq = target.shape[0]
    return (
        hidden.new_empty((), dtype=torch.float32), hidden.new_empty((n_seq,), dtype=torch.float32),
        hidden.new_empty((), dtype=torch.float32),
        hidden.new_empty((n_seq,) if ref_hidden is not None else (0,), dtype=torch.float32),
        hidden.new_empty((n_seq,) if nll_target is not None else (0,), dtype=torch.float32),
        *head_grads_fake(hidden, weight, bias, (need_hidden, need_weight, need_bias)),
    )


@library_op(
    "linear_preference_loss",
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor? ref_hidden, Tensor? ref_weight, "
    "Tensor? ref_bias, Tensor? ref_log_probs, Tensor? labels, Tensor? kl, Tensor? nll_target, str method, float beta, "
    "float label_smoothing, float nll_weight, float gamma, float desirable_weight, float undesirable_weight, "
    "float tau, int ignore_index, bool average_log_probs, int max_chunk_bytes, bool need_hidden, bool need_weight, "
    "bool need_bias) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _loss_fake,
)
def _loss_op(hidden, weight, bias, target, ref_hidden, ref_weight, ref_bias, ref_log_probs, labels, kl, nll_target,
             method, beta, label_smoothing, nll_weight, gamma, desirable_weight, undesirable_weight, tau, ignore_index,
             average_log_probs, max_chunk_bytes, need_hidden, need_weight, need_bias):
    """(loss, per-sequence sums, KL baseline used, the reference's sums scored from ref_hidden or
    empty, the NLL target's sums or empty, the gradients of hidden, weight and bias or empty)."""
    options = PreferenceOptions(method, beta, label_smoothing, nll_weight, gamma, desirable_weight, undesirable_weight,
                                tau, ignore_index, average_log_probs)
    plan = _plan(options, hidden, weight, target, max_chunk_bytes, kl)
    scored = None
    if ref_hidden is not None:
        scored = ref_log_probs = _score_reference(
            hidden, weight, target, ref_hidden, ref_weight, ref_bias, options, plan, max_chunk_bytes
        )
    total, logps, kl_used, nll_logps, grads = _policy_pass(
        rows_view(hidden), weight, bias, target.reshape(-1), ref_log_probs,
        _sequence_counts(target, ignore_index), labels, kl, options, plan, target.shape[-1],
        (need_hidden, need_weight, need_bias), None if nll_target is None else nll_target.reshape(-1),
    )
    return (
        total, logps, kl_used.clone(),  # a copy: the baseline used may be the one given, an input
        *(hidden.new_empty(0, dtype=torch.float32) if t is None else t for t in (scored, nll_logps)),
        *head_grads_out(hidden, grads),
    )


register_forward_grads_autograd(_loss_op)


def _linear_preference_compiled(
    hidden, weight, target, bias, ref_hidden, ref_weight, ref_bias, ref_log_probs, labels, kl_baseline, nll_target,
    options, max_chunk_bytes,
):
    kl = as_device_scalar(kl_baseline, hidden.device)
    if ref_log_probs is not None:
        ref_log_probs = ref_log_probs.detach().float()
    total, logps, kl_used, scored, nll_logps, *_ = _loss_op(
        hidden, weight, bias, target, ref_hidden, ref_weight, ref_bias, ref_log_probs, labels, kl, nll_target,
        options.method, *(float(value) for value in options[1:-2]), options.ignore_index, options.average_log_probs,
        max_chunk_bytes, *head_grad_needs(hidden, weight, bias),
    )
    ref_log_probs = scored if ref_hidden is not None else ref_log_probs
    return total, preference_metrics(options, logps, ref_log_probs, target, labels, kl_used,
                                     logit_row_means(hidden, weight, bias), nll_logps, nll_target)


LINEAR_PREFERENCE_LOSS = Op(
    "linear_preference_loss", _linear_preference_kernel, _reference, compiled=_linear_preference_compiled
)


def _check(
    hidden, weight, target, bias, ref_hidden, ref_weight, ref_bias, ref_log_probs, labels, kl_baseline, nll_target,
    options, max_chunk_bytes, given,
) -> None:
    method = options.method
    check_choice("method", method, METHODS)
    check_head(hidden, weight, bias, ("hidden", "weight", "bias"))
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape (sequences, tokens, hidden size), got {tuple(hidden.shape)}")
    check_target(target, hidden.shape[:-1], hidden.device, "hidden")
    n_seq = hidden.shape[0]
    if method == "kto":
        if n_seq == 0:
            raise ValueError("hidden must hold at least one sequence for method 'kto', got 0")
        if not isinstance(labels, torch.Tensor) or labels.dtype != torch.bool or labels.shape != (n_seq,):
            raise ValueError(f"labels must be a bool tensor of shape ({n_seq},) (desirable or not) for method 'kto', got {labels!r}")
        check_device("labels", labels, hidden.device)
    else:
        if labels is not None:
            raise ValueError(f"labels are for method 'kto'; method {method!r} takes chosen then rejected sequences")
        if n_seq == 0 or n_seq % 2:
            raise ValueError(
                f"hidden must hold 2B sequences (B chosen, then their B rejected) for method {method!r}, got {n_seq}"
            )
    if method in REFERENCE_METHODS:
        if (ref_hidden is None) == (ref_log_probs is None):
            raise ValueError(f"method {method!r} needs exactly one of ref_hidden and ref_log_probs")
    elif any(x is not None for x in (ref_hidden, ref_weight, ref_bias, ref_log_probs)):
        raise ValueError(f"method {method!r} is reference-free: ref_hidden, ref_weight, ref_bias and ref_log_probs must be None")
    if ref_hidden is not None:
        check_head(ref_hidden, ref_weight, ref_bias, ("ref_hidden", "ref_weight", "ref_bias"))
        if ref_hidden.shape != hidden.shape:
            raise ValueError(f"ref_hidden must have the shape of hidden {tuple(hidden.shape)}, got {tuple(ref_hidden.shape)}")
        check_device("ref_hidden", ref_hidden, hidden.device)
    elif ref_weight is not None or ref_bias is not None:
        raise ValueError("ref_weight and ref_bias go with ref_hidden, which is None")
    if ref_log_probs is not None:
        check_float("ref_log_probs", ref_log_probs)
        if ref_log_probs.shape != (n_seq,):
            raise ValueError(f"ref_log_probs must have shape ({n_seq},) (one log-prob sum per sequence), got {tuple(ref_log_probs.shape)}")
        check_device("ref_log_probs", ref_log_probs, hidden.device)
    if not is_number(options.beta) or not options.beta > 0:
        raise ValueError(f"beta must be a positive float, got {options.beta!r}")
    eps = options.label_smoothing
    if method == "robust" and not (is_number(eps) and 0.0 <= eps < 0.5):
        raise ValueError(f"label_smoothing must be a float in [0, 0.5) for method 'robust', got {eps!r}")
    if not (is_number(eps) and 0.0 <= eps <= 1.0):
        raise ValueError(f"label_smoothing must be a float in [0, 1], got {eps!r}")
    if eps and method not in SMOOTHED_METHODS:
        raise ValueError(f"label_smoothing is for methods {', '.join(SMOOTHED_METHODS)}; method {method!r} has none")
    if method == "exo_pair" and not 0.0 < eps < 1.0:
        raise ValueError(f"label_smoothing must be in (0, 1) for method 'exo_pair' (EXO's epsilon; the paper uses "
                         f"1e-3), got {eps!r}")
    if given["tau"] and method != "discopop":
        raise ValueError(f"tau is DiscoPOP's temperature; method {method!r} has none")
    if not is_number(options.tau) or not options.tau > 0:
        raise ValueError(f"tau must be a positive float, got {options.tau!r}")
    if not isinstance(options.average_log_probs, bool):
        raise ValueError(f"average_log_probs must be a bool, got {options.average_log_probs!r}")
    if options.average_log_probs and method not in AVERAGED_METHODS:
        raise ValueError(f"average_log_probs: method {method!r} scores per-token means already")
    if not is_number(options.nll_weight) or options.nll_weight < 0:
        raise ValueError(f"nll_weight must be a non-negative float, got {options.nll_weight!r}")
    if given["gamma"] and method != "simpo":
        raise ValueError(f"gamma is SimPO's margin; method {method!r} has none")
    if not is_number(options.gamma):
        raise ValueError(f"gamma must be a float, got {options.gamma!r}")
    for name in ("desirable_weight", "undesirable_weight"):
        value = getattr(options, name)
        if not is_number(value) or not value > 0:
            raise ValueError(f"{name} must be a positive float, got {value!r}")
        if value != 1.0 and method != "kto":
            raise ValueError(f"{name} is for method 'kto', not {method!r}")
    if kl_baseline is not None:
        if method != "kto":
            raise ValueError(f"kl_baseline is for method 'kto', not {method!r}")
        is_scalar_tensor = isinstance(kl_baseline, torch.Tensor) and kl_baseline.dim() == 0
        if not (is_number(kl_baseline) or is_scalar_tensor):
            raise ValueError(f"kl_baseline must be a float or a 0-dim tensor, got {kl_baseline!r}")
    if nll_target is not None:
        if method == "kto":
            raise ValueError("nll_target is for the paired methods, not 'kto'")
        shape = (n_seq // 2, hidden.shape[1])
        is_ids = isinstance(nll_target, torch.Tensor) and nll_target.dtype in TARGET_DTYPES
        if not is_ids or nll_target.shape != shape:
            raise ValueError(f"nll_target must hold token ids (int64 or int32) of shape {shape}, one row per chosen "
                             f"sequence, got {nll_target!r:.80}")
        check_device("nll_target", nll_target, hidden.device)
        if not options.nll_weight:
            raise ValueError(f"nll_target is the NLL term's target, which nll_weight 0 leaves out of method {method!r}")
    check_ignore_index(options.ignore_index)
    check_chunk_bytes(max_chunk_bytes)


def linear_preference_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    method: str,
    beta: float = 0.1,
    ref_hidden: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    nll_weight: float | None = None,
    gamma: float | None = None,
    labels: torch.Tensor | None = None,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    kl_baseline: float | torch.Tensor | None = None,
    tau: float | None = None,
    average_log_probs: bool = False,
    nll_target: torch.Tensor | None = None,
    ignore_index: int = -100,
    max_chunk_bytes: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A preference loss of the policy's LM head over its hidden states, never holding the logits.

    Args:
        hidden: ``(2B, T, H)``: B chosen sequences, then the B rejected ones in the same order
            (``(B, T, H)`` unpaired sequences for ``kto``). float16/bfloat16/float32 (float64 runs
            the reference).
        weight, bias: the policy's head, ``(V, H)`` and optional ``(V,)``, dtype of `hidden`.
        target: ``(2B, T)`` (``(B, T)``) token ids aligned with `hidden` (position t scores
            target t: shift labels first); prompt and padding positions are `ignore_index`.
        method: one of dpo, ipo, hinge, robust, simpo, cpo, orpo, kto, or TRL's other DPO loss
            types apo_zero, apo_down, sppo_hard, nca_pair, bco_pair, exo_pair, discopop (formulas
            in this module's docstring).
        beta: the methods' beta (ORPO: the odds-ratio weight lambda).
        ref_hidden, ref_weight, ref_bias: the reference model's hidden states (shape of `hidden`)
            and head (default: `weight` and `bias`, as for a LoRA policy); scored without gradient.
        ref_log_probs: instead, the reference's per-sequence log-prob sums ``(2B,)`` (``(B,)``).
            The reference methods (dpo and its loss types, kto) need one of the two; simpo, cpo
            and orpo take none.
        label_smoothing: eps for dpo (conservative DPO), robust (< 0.5), simpo, cpo and exo_pair
            (which needs it > 0).
        nll_weight: weight of the chosen sequences' token-mean NLL added to the loss; default 1
            for cpo and orpo (part of those methods), 0 for the others.
        gamma: SimPO's target margin (default 0.5).
        labels: ``(B,)`` bool, kto only: whether each sequence is desirable.
        desirable_weight, undesirable_weight: KTO's lambda_D, lambda_U.
        kl_baseline: KTO's z0, a float or 0-dim tensor (no gradient); None estimates it from the
            batch as max(0, mean(policy - reference log-prob sums)), which costs the policy one
            GEMM pass more.
        tau: DiscoPOP's temperature (default 0.05, TRL's).
        average_log_probs: score each sequence by its per-token mean log-prob (TRL's
            ``average_log_prob``) instead of the sum, for every method but ipo, simpo and orpo
            (which average already): rewards, margins and the reported logps are then means too.
        nll_target: ``(B, T)`` token ids, the chosen sequences' NLL target instead of `target`'s
            chosen half (ORPO's NLL over prompt and answer); paired methods, nll_weight > 0.
        ignore_index: target value that is not scored.
        max_chunk_bytes: the most bytes one chunk of logits may take; default
            ``DEFAULT_MAX_CHUNK_BYTES``. When one pair's (KTO: one sequence's) logits exceed it,
            the policy runs in two passes (one GEMM more).

    Returns:
        ``(loss, metrics)``: the fp32 loss (mean over the B pairs or sequences, plus the NLL term)
        and detached tensors computed without a host sync. Paired methods: ``chosen_rewards``,
        ``rejected_rewards``, ``margin``, ``accuracy`` (1 where the chosen reward is higher),
        ``chosen_logps``, ``rejected_logps``, each ``(B,)``, ``chosen_nll``,
        ``chosen_logits_mean`` and ``rejected_logits_mean`` (0-dim: the mean logit over the
        scored tokens' vocabulary rows, from h mean(W) + mean(b), never the logits), and for orpo
        ``log_odds_ratio`` ``(B,)``. The
        rewards are beta times the log ratio to the reference (dpo, ipo, hinge, robust), the
        average log-prob (simpo, orpo) or the log-prob sum (cpo). kto: ``rewards`` and
        ``logps`` ``(B,)``, and 0-dim ``kl``, ``chosen_rewards`` / ``rejected_rewards`` (means
        over the desirable / undesirable sequences), ``margin``, ``chosen_nll``,
        ``chosen_logits_mean``, ``rejected_logits_mean``. Gradients
        reach hidden, weight and bias (never the reference); they are formed in forward. Inside
        torch.compile the same kernels run as the library op ``tigon::linear_preference_loss``,
        the metrics as torch ops around it.
    """
    if max_chunk_bytes is None:
        max_chunk_bytes = DEFAULT_MAX_CHUNK_BYTES
    if ref_hidden is not None and ref_weight is None:
        ref_weight, ref_bias = weight.detach(), (bias.detach() if bias is not None and ref_bias is None else ref_bias)
    options = PreferenceOptions(
        method, beta, label_smoothing,
        DEFAULT_NLL_WEIGHT.get(method, 0.0) if nll_weight is None else nll_weight,
        DEFAULT_GAMMA if gamma is None else gamma,
        desirable_weight, undesirable_weight, DEFAULT_TAU if tau is None else tau, ignore_index, average_log_probs,
    )
    autocast, hidden, weight, bias, ref_hidden, ref_weight, ref_bias = autocast_head(
        hidden, weight, bias, ref_hidden, ref_weight, ref_bias
    )
    args = (hidden, weight, target, bias, ref_hidden, ref_weight, ref_bias, ref_log_probs, labels, kl_baseline)
    _check(*args, nll_target, options, max_chunk_bytes, {"gamma": gamma is not None, "tau": tau is not None})
    if nll_target is not None:  # one target row per sequence: the rejected ones have none
        nll_target = torch.cat([nll_target, torch.full_like(nll_target, ignore_index)])
    return LINEAR_PREFERENCE_LOSS.without_autocast(autocast, None, *args, nll_target, options, max_chunk_bytes)
