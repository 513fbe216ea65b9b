"""Benchmark cases for linear_log_probs and linear_preference_loss (DPO): the issue-21 shapes first,
tigon against the materialised logits in eager and torch.compile, and for DPO the best-known
peer's fused loss (Liger-Kernel's LigerFusedLinearDPOLoss, when it is installed). Frozen-head
(LoRA) variants and chunk-budget sweeps (tigon only) follow, then one case per DPO loss type
(``linear_preference_loss_<type>``, at plain DPO's shapes, against Liger's same loss type where
its version has it): ``tigon bench --ops linear_preference_loss linear_preference_loss_apo_zero``
times a variant beside plain DPO in one run."""

from __future__ import annotations

import torch
import torch.nn.functional as TF

import tigon.functional as F
from tigon.bench.registry import BenchOp, register
from tigon.ops.linear_preference import DPO_LOSS_TYPES, PreferenceOptions, unit_losses

VOCAB, HIDDEN = 128256, 4096
BETA = 0.1
IGNORE = -100
LOG_PROB_BUDGETS_MIB = [64, 128, 224, 512, 1024]
# 512 MiB holds less than one 2 x 2048-token pair (two passes), 1024 MiB exactly one.
PREFERENCE_BUDGETS_MIB = [512, 1024, 1536, 2560]


def _head(vocab, hidden, dtype, device, trainable):
    return (torch.randn(vocab, hidden, dtype=dtype, device=device) * hidden**-0.5).requires_grad_(trainable)


def _log_prob_inputs(trainable_head):
    def make(size, dtype, device):
        tokens, hidden, vocab = size[:3]
        h = torch.randn(tokens, hidden, dtype=dtype, device=device, requires_grad=True)
        y = torch.randint(0, vocab, (tokens,), device=device)
        args = (h, _head(vocab, hidden, dtype, device, trainable_head), y)
        return args if len(size) == 3 else args + (size[3] * 2**20,)
    return make


def _eager_log_probs(h, w, y, *budget):
    return torch.log_softmax(TF.linear(h, w).float(), dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)


def _log_prob_flops(size):
    tokens, hidden, vocab = size[:3]
    return 3 * 2 * tokens * hidden * vocab  # logits, grad of hidden, grad of weight (none recomputed)


def _log_prob_bytes(size, dtype):
    tokens, hidden, vocab = size[:3]
    return 2 * (tokens + vocab) * hidden * dtype.itemsize  # read h and W, write their gradients


