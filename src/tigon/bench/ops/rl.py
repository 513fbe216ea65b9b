"""Benchmark cases for linear_policy_loss (GRPO, GSPO) and linear_distill_loss (JSD), the issue-26
shapes first: tigon against the materialised logits in eager and torch.compile, and as the peer
column Liger-Kernel's fused losses or TRL's own paths (one case each, same inputs):

    linear_policy_loss*      Liger's LigerFusedLinearGRPOLoss (plain GRPO, GSPO, and of the
                             variants linear_policy_loss_<variant> (POLICY_VARIANTS: cispo, sapo,
                             luspo, vespo, two_sided, vllm_is) the two it has, cispo and sapo)
    linear_policy_loss_trl   TRL 1.16's GRPO log-prob path: its fused LM head
                             (ChunkedLogProbFunction over the scored tokens, as add_fused_lm_head
                             runs it) and GRPOTrainer._compute_loss
    linear_policy_loss_trl_logits  TRL's path on materialised logits (what GRPOTrainer did before
                             the fused head): the logits, selective_log_softmax_and_entropy, and
                             GRPOTrainer._compute_loss
    linear_distill_loss      Liger's LigerFusedLinearJSD (its Triton fused-linear JSD)
    linear_distill_loss_liger_chunked  Liger's LigerFusedLinearJSDLoss (torch.compile'd chunks)
    linear_distill_loss_trl  TRL 1.16's DistillationTrainer loss (ChunkedDivergenceFunction)

The *_trl* and *_chunked cases repeat the tigon row: run them with ``--impls tigon peer``.
Chunk-budget sweeps (tigon only) follow.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as TF

import tigon.functional as F
from tigon.bench.registry import BenchOp, register

VOCAB, HIDDEN, TEACHER_HIDDEN = 128256, 2048, 4096  # the 1B Llama's vocabulary and width; an 8B-class teacher
BETA, EPSILON, JSD_BETA = 0.04, 0.2, 0.5  # the GRPO paper's KL weight and clip; GKD's default JSD
IGNORE = -100
POLICY_BUDGETS_MIB = [64, 128, 224, 512, 1024]
DISTILL_BUDGETS_MIB = [64, 128, 251, 512, 1024]


def trl_grpo_trainer(
    per_token: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    *,
    loss_type: str = "grpo",
    importance_level: str = "token",
    beta: float = BETA,
    epsilon_low: float = EPSILON,
    epsilon_high: float = EPSILON,
    kl_bias_correction: bool = False,
    max_completion_length: int = 1024,
    delta: float | None = None,
    sapo_temperatures: tuple[float, float] = (1.0, 1.05),
    vespo_gamma: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
    sampling_correction: bool = False,
) -> SimpleNamespace:
    """A stand-in for TRL's GRPOTrainer with what its ``_compute_loss`` reads, whose policy
    log-probs and entropies come from ``per_token()``: ``GRPOTrainer._compute_loss(stand_in, None,
    inputs)`` then runs TRL's own loss code (no accumulation, one process, metrics in
    ``stand_in._metrics["train"]``). With `sampling_correction`, TRL's vLLM importance-sampling
    correction weighs the loss by ``inputs["importance_sampling_ratio"]``."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    k_pos, lambda_pos, k_neg, lambda_neg = vespo_gamma
    return SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (*per_token(), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=importance_level, beta=beta, loss_type=loss_type,
        epsilon_low=epsilon_low, epsilon_high=epsilon_high, get_gamma_weights=GRPOTrainer.get_gamma_weights,
        args=SimpleNamespace(use_bias_correction_kl=kl_bias_correction, delta=delta, steps_per_generation=1,
                             sapo_temperature_pos=sapo_temperatures[0], sapo_temperature_neg=sapo_temperatures[1],
                             vespo_k_pos=k_pos, vespo_lambda_pos=lambda_pos, vespo_k_neg=k_neg,
                             vespo_lambda_neg=lambda_neg),
        use_vllm=sampling_correction, vllm_importance_sampling_correction=sampling_correction,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=max_completion_length,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)},
        accelerator=SimpleNamespace(gather=lambda x: x, reduce=lambda x, reduction: x, num_processes=1),
    )


def trl_grpo_inputs(target, mask, advantages, old_log_probs=None, ref_log_probs=None,
                    importance_sampling_ratio=None) -> dict:
    """The batch dict GRPOTrainer._compute_loss takes, for completions `target` under `mask`
    (a one-token prompt: the stand-in's log-probs ignore the ids)."""
    n_seq, device = target.shape[0], target.device
    inputs = dict(
        prompt_ids=torch.zeros(n_seq, 1, dtype=torch.long, device=device),
        prompt_mask=torch.ones(n_seq, 1, dtype=torch.long, device=device),
        completion_ids=target, completion_mask=mask.long(), advantages=advantages,
        num_items_in_batch=mask.sum().to(advantages.dtype),
    )
    if old_log_probs is not None:
        inputs["old_per_token_logps"] = old_log_probs
    if ref_log_probs is not None:
        inputs["ref_per_token_logps"] = ref_log_probs
    if importance_sampling_ratio is not None:
        inputs["importance_sampling_ratio"] = importance_sampling_ratio
    return inputs


def trl_sampling_ratio(old, sampling, mask, mode, low=None, high=3.0) -> torch.Tensor:
    """TRL 1.16's vLLM importance-sampling ratio, written from its definition (TRL forms it in
    GRPOTrainer._generate_and_score_completions, which needs vLLM): exp(old - sampler) per token
    (``token_*`` modes) or of the completion's sum (``sequence_*``), NaN gaps as 0, clamped to
    [low, high] (``*_truncate``) or zeroed outside it (``*_mask``); None is no bound."""
    gap = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    ratio = torch.exp(gap.sum(-1, keepdim=True) if mode.startswith("sequence") else gap)
    if mode.endswith("truncate"):
        return ratio.clamp(min=low, max=high)
    outside = (ratio < (-math.inf if low is None else low)) | (ratio > (math.inf if high is None else high))
    return ratio.masked_fill(outside, 0.0)


def _policy_inputs(trainable_head, sampling=False):
    def make(size, dtype, device):
        n_seq, seq_len, hidden, vocab = size[:4]
        h = torch.randn(n_seq, seq_len, hidden, dtype=dtype, device=device, requires_grad=True)
        w = (torch.randn(vocab, hidden, dtype=dtype, device=device) * hidden**-0.5).requires_grad_(trainable_head)
        y = torch.randint(0, vocab, (n_seq, seq_len), device=device)
        # Completions of 3/4 to all of the padded length, as sampling leaves them.
        mask = torch.arange(seq_len, device=device) < torch.randint(3 * seq_len // 4, seq_len + 1, (n_seq, 1), device=device)
        old = -math.log(vocab) + 0.5 * torch.randn(n_seq, seq_len, device=device)
        ref = old + 0.2 * torch.randn_like(old)
        adv = torch.randn(n_seq, device=device)
        args = (h, w, y, mask, old, ref, adv)
        if sampling:
            args += (old + 0.3 * torch.randn_like(old),)
        return args if len(size) == 4 else args + (size[4] * 2**20,)
    return make


# The GRPO variants timed beside plain GRPO (linear_policy_loss_<name>): each one's
# linear_policy_loss keywords. vllm_is: rollouts from another engine, its log-probs 0.3 nats off the
# old policy's (the eighth input), with TRL's token-level truncated correction.
POLICY_VARIANTS = {
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),  # ScaleRL's cap
    "sapo": dict(loss_type="sapo"),
    "luspo": dict(loss_type="luspo", importance_level="sequence"),
    "vespo": dict(loss_type="vespo"),
    "two_sided": dict(loss_type="grpo", delta=1.5),
    "vllm_is": dict(loss_type="grpo", importance_sampling_mode="token_truncate"),
}