def _preference_inputs(trainable_head):
    def make(size, dtype, device):
        pairs, seq_len, hidden, vocab = size[:4]
        h = torch.randn(2 * pairs, seq_len, hidden, dtype=dtype, device=device, requires_grad=True)
        ref_h = torch.randn(2 * pairs, seq_len, hidden, dtype=dtype, device=device)
        y = torch.randint(0, vocab, (2 * pairs, seq_len), device=device)
        y[:, : seq_len // 4] = IGNORE  # the prompt
        args = (h, _head(vocab, hidden, dtype, device, trainable_head), y, ref_h)
        return args if len(size) == 4 else args + (size[4] * 2**20,)
    return make


# The constants a loss type needs beyond beta (EXO's epsilon must be > 0; its paper's value).
_LOSS_TYPE_OPTIONS = {"exo_pair": {"label_smoothing": 1e-3}}


def _tigon_dpo(h, w, y, ref_h, *budget, method="dpo"):
    return F.linear_preference_loss(
        h, w, y, method=method, beta=BETA, ref_hidden=ref_h, max_chunk_bytes=budget[0] if budget else None,
        **_LOSS_TYPE_OPTIONS.get(method, {}),
    )[0]


def _eager_dpo(h, w, y, ref_h, *budget, method="dpo"):
    def sequence_log_probs(x):
        logp = torch.log_softmax(TF.linear(x, w).float(), dim=-1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return torch.where(y != IGNORE, logp, 0.0).sum(-1)

    with torch.no_grad():
        ref = sequence_log_probs(ref_h)
    if method == "dpo":
        chosen, rejected = (sequence_log_probs(h) - ref).chunk(2)
        return -TF.logsigmoid(BETA * (chosen - rejected)).mean()
    # The loss type's formula (tigon's, plain torch ops) on the materialised logits' sums.
    options = PreferenceOptions(method, BETA, **_LOSS_TYPE_OPTIONS.get(method, {}))
    counts = (y != IGNORE).sum(-1).float()
    return unit_losses(options, sequence_log_probs(h), ref, counts, None, None).mean()


def _liger_dpo(method="dpo"):
    def load():
        from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

        extra = {}
        if method != "dpo":
            extra = dict(loss_type=method, **_LOSS_TYPE_OPTIONS.get(method, {}))
            try:
                LigerFusedLinearDPOLoss(**extra)
            except (TypeError, ValueError) as err:  # an older Liger, or one without this loss type
                raise ImportError(f"this Liger-Kernel's LigerFusedLinearDPOLoss has no loss_type {method!r}: {err}")
        loss = LigerFusedLinearDPOLoss(ignore_index=IGNORE, beta=BETA, compute_nll_loss=False, use_ref_model=True,
                                       **extra)

        def run(h, w, y, ref_h, *budget):
            return loss(w, h, y, ref_input=ref_h, ref_weight=w.detach())[0]

        return run

    return load


def _preference_flops(size):
    pairs, seq_len, hidden, vocab = size[:4]
    # the policy's logits and its two gradient GEMMs, and the reference's logits
    return 4 * 2 * (2 * pairs * seq_len) * hidden * vocab


def _preference_bytes(size, dtype):
    pairs, seq_len, hidden, vocab = size[:4]
    rows = 2 * pairs * seq_len
    # read h, ref_h and W; write the gradients of h and W
    return (3 * rows + 2 * vocab) * hidden * dtype.itemsize


LOG_PROB_SIZES = [(8192, HIDDEN, VOCAB), (4096, HIDDEN, VOCAB), (16384, HIDDEN, VOCAB)]
PREFERENCE_SIZES = [(4, 2048, HIDDEN, VOCAB), (2, 2048, HIDDEN, VOCAB), (4, 4096, HIDDEN, VOCAB)]

for name, trainable in (("linear_log_probs", True), ("linear_log_probs_frozen", False)):
    register(BenchOp(
        name=name,
        make_inputs=_log_prob_inputs(trainable),
        tigon=lambda h, w, y: F.linear_log_probs(h, w, y),
        eager=_eager_log_probs,
        bytes_moved=_log_prob_bytes,
        flops=_log_prob_flops if trainable else lambda size: 2 / 3 * _log_prob_flops(size),
        sizes=LOG_PROB_SIZES,
        cpu_sizes=[(64, 64, 1031)],
        size_names="tokens x hidden x vocab",
    ))

register(BenchOp(
    name="linear_log_probs_budget",
    make_inputs=_log_prob_inputs(True),
    tigon=lambda h, w, y, budget: F.linear_log_probs(h, w, y, max_chunk_bytes=budget),
    eager=_eager_log_probs,
    bytes_moved=_log_prob_bytes,
    flops=_log_prob_flops,
    sizes=[(8192, HIDDEN, VOCAB, mib) for mib in LOG_PROB_BUDGETS_MIB],
    cpu_sizes=[(64, 64, 1031, 1)],
    size_names="tokens x hidden x vocab x chunk budget MiB",
))

for name, trainable in (("linear_preference_loss", True), ("linear_preference_loss_frozen", False)):
    register(BenchOp(
        name=name,
        make_inputs=_preference_inputs(trainable),
        tigon=_tigon_dpo,
        eager=_eager_dpo,
        bytes_moved=_preference_bytes,
        flops=_preference_flops if trainable else lambda size: 3 / 4 * _preference_flops(size),
        sizes=PREFERENCE_SIZES if trainable else PREFERENCE_SIZES[:1],
        cpu_sizes=[(2, 16, 64, 1031)],
        size_names="pairs x tokens x hidden x vocab",
        peer=_liger_dpo(),
    ))

register(BenchOp(
    name="linear_preference_budget",
    make_inputs=_preference_inputs(True),
    tigon=_tigon_dpo,
    eager=_eager_dpo,
    bytes_moved=_preference_bytes,
    flops=_preference_flops,
    sizes=[(4, 2048, HIDDEN, VOCAB, mib) for mib in PREFERENCE_BUDGETS_MIB],
    cpu_sizes=[(2, 16, 64, 1031, 1)],
    size_names="pairs x tokens x hidden x vocab x chunk budget MiB",
))

for loss_type in DPO_LOSS_TYPES:
    register(BenchOp(
        name=f"linear_preference_loss_{loss_type}",
        make_inputs=_preference_inputs(True),
        tigon=lambda h, w, y, ref_h, method=loss_type: _tigon_dpo(h, w, y, ref_h, method=method),
        eager=lambda h, w, y, ref_h, method=loss_type: _eager_dpo(h, w, y, ref_h, method=method),
        bytes_moved=_preference_bytes,
        flops=_preference_flops,
        sizes=PREFERENCE_SIZES[:1],
        cpu_sizes=[(2, 16, 64, 1031)],
        size_names="pairs x tokens x hidden x vocab",
        peer=_liger_dpo(loss_type),
    ))