def _policy_options(level, variant):
    """linear_policy_loss's keywords for a case (plain GRPO at `level`, or a variant)."""
    return {"loss_type": "grpo", "importance_level": level, **POLICY_VARIANTS.get(variant, {})}


def _tigon_policy(level, variant=None):
    options = _policy_options(level, variant)

    def run(h, w, y, mask, old, ref, adv, *extra):
        sampling = extra[0] if "importance_sampling_mode" in options else None
        return F.linear_policy_loss(
            h, w, y, old, adv, ref_log_probs=ref, beta=BETA, epsilon=EPSILON, mask=mask, sampling_log_probs=sampling,
            max_chunk_bytes=extra[0] if extra and sampling is None else None, **options,
        )
    return run


def _eager_policy(level, variant=None):
    """The loss on the materialised logits in plain PyTorch, as the papers write it (TRL's forms)."""
    options = _policy_options(level, variant)
    loss_type = options["loss_type"]

    def run(h, w, y, mask, old, ref, adv, *extra):
        logp = torch.log_softmax(TF.linear(h, w).float(), dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        m = mask.float()
        n = m.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = logp - old
        if options["importance_level"] == "sequence":
            log_ratio = (log_ratio * m).sum(-1, keepdim=True) / n
        ratio, a = torch.exp(log_ratio), adv.unsqueeze(1)
        if loss_type == "cispo":
            policy = -ratio.detach().clamp(max=options["epsilon_high"]) * a * logp
        elif loss_type == "sapo":
            tau = torch.where(a > 0, 1.0, 1.05)
            policy = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a
        elif loss_type == "vespo":  # TRL's defaults: k 2 / 3, lambda 3 / 2 for A >= 0 / A < 0
            log_w = (((logp.detach() - old).clamp(-20, 20)) * m).sum(-1, keepdim=True).clamp(math.log(1e-8), 20)
            k, lam = torch.where(a >= 0, 2.0, 3.0), torch.where(a >= 0, 3.0, 2.0)
            policy = -torch.exp(lam + k * log_w - lam * log_w.exp()) * a * logp
        else:
            capped = ratio.clamp(max=options.get("delta", math.inf))
            policy = -torch.minimum(capped * a, ratio.clamp(1 - EPSILON, 1 + EPSILON) * a)
        if "importance_sampling_mode" in options:
            policy = policy * torch.exp((old - extra[0]) * m).clamp(max=3.0)
        gap = ref - logp
        per_token = (policy + BETA * (gap.exp() - gap - 1)) * m
        if loss_type in ("cispo", "vespo"):
            return per_token.sum() / m.sum().clamp(min=1)
        if loss_type == "luspo":
            return per_token.sum(-1).mean()
        return (per_token.sum(-1, keepdim=True) / n).mean()
    return run


def _liger_policy(level, variant=None):
    """Liger's LigerFusedLinearGRPOLoss (its loss types: grpo, bnpo, dr_grpo, dapo and, in newer
    releases, cispo and sapo)."""
    options = _policy_options(level, variant)

    def make():
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        loss = LigerFusedLinearGRPOLoss(
            beta=BETA, use_ref_model=True, loss_type=options["loss_type"], epsilon_low=EPSILON,
            epsilon_high=options.get("epsilon_high", EPSILON), importance_sampling_level=level,
        )

        def run(h, w, y, mask, old, ref, adv, *budget):
            return loss(h, w, y, mask.float(), adv, ref_per_token_logps=ref, old_per_token_logps=old)[0]

        return run
    return make


def _trl_fused_log_probs(h, w, y, mask):
    """TRL 1.16's fused LM head as add_fused_lm_head's forward runs it: ChunkedLogProbFunction over
    the scored positions only, scattered back to (B, T)."""
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    per_token = ChunkedLogProbFunction.apply(
        h[mask], w, None, y[mask], 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("log_probs", "entropy")
    )
    return tuple(x.new_zeros(mask.shape).masked_scatter(mask, x) for x in per_token[:2])


def _trl_logits_log_probs(h, w, y, mask):
    """TRL's log-probs over the materialised logits (the model's logits, then its fused
    log-softmax/entropy kernel), as GRPOTrainer computed them before the fused head."""
    from trl.trainer.utils import selective_log_softmax_and_entropy

    return selective_log_softmax_and_entropy(TF.linear(h, w), y, entropy_requires_grad=False)


def _trl_policy(log_probs):
    def make():
        from trl.trainer.grpo_trainer import GRPOTrainer

        def run(h, w, y, mask, old, ref, adv, *budget):
            trainer = trl_grpo_trainer(lambda: log_probs(h, w, y, mask), max_completion_length=y.shape[1])
            return GRPOTrainer._compute_loss(trainer, None, trl_grpo_inputs(y, mask, adv, old, ref))

        return run
    return make


def _policy_flops(size):
    n_seq, seq_len, hidden, vocab = size[:4]
    return 3 * 2 * n_seq * seq_len * hidden * vocab  # logits, grad of hidden, grad of weight


def _policy_bytes(size, dtype):
    n_seq, seq_len, hidden, vocab = size[:4]
    return 2 * (n_seq * seq_len + vocab) * hidden * dtype.itemsize  # read h and W, write their gradients


def _distill_inputs(size, dtype, device):
    tokens, student, teacher, vocab = size[:4]
    hs = torch.randn(tokens, student, dtype=dtype, device=device, requires_grad=True)
    ws = (torch.randn(vocab, student, dtype=dtype, device=device) * student**-0.5).requires_grad_()
    ht = torch.randn(tokens, teacher, dtype=dtype, device=device)
    wt = torch.randn(vocab, teacher, dtype=dtype, device=device) * teacher**-0.5
    y = torch.randint(0, vocab, (tokens,), device=device)
    y[: tokens // 8] = IGNORE  # a prompt
    args = (hs, ws, ht, wt, y)
    return args if len(size) == 4 else args + (size[4] * 2**20,)


def _tigon_jsd(hs, ws, ht, wt, y, *budget):
    return F.linear_distill_loss(hs, ws, ht, wt, y, loss="jsd", beta=JSD_BETA,
                                 max_chunk_bytes=budget[0] if budget else None)


def _eager_jsd(hs, ws, ht, wt, y, *budget):
    log_p = torch.log_softmax(TF.linear(hs, ws).float(), dim=-1)
    with torch.no_grad():
        log_q = torch.log_softmax(TF.linear(ht, wt).float(), dim=-1)
    log_m = torch.logaddexp(log_p + math.log(1 - JSD_BETA), log_q + math.log(JSD_BETA))
    jsd = JSD_BETA * (log_q.exp() * (log_q - log_m)).sum(-1) + (1 - JSD_BETA) * (log_p.exp() * (log_p - log_m)).sum(-1)
    valid = y != IGNORE
    return torch.where(valid, jsd, 0.0).sum() / valid.sum().clamp(min=1)


def _liger_jsd():
    from liger_kernel.transformers import LigerFusedLinearJSD

    loss = LigerFusedLinearJSD(jsd_beta=JSD_BETA, ignore_index=IGNORE)
    return lambda hs, ws, ht, wt, y, *budget: loss(hs, ws, ht, wt, y)


def _liger_chunked_jsd():
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

    loss = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=JSD_BETA, ignore_index=IGNORE)
    return lambda hs, ws, ht, wt, y, *budget: loss(hs, ws, ht, wt, y)


def _trl_jsd():
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    return lambda hs, ws, ht, wt, y, *budget: _chunked_divergence_loss(hs, ht, ws, wt, y != IGNORE, JSD_BETA)[0]


def _distill_flops(size):
    tokens, student, teacher, vocab = size[:4]
    return 2 * tokens * vocab * (teacher + 3 * student)  # the teacher's logits; the student's and its two gradients


def _distill_bytes(size, dtype):
    tokens, student, teacher, vocab = size[:4]
    # read both models' hidden states and heads; write the student's gradients
    return ((2 * tokens + 2 * vocab) * student + (tokens + vocab) * teacher) * dtype.itemsize


POLICY_SIZES = [(64, 1024, HIDDEN, VOCAB), (16, 1024, HIDDEN, VOCAB), (32, 2048, HIDDEN, VOCAB)]
POLICY_CPU_SIZES = [(4, 16, 64, 1031)]
DISTILL_SIZES = [(8192, HIDDEN, TEACHER_HIDDEN, VOCAB), (4096, HIDDEN, TEACHER_HIDDEN, VOCAB),
                 (16384, HIDDEN, TEACHER_HIDDEN, VOCAB)]
DISTILL_CPU_SIZES = [(48, 32, 48, 1031)]


def _policy_case(name, level="token", trainable=True, peer=_liger_policy("token"), sizes=POLICY_SIZES, variant=None):
    register(BenchOp(
        name=name,
        make_inputs=_policy_inputs(trainable, sampling=variant == "vllm_is"),
        tigon=_tigon_policy(level, variant),
        eager=_eager_policy(level, variant),
        bytes_moved=_policy_bytes,
        flops=_policy_flops if trainable else lambda size: 2 / 3 * _policy_flops(size),
        sizes=sizes,
        cpu_sizes=POLICY_CPU_SIZES,
        size_names="completions x tokens x hidden x vocab",
        peer=peer,
    ))


def _distill_case(name, peer, sizes=DISTILL_SIZES):
    register(BenchOp(
        name=name,
        make_inputs=_distill_inputs,
        tigon=_tigon_jsd,
        eager=_eager_jsd,
        bytes_moved=_distill_bytes,
        flops=_distill_flops,
        sizes=sizes,
        cpu_sizes=DISTILL_CPU_SIZES,
        size_names="tokens x student hidden x teacher hidden x vocab",
        peer=peer,
    ))


_policy_case("linear_policy_loss")
_policy_case("linear_policy_loss_frozen", trainable=False, sizes=POLICY_SIZES[:1])
_policy_case("linear_policy_loss_gspo", level="sequence", peer=_liger_policy("sequence"), sizes=POLICY_SIZES[:1])
_policy_case("linear_policy_loss_trl", peer=_trl_policy(_trl_fused_log_probs), sizes=POLICY_SIZES[:2])
_policy_case("linear_policy_loss_trl_logits", peer=_trl_policy(_trl_logits_log_probs), sizes=POLICY_SIZES[1:2])
for _variant in POLICY_VARIANTS:  # Liger has two of them
    _policy_case(f"linear_policy_loss_{_variant}", sizes=POLICY_SIZES[:1], variant=_variant,
                 peer=_liger_policy("token", _variant) if _variant in ("cispo", "sapo") else None)
_distill_case("linear_distill_loss", _liger_jsd)
_distill_case("linear_distill_loss_liger_chunked", _liger_chunked_jsd, DISTILL_SIZES[:1])
_distill_case("linear_distill_loss_trl", _trl_jsd, DISTILL_SIZES[:1])

register(BenchOp(
    name="linear_policy_budget",
    make_inputs=_policy_inputs(True),
    tigon=_tigon_policy("token"),
    eager=_eager_policy("token"),
    bytes_moved=_policy_bytes,
    flops=_policy_flops,
    sizes=[POLICY_SIZES[0] + (mib,) for mib in POLICY_BUDGETS_MIB],
    cpu_sizes=[POLICY_CPU_SIZES[0] + (1,)],
    size_names="completions x tokens x hidden x vocab x chunk budget MiB",
))

register(BenchOp(
    name="linear_distill_budget",
    make_inputs=_distill_inputs,
    tigon=_tigon_jsd,
    eager=_eager_jsd,
    bytes_moved=_distill_bytes,
    flops=_distill_flops,
    sizes=[DISTILL_SIZES[0] + (mib,) for mib in DISTILL_BUDGETS_MIB],
    cpu_sizes=[DISTILL_CPU_SIZES[0] + (1,)],
    size_names="tokens x student hidden x teacher hidden x vocab x chunk budget MiB",
))
