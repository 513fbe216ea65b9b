"""linear_preference_loss against each method's formula as its paper writes it (float64, from
materialised logits), against TRL's own loss code where TRL lets it be called, and over the
chunking plans (one pass over whole pairs, two passes over rows)."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as TF

import tigon.functional as F
from tigon.ops import linear_preference as preference
from tests.helpers import assert_close, compare_fwd_bwd

IGNORE = -100
B, T, H = 3, 6, 19  # 3 pairs of 6 tokens, an odd hidden size
KTO_LABELS = [True, False, True, True, False]

METHOD_KWARGS = {
    "dpo": dict(beta=0.3, label_smoothing=0.1),
    "dpo+nll": dict(beta=0.3, nll_weight=0.5),
    "robust": dict(beta=0.3, label_smoothing=0.2),
    "hinge": dict(beta=0.15),
    "ipo": dict(beta=0.4),
    "simpo": dict(beta=2.0, gamma=0.3, label_smoothing=0.05),
    "cpo": dict(beta=0.2),
    "orpo": dict(beta=0.25),
    "kto": dict(beta=0.3, desirable_weight=1.3, undesirable_weight=0.7, kl_baseline=0.05),
}


def _method(name):
    return name.split("+")[0]


def _n_seq(method):
    return len(KTO_LABELS) if method == "kto" else 2 * B


def _inputs(method, vocab, dtype, device, bias=True):
    n = _n_seq(method)
    h = torch.randn(n, T, H, device=device).to(dtype).requires_grad_()
    w = (torch.randn(vocab, H, device=device) * 2 * H**-0.5).to(dtype).requires_grad_()
    b = (0.5 * torch.randn(vocab, device=device)).to(dtype).requires_grad_() if bias else None
    ref_h = (h.detach().float() + 0.5 * torch.randn(n, T, H, device=device)).to(dtype)
    target = torch.randint(0, vocab, (n, T), device=device)
    target[:, :2] = IGNORE  # the prompt
    target[torch.rand(n, T, device=device) < 0.15] = IGNORE
    target[:, -1] = torch.randint(0, vocab, (n,), device=device)  # no sequence is empty here
    labels = torch.tensor(KTO_LABELS, device=device) if method == "kto" else None
    return h, w, b, ref_h, target, labels


def _budget(units, vocab, dtype, method):
    """The bytes of `units` whole pairs (sequences for kto) of logits."""
    return units * (1 if method == "kto" else 2) * T * vocab * dtype.itemsize


def _sequence_stats(h, w, b, target):
    """Per-sequence log-prob sum and token count, in float64 from the materialised logits."""
    logp = torch.log_softmax(TF.linear(h, w, b).double(), dim=-1)
    valid = target != IGNORE
    token = torch.where(valid, logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    return token.sum(-1), valid.sum(-1).double()


def _nll(s, n):
    """Token-mean negative log-likelihood of the given sequences."""
    return -s.sum() / n.sum()


def _paper_loss(name, target, labels, ref_hidden=None, ref_weight=None, ref_bias=None, **kw):
    """Each method's loss written from its paper (float64)."""
    method = _method(name)
    beta, eps = kw.get("beta", 0.1), kw.get("label_smoothing", 0.0)

    def neg_log_sigmoid(x):
        return -TF.logsigmoid(x)

    def fn(h, w, b=None):
        s, n = _sequence_stats(h, w, b, target)
        if ref_hidden is not None:
            with torch.no_grad():
                r, _ = _sequence_stats(ref_hidden.to(h.dtype), w if ref_weight is None else ref_weight.to(h.dtype),
                                       b if ref_bias is None and ref_weight is None else ref_bias, target)
        if method == "kto":
            # Ethayarajh et al. 2024, eq. 8: L = E[lambda_y - v(x, y)]
            r_theta = s - r
            z0 = torch.tensor(kw["kl_baseline"], dtype=torch.float64)
            v = torch.where(labels, kw["desirable_weight"] * torch.sigmoid(beta * (r_theta - z0)),
                            kw["undesirable_weight"] * torch.sigmoid(beta * (z0 - r_theta)))
            lam = torch.where(labels, *(torch.tensor(kw[k], dtype=torch.float64) for k in ("desirable_weight", "undesirable_weight")))
            loss = (lam - v).mean()
            return loss + kw.get("nll_weight", 0.0) * _nll(s[labels], n[labels])
        pairs = target.shape[0] // 2
        sw, sl, nw, nl = s[:pairs], s[pairs:], n[:pairs], n[pairs:]
        if ref_hidden is not None:
            log_ratio_w, log_ratio_l = sw - r[:pairs], sl - r[pairs:]
        nll_weight = kw.get("nll_weight", 1.0 if method in ("cpo", "orpo") else 0.0)
        if method in ("dpo", "robust", "hinge"):
            # Rafailov et al. 2023 eq. 7; conservative DPO mixes in the flipped label with eps
            z = beta * log_ratio_w - beta * log_ratio_l
            if method == "dpo":
                per_pair = (1 - eps) * neg_log_sigmoid(z) + eps * neg_log_sigmoid(-z)
            elif method == "robust":  # Chowdhury et al. 2024, eq. 4
                per_pair = ((1 - eps) * neg_log_sigmoid(z) - eps * neg_log_sigmoid(-z)) / (1 - 2 * eps)
            else:  # SLiC's calibration hinge with unit margin, on the reference log ratios
                per_pair = torch.clamp(1 - z, min=0)
        elif method == "ipo":
            # Azar et al. 2023 eq. 17 with tau = beta, log ratios averaged per token
            h_pi = log_ratio_w / nw - log_ratio_l / nl
            per_pair = (h_pi - 1 / (2 * beta)) ** 2
        elif method == "simpo":
            # Meng et al. 2024 eq. 6
            z = beta / nw * sw - beta / nl * sl - kw.get("gamma", 0.5)
            per_pair = (1 - eps) * neg_log_sigmoid(z) + eps * neg_log_sigmoid(-z)
        elif method == "cpo":
            # Xu et al. 2024 eq. 3 (preference term), the NLL added below
            z = beta * sw - beta * sl
            per_pair = (1 - eps) * neg_log_sigmoid(z) + eps * neg_log_sigmoid(-z)
        else:
            # Hong et al. 2024 eqs. 4-7: odds(y) = P(y) / (1 - P(y)), P the per-token mean likelihood
            pw, pl = torch.exp(sw / nw), torch.exp(sl / nl)
            per_pair = -beta * TF.logsigmoid(torch.log((pw / (1 - pw)) / (pl / (1 - pl))))
        return per_pair.mean() + nll_weight * _nll(sw, nw)

    return fn


def _paper_rewards(name, h, w, b, target, ref_hidden, beta):
    s, n = _sequence_stats(h.detach().double(), w.detach().double(), None if b is None else b.detach().double(), target)
    method = _method(name)
    if method in ("simpo", "orpo"):
        return beta * s / n, s
    if method == "cpo":
        return beta * s, s
    r, _ = _sequence_stats(ref_hidden.double(), w.detach().double(), None if b is None else b.detach().double(), target)
    return beta * (s - r), s


def _ours(name, target, labels, ref_hidden, budget, **kw):
    method = _method(name)
    extra = dict(ref_hidden=ref_hidden) if method in preference.REFERENCE_METHODS else {}
    if method == "kto":
        extra["labels"] = labels

    def fn(h, w, b=None):
        return F.linear_preference_loss(h, w, target, b, method=method, max_chunk_bytes=budget, **extra, **kw)[0]

    return fn


@pytest.mark.parametrize(
    "name,dtype,vocab",
    [(name, torch.float32, 1031) for name in METHOD_KWARGS]
    + [(name, torch.float16, 257) for name in ("dpo", "simpo", "orpo", "kto")],
)
def test_matches_paper_formula(poison_outputs, device, name, dtype, vocab):
    method = _method(name)
    h, w, b, ref_h, target, labels = _inputs(method, vocab, dtype, device)
    kw = METHOD_KWARGS[name]
    uses_ref = method in ("dpo", "robust", "hinge", "ipo", "kto")
    compare_fwd_bwd(
        _ours(name, target, labels, ref_h if uses_ref else None, None, **kw),
        _paper_loss(name, target, labels, ref_h if uses_ref else None, **kw),
        (h, w, b), name=name,
    )


@pytest.mark.parametrize("name", list(METHOD_KWARGS))
def test_reference_path_matches_paper_formula(device, name):
    # float64 runs the PyTorch reference, the op's fallback
    method = _method(name)
    h, w, b, ref_h, target, labels = _inputs(method, 257, torch.float64, device)
    kw = METHOD_KWARGS[name]
    uses_ref = method in ("dpo", "robust", "hinge", "ipo", "kto")
    compare_fwd_bwd(
        _ours(name, target, labels, ref_h if uses_ref else None, None, **kw),
        _paper_loss(name, target, labels, ref_h if uses_ref else None, **kw),
        (h, w, b), name=f"reference {name}",
    )


def _logits_means(h, w, b, target, chosen):
    """The mean logit over the scored tokens of the `chosen` sequences and of the others (float64)."""
    row = TF.linear(h.detach().double(), w.detach().double(), b.detach().double()).mean(-1)
    valid = target != IGNORE
    return tuple((row * (valid & side[:, None])).sum() / (valid & side[:, None]).sum() for side in (chosen, ~chosen))


@pytest.mark.parametrize("name", ["dpo", "simpo", "cpo", "kto", "orpo"])
def test_metrics(poison_outputs, device, name):
    method = _method(name)
    h, w, b, ref_h, target, labels = _inputs(method, 257, torch.float32, device)
    kw = dict(METHOD_KWARGS[name])
    uses_ref = method in ("dpo", "kto")
    extra = dict(ref_hidden=ref_h) if uses_ref else {}
    if method == "kto":
        extra["labels"] = labels
    with torch.no_grad():
        _, metrics = F.linear_preference_loss(h, w, target, b, method=method, **extra, **kw)
    rewards, s = _paper_rewards(name, h, w, b, target, ref_h, kw["beta"])
    _, n = _sequence_stats(h.detach(), w.detach(), b.detach(), target)
    assert all(not m.requires_grad for m in metrics.values())
    if method == "kto":
        assert_close(metrics["rewards"], rewards.float(), name="rewards")
        assert_close(metrics["logps"], s.float(), name="logps")
        assert_close(metrics["chosen_rewards"], rewards[labels].mean().float(), name="chosen_rewards")
        assert_close(metrics["rejected_rewards"], rewards[~labels].mean().float(), name="rejected_rewards")
        assert_close(metrics["margin"], (rewards[labels].mean() - rewards[~labels].mean()).float(), name="margin")
        assert_close(metrics["chosen_nll"], _nll(s[labels], n[labels]).float(), name="chosen_nll")
        assert_close(metrics["kl"], torch.tensor(0.05), name="kl")
        want_chosen, want_rejected = _logits_means(h, w, b, target, labels)
        assert_close(metrics["chosen_logits_mean"], want_chosen.float(), name="chosen_logits_mean")
        assert_close(metrics["rejected_logits_mean"], want_rejected.float(), name="rejected_logits_mean")
        return
    chosen_logits, rejected_logits = _logits_means(h, w, b, target, torch.arange(2 * B, device=device) < B)
    want = {
        "chosen_rewards": rewards[:B], "rejected_rewards": rewards[B:], "margin": rewards[:B] - rewards[B:],
        "accuracy": (rewards[:B] > rewards[B:]).double(), "chosen_logps": s[:B], "rejected_logps": s[B:],
        "chosen_nll": _nll(s[:B], n[:B]), "chosen_logits_mean": chosen_logits, "rejected_logits_mean": rejected_logits,
    }
    if method == "orpo":  # Hong et al. 2024 eq. 7, P the per-token mean likelihood
        pw, pl = torch.exp(s[:B] / n[:B]), torch.exp(s[B:] / n[B:])
        want["log_odds_ratio"] = torch.log((pw / (1 - pw)) / (pl / (1 - pl)))
    assert set(metrics) == set(want)
    for key, value in want.items():
        assert_close(metrics[key], value.float(), name=key)


@pytest.mark.parametrize(
    "method,plan",
    [("dpo", "one pair per chunk"), ("dpo", "two pairs per chunk"), ("dpo", "two passes"),
     ("kto", "one pair per chunk"), ("kto", "two pairs per chunk")],
)
def test_chunking_plans(poison_outputs, device, method, plan):
    # (The other tests run all pairs in one chunk; KTO's two passes are tested with its estimated
    # baseline.) Two per chunk leave the last chunk one; the two passes' 11-row chunks cut
    # through sequences.
    h, w, b, ref_h, target, labels = _inputs(method, 257, torch.float32, device)
    budget = {
        "one pair per chunk": _budget(1, 257, torch.float32, method),
        "two pairs per chunk": _budget(2, 257, torch.float32, method),
        "two passes": (2 * T - 1) * 257 * 4,
    }[plan]
    kw = METHOD_KWARGS[method]
    compare_fwd_bwd(
        _ours(method, target, labels, ref_h, budget, **kw), _paper_loss(method, target, labels, ref_h, **kw),
        (h, w, b), name=plan,
    )


def test_chunks_hold_the_fewest_pairs_that_make_full_size_gemms():
    # The chunk of logits lives at the training step's memory peak: the default plan holds one
    # pair of 2 x 1024 tokens at Llama 3's vocabulary (501 MiB in bf16), not three; short pairs
    # share a chunk up to PREFERRED_CHUNK_BYTES, or up to a smaller max_chunk_bytes.
    from tigon.ops.linear_preference import DEFAULT_MAX_CHUNK_BYTES, PreferenceOptions, plan_chunks

    dpo, bf16 = PreferenceOptions("dpo"), torch.bfloat16
    assert tuple(plan_chunks(dpo, 8, 1024, 128256, bf16, DEFAULT_MAX_CHUNK_BYTES, False)) == (True, 1, 2048)
    assert tuple(plan_chunks(dpo, 16, 128, 128256, bf16, DEFAULT_MAX_CHUNK_BYTES, False)) == (True, 4, 1024)
    assert tuple(plan_chunks(dpo, 16, 128, 128256, bf16, 2**27, False)) == (True, 2, 512)
    assert tuple(plan_chunks(dpo, 4, 128, 128256, bf16, DEFAULT_MAX_CHUNK_BYTES, False)) == (True, 2, 512)
    assert not plan_chunks(dpo, 8, 4096, 128256, bf16, DEFAULT_MAX_CHUNK_BYTES, False).one_pass


def test_kto_estimates_the_kl_baseline_from_the_batch(poison_outputs, device):
    # Without kl_baseline, z0 = max(0, mean policy/reference log ratio), detached: a two-pass plan.
    kw = dict(METHOD_KWARGS["kto"])
    del kw["kl_baseline"]
    # A draw's mean log ratio is negative about half the time (the baseline is then 0, which
    # checks nothing): draw until it is positive.
    for _ in range(30):
        h, w, b, ref_h, target, labels = _inputs("kto", 257, torch.float32, device)
        s, _ = _sequence_stats(h.detach(), w.detach(), b.detach(), target)
        r, _ = _sequence_stats(ref_h.double(), w.detach().double(), b.detach().double(), target)
        kl = (s - r).mean().clamp(min=0)
        if kl > 0:
            break
    else:
        pytest.fail("30 draws gave no positive baseline")
    loss, metrics = F.linear_preference_loss(h, w, target, b, method="kto", ref_hidden=ref_h, labels=labels, **kw)
    assert_close(metrics["kl"], kl.float(), name="kl")
    compare_fwd_bwd(
        _ours("kto", target, labels, ref_h, 2**30, **kw),
        _paper_loss("kto", target, labels, ref_h, kl_baseline=kl.item(), **kw),
        (h, w, b), name="kto estimated kl",
    )


def test_reference_by_hidden_states_or_log_probs(poison_outputs, device):
    h, w, b, ref_h, target, _ = _inputs("dpo", 257, torch.float32, device)
    ref_w = (w.detach() + 0.1 * torch.randn_like(w)).requires_grad_()  # gets no gradient
    ref_b = torch.randn_like(b.detach())
    kw = METHOD_KWARGS["dpo"]
    with torch.no_grad():
        by_hidden = F.linear_preference_loss(h, w, target, b, method="dpo", ref_hidden=ref_h, ref_weight=ref_w, ref_bias=ref_b, **kw)
    ref_logps, _ = _sequence_stats(ref_h, ref_w.detach(), ref_b, target)
    by_sums = F.linear_preference_loss(h, w, target, b, method="dpo", ref_log_probs=ref_logps.float(), **kw)
    assert_close(by_hidden[0], by_sums[0], name="loss")
    for key in by_hidden[1]:
        assert_close(by_hidden[1][key], by_sums[1][key], name=key)
    # with ref_weight not given, the reference is scored with the policy's head (it gets no gradient)
    w.requires_grad_(False)
    default_head = F.linear_preference_loss(h, w, target, b, method="dpo", ref_hidden=ref_h, **kw)[0]
    default_head.backward()
    assert w.grad is None and ref_w.grad is None
    own, _ = _sequence_stats(ref_h, w, b.detach(), target)
    with torch.no_grad():
        by_own_sums = F.linear_preference_loss(h, w, target, b, method="dpo", ref_log_probs=own.float(), **kw)[0]
    assert_close(default_head, by_own_sums, name="default reference head")


@pytest.mark.parametrize("frozen_hidden", [False, True])
def test_frozen_tensors_skip_their_gemms(poison_outputs, device, monkeypatch, frozen_hidden):
    h, w, b, ref_h, target, _ = _inputs("dpo", 257, torch.float32, device)
    shapes = []
    real_mm, real_addmm_ = torch.mm, torch.Tensor.addmm_

    def mm(*a, **k):
        out = real_mm(*a, **k)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch.Tensor, "addmm_", lambda self, *a, **k: shapes.append(tuple(self.shape)) or real_addmm_(self, *a, **k))
    budget = _budget(1, 257, torch.float32, "dpo")
    if frozen_hidden:
        h.requires_grad_(False)
        fn, ref, args = (lambda w, b: _ours("dpo", target, None, ref_h, budget, beta=0.3)(h, w, b),
                         lambda w, b: _paper_loss("dpo", target, None, ref_h, beta=0.3)(h.double(), w, b), (w, b))
    else:
        w.requires_grad_(False)
        b.requires_grad_(False)
        fn, ref, args = (lambda h: _ours("dpo", target, None, ref_h, budget, beta=0.3)(h, w, b),
                         lambda h: _paper_loss("dpo", target, None, ref_h, beta=0.3)(h, w.double(), b.double()), (h,))
    compare_fwd_bwd(fn, ref, args, name=f"frozen hidden={frozen_hidden}")
    # addmm (with bias) runs the logits: 1 GEMM per policy chunk, 1 per reference chunk
    if frozen_hidden:
        assert (T, H) not in shapes and shapes.count(tuple(w.shape)) == B
    else:
        assert tuple(w.shape) not in shapes and shapes.count((T, H)) == 2 * B  # chosen and rejected rows per pair


@pytest.mark.parametrize("name", ["dpo", "ipo", "simpo", "orpo", "kto"])
def test_empty_sequences_add_nothing(poison_outputs, device, name):
    # A pair (kto: a sequence) whose sequence has no scored token adds 0 and no NaN anywhere.
    method = _method(name)
    h, w, b, ref_h, target, labels = _inputs(method, 257, torch.float32, device)
    target[1] = IGNORE
    if method != "kto":
        target[B + 2] = IGNORE
    kw = METHOD_KWARGS[name]
    uses_ref = method in ("dpo", "robust", "hinge", "ipo", "kto")
    loss, metrics = F.linear_preference_loss(
        h, w, target, b, method=method, labels=labels, **(dict(ref_hidden=ref_h) if uses_ref else {}), **kw,
    )
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(m).all() for m in metrics.values())
    for p in (h, w, b):
        assert torch.isfinite(p.grad).all()
    assert torch.equal(h.grad[1], torch.zeros(T, H))
    # The other units' terms: the formula over them alone, still divided by all units; the NLL
    # over every chosen sequence (an empty one adds no token).
    units = _n_seq(method) if method == "kto" else B
    keep = [i for i in range(units) if i != 1] if method == "kto" else [0]
    sequences = keep if method == "kto" else keep + [B + i for i in keep]
    sub = _paper_loss(
        name, target[sequences], labels[keep] if method == "kto" else None,
        ref_h[sequences] if uses_ref else None, **{**kw, "nll_weight": 0.0},
    )
    want = sub(h.detach()[sequences].double(), w.detach().double(), b.detach().double()) * len(keep) / units
    s, n = _sequence_stats(h.detach().double(), w.detach().double(), b.detach().double(), target)
    chosen = labels if method == "kto" else torch.arange(_n_seq(method), device=device) < B
    want = want + kw.get("nll_weight", 1.0 if method in ("cpo", "orpo") else 0.0) * _nll(s[chosen], n[chosen])
    assert_close(loss, want.float(), name="loss over the non-empty units")


def test_nan_hidden_gives_nan_loss(poison_outputs, device):
    h, w, b, ref_h, target, _ = _inputs("dpo", 257, torch.float32, device)
    with torch.no_grad():
        h[0, -1, 4] = float("nan")  # a scored token
    loss, metrics = F.linear_preference_loss(h, w, target, b, method="dpo", ref_hidden=ref_h)
    loss.backward()
    assert torch.isnan(loss) and torch.isnan(metrics["chosen_rewards"][0])
    assert torch.isnan(w.grad).any()


def test_second_backward_and_upstream_scale(poison_outputs, device):
    h, w, b, ref_h, target, _ = _inputs("dpo", 257, torch.float32, device)
    loss, _ = F.linear_preference_loss(h, w, target, b, method="dpo", ref_hidden=ref_h)
    (loss * 0.5).backward(retain_graph=True)
    first = [p.grad.clone() for p in (h, w, b)]
    (loss * 2.0).backward()
    refs = [p.detach().double().requires_grad_() for p in (h, w, b)]
    _paper_loss("dpo", target, None, ref_h)(*refs).backward()
    for name, p, once, ref in zip("hwb", (h, w, b), first, refs):
        assert_close(once, 0.5 * ref.grad.float(), name=f"grad {name}")
        assert_close(p.grad, 2.5 * ref.grad.float(), name=f"accumulated grad {name}")


def test_no_grad_runs_the_logits_gemms_only(device, monkeypatch):
    h, w, b, ref_h, target, _ = _inputs("dpo", 257, torch.float32, device, bias=False)
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a, **k: calls.append(1) or real_mm(*a, **k))
    with torch.no_grad():
        loss, _ = F.linear_preference_loss(h, w, target, method="dpo", ref_hidden=ref_h, max_chunk_bytes=_budget(1, 257, torch.float32, "dpo"))
    assert len(calls) == 2 * B  # 3 reference chunks, 3 policy chunks
    assert_close(loss, _paper_loss("dpo", target, None, ref_h)(h.double(), w.double()).float().detach(), name="loss")


# TRL's own loss code: DPOTrainer and KTOTrainer compute theirs inside `_compute_loss`, which runs
# on a stand-in for the trainer (the attributes it reads) and a model that returns given per-token
# log-probs; the experimental CPO and ORPO trainers expose `cpo_loss` / `odds_ratio_loss`.

def _accelerator(device):
    return SimpleNamespace(device=device, gather=lambda x: x, gather_for_metrics=lambda x: x)


def _trl_batch(target, per_token):
    """input_ids / masks whose shifted labels are `target`, and a model returning `per_token`."""
    n, _ = target.shape
    valid = target != IGNORE
    zeros = torch.zeros(n, 1, dtype=torch.long, device=target.device)
    batch = dict(
        input_ids=torch.cat([zeros, torch.where(valid, target, 0)], 1),
        attention_mask=torch.ones(n, T + 1, dtype=torch.long, device=target.device),
        completion_mask=torch.cat([zeros, valid.long()], 1),
    )

    def model(**_):
        return SimpleNamespace(
            log_probs=per_token, entropy=torch.zeros_like(per_token), mean_logits=torch.zeros_like(per_token),
            is_top1=torch.zeros_like(per_token, dtype=torch.bool),
        )

    return batch, model


def _per_token(h, w, b, target):
    from tigon.ops.linear_log_probs import linear_log_probs_reference

    return linear_log_probs_reference(h, w, target, b, IGNORE)


TRL_DPO_LOSS_TYPES = [
    ("sigmoid", "dpo", dict(beta=0.3)),
    ("hinge", "hinge", dict(beta=0.15)),
    ("ipo", "ipo", dict(beta=0.4)),
    ("robust", "robust", dict(beta=0.3, label_smoothing=0.2)),
    ("apo_zero", "apo_zero", dict(beta=0.3)),
    ("apo_down", "apo_down", dict(beta=0.3)),
    ("sppo_hard", "sppo_hard", dict(beta=0.4)),
    ("nca_pair", "nca_pair", dict(beta=0.3)),
    ("bco_pair", "bco_pair", dict(beta=0.3)),
    ("exo_pair", "exo_pair", dict(beta=0.3, label_smoothing=0.05)),
    ("discopop", "discopop", dict(beta=0.3, tau=0.2)),
    # TRL's per-token-mean DPO is its sigmoid_norm loss type
    ("sigmoid_norm", "dpo", dict(beta=0.3, average_log_probs=True)),
]


@pytest.mark.parametrize("loss_type,method,kw,dtype", [
    (*case, torch.float32) for case in TRL_DPO_LOSS_TYPES
] + [(*case, torch.float16) for case in TRL_DPO_LOSS_TYPES if case[0] in ("apo_down", "exo_pair", "discopop")])
def test_matches_trl_dpo_trainer(poison_outputs, device, loss_type, method, kw, dtype):
    dpo_trainer = pytest.importorskip("trl.trainer.dpo_trainer")
    h, w, b, ref_h, target, _ = _inputs(method, 257, dtype, device)
    ref_logps, _ = _sequence_stats(ref_h, w.detach(), b.detach(), target)

    def trl_loss(h, w, b):
        batch, model = _trl_batch(target, _per_token(h, w, b, target))
        batch.update(ref_chosen_logps=ref_logps[:B], ref_rejected_logps=ref_logps[B:])
        trainer = SimpleNamespace(
            model=SimpleNamespace(training=True), accelerator=_accelerator(h.device), aux_loss_enabled=False,
            ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type],
            loss_weights=[1.0], beta=kw["beta"], label_smoothing=kw.get("label_smoothing", 0.0), use_weighting=False,
            args=SimpleNamespace(discopop_tau=kw.get("tau", 0.05)),
            _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
        )
        return dpo_trainer.DPOTrainer._compute_loss(trainer, model, batch, return_outputs=False)

    compare_fwd_bwd(
        lambda h, w, b: F.linear_preference_loss(h, w, target, b, method=method, ref_log_probs=ref_logps.float(), **kw)[0],
        trl_loss, (h, w, b), name=f"TRL {loss_type}",
    )


@pytest.mark.parametrize("method,plan", [
    ("apo_down", "two passes"), ("discopop", "one pair per chunk"), ("nca_pair", "two pairs per chunk"),
])
def test_dpo_loss_types_over_chunking_plans(poison_outputs, device, method, plan):
    # Against the same loss over all pairs in one chunk (that one against TRL above).
    h, w, b, ref_h, target, _ = _inputs(method, 257, torch.float32, device)
    budget = {"one pair per chunk": _budget(1, 257, torch.float32, method),
              "two pairs per chunk": _budget(2, 257, torch.float32, method), "two passes": (2 * T - 1) * 257 * 4}[plan]
    compare_fwd_bwd(
        _ours(method, target, None, ref_h, budget, beta=0.3),
        lambda h, w, b: preference.linear_preference_loss_reference(
            h, w, target, b, ref_h.double(), w.detach(), b.detach(), None, None, None, None,
            preference.PreferenceOptions(method, 0.3))[0],
        (h, w, b), name=f"{method} {plan}",
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cpo_on_average_log_probs_matches_trl(poison_outputs, device, dtype):
    # TRL's CPOTrainer averages the log-probs it hands cpo_loss (get_batch_logps' average_log_prob).
    cpo = pytest.importorskip("trl.experimental.cpo")
    h, w, b, _, target, _ = _inputs("cpo", 257, dtype, device)

    def trl_loss(h, w, b):
        s, n = _sequence_stats(h, w, b, target)
        trainer = SimpleNamespace(alpha=0.0, beta=0.2, loss_type="sigmoid", simpo_gamma=0.5, label_smoothing=0.1,
                                  accelerator=_accelerator(h.device))
        losses, _, _ = cpo.CPOTrainer.cpo_loss(trainer, s[:B] / n[:B], s[B:] / n[B:])
        return losses.mean()

    compare_fwd_bwd(
        lambda h, w, b: F.linear_preference_loss(h, w, target, b, method="cpo", beta=0.2, label_smoothing=0.1,
                                                 nll_weight=0.0, average_log_probs=True)[0],
        trl_loss, (h, w, b), name="TRL cpo_loss averaged",
    )


def _nll_target(target, device):
    """ORPO's NLL target for the chosen sequences: prompt and answer (TRL's labels: every token
    but padding), the answer's tokens those of `target` but for two that differ, and a padded
    tail, so that rows hold both targets, either one or neither."""
    chosen = target[:B]
    nll = torch.where(chosen != IGNORE, chosen, torch.randint(0, 257, chosen.shape, device=device))
    nll[0, -1] = (chosen[0, -1] + 1) % 257
    nll[1, -2:] = torch.randint(0, 257, (2,), device=device)
    nll[2, -1] = IGNORE
    return nll


@pytest.mark.parametrize("dtype,plan", [
    (torch.float32, "all pairs"), (torch.float32, "one pair per chunk"), (torch.float32, "two passes"),
    (torch.float16, "all pairs"),
])
def test_orpo_nll_on_its_own_target_matches_trl(poison_outputs, device, dtype, plan):
    # TRL's ORPOTrainer: the odds ratio of the answers' mean log-probs (odds_ratio_loss) minus, and
    # the chosen sequences' cross-entropy over their whole labels, prompt included.
    orpo = pytest.importorskip("trl.experimental.orpo")
    h, w, b, _, target, _ = _inputs("orpo", 257, dtype, device)
    nll_target = _nll_target(target, device)
    budget = {"all pairs": None, "one pair per chunk": _budget(1, 257, dtype, "orpo"),
              "two passes": (2 * T - 1) * 257 * dtype.itemsize}[plan]

    def trl_loss(h, w, b):
        s, n = _sequence_stats(h, w, b, target)
        trainer = SimpleNamespace(beta=0.25, accelerator=_accelerator(h.device))
        losses = orpo.ORPOTrainer.odds_ratio_loss(trainer, s[:B] / n[:B], s[B:] / n[B:])[0]
        logits = TF.linear(h[:B], w, b)
        nll = TF.cross_entropy(logits.reshape(-1, 257), nll_target.reshape(-1), ignore_index=IGNORE)
        return nll - losses.mean()

    compare_fwd_bwd(
        lambda h, w, b: F.linear_preference_loss(h, w, target, b, method="orpo", beta=0.25, nll_target=nll_target,
                                                 max_chunk_bytes=budget)[0],
        trl_loss, (h, w, b), name=f"TRL orpo nll_target {plan}",
    )


def test_nll_target_metric_and_reference_path(device):
    h, w, b, _, target, _ = _inputs("orpo", 257, torch.float64, device)
    nll_target = _nll_target(target, device)
    with torch.no_grad():
        _, metrics = F.linear_preference_loss(h, w, target, b, method="orpo", nll_target=nll_target)
        logits = TF.linear(h[:B], w, b)
        want = TF.cross_entropy(logits.reshape(-1, 257), nll_target.reshape(-1), ignore_index=IGNORE)
    assert_close(metrics["chosen_nll"], want, name="chosen_nll")


@pytest.mark.parametrize("average,dtype", [(False, torch.float32), (True, torch.float32), (True, torch.float16)])
def test_matches_trl_kto_trainer(poison_outputs, device, average, dtype):
    # TRL's KTO sums the per-token log-probs its model returns: given them divided by each
    # sequence's length, it scores the per-token means, as average_log_probs does.
    kto_trainer = pytest.importorskip("trl.trainer.kto_trainer")
    h, w, b, ref_h, target, labels = _inputs("kto", 257, dtype, device)
    ref_logps, n = _sequence_stats(ref_h, w.detach(), b.detach(), target)
    per_sequence = n if average else torch.ones_like(n)
    kw = dict(beta=0.3, desirable_weight=1.3, undesirable_weight=0.7)

    def trl_loss(h, w, b):
        batch, model = _trl_batch(target, _per_token(h, w, b, target) / per_sequence[:, None])
        batch.update(label=labels, ref_logps=ref_logps / per_sequence)
        trainer = SimpleNamespace(
            model=SimpleNamespace(training=True), accelerator=_accelerator(h.device), aux_loss_enabled=False,
            calculate_KL=False, precompute_ref_logps=True, loss_type="kto", _compute_kl_logps=lambda model, batch: None,
            _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1, **kw,
        )
        return kto_trainer.KTOTrainer._compute_loss(trainer, model, batch, return_outputs=False)

    # TRL without KL completions uses z0 = 0
    compare_fwd_bwd(
        lambda h, w, b: F.linear_preference_loss(
            h, w, target, b, method="kto", ref_log_probs=ref_logps.float(), labels=labels, kl_baseline=0.0,
            average_log_probs=average, **kw
        )[0],
        trl_loss, (h, w, b), name=f"TRL kto average={average}",
    )


@pytest.mark.parametrize("loss_type,method,kw", [
    ("sigmoid", "cpo", dict(beta=0.2, label_smoothing=0.1)),
    ("simpo", "simpo", dict(beta=2.0, gamma=0.3)),
])
def test_matches_trl_cpo_loss(poison_outputs, device, loss_type, method, kw):
    cpo = pytest.importorskip("trl.experimental.cpo")
    h, w, b, _, target, _ = _inputs(method, 257, torch.float32, device)

    def trl_loss(h, w, b):
        s, n = _sequence_stats(h, w, b, target)
        if method == "simpo":  # TRL's SimPO scores with per-token averages
            s = s / n
        trainer = SimpleNamespace(alpha=0.0, beta=kw["beta"], loss_type=loss_type, simpo_gamma=kw.get("gamma", 0.5),
                                  label_smoothing=kw.get("label_smoothing", 0.0), accelerator=_accelerator(h.device))
        losses, _, _ = cpo.CPOTrainer.cpo_loss(trainer, s[:B], s[B:])
        return losses.mean()

    compare_fwd_bwd(
        lambda h, w, b: F.linear_preference_loss(h, w, target, b, method=method, nll_weight=0.0, **kw)[0],
        trl_loss, (h, w, b), name=f"TRL cpo_loss {loss_type}",
    )


def test_matches_trl_orpo_odds_ratio_loss(poison_outputs, device):
    # TRL's ORPO NLL covers the prompt too; the odds-ratio term is compared here, the NLL above.
    orpo = pytest.importorskip("trl.experimental.orpo")
    h, w, b, _, target, _ = _inputs("orpo", 257, torch.float32, device)

    def trl_loss(h, w, b):
        s, n = _sequence_stats(h, w, b, target)
        trainer = SimpleNamespace(beta=0.25, accelerator=_accelerator(h.device))
        losses = orpo.ORPOTrainer.odds_ratio_loss(trainer, s[:B] / n[:B], s[B:] / n[B:])[0]
        return -losses.mean()

    compare_fwd_bwd(
        lambda h, w, b: F.linear_preference_loss(h, w, target, b, method="orpo", beta=0.25, nll_weight=0.0)[0],
        trl_loss, (h, w, b), name="TRL odds_ratio_loss",
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(method="sppo"), "method must be one of"),
        (dict(method="dpo"), "needs exactly one of ref_hidden and ref_log_probs"),
        (dict(method="dpo", ref_log_probs=torch.zeros(4), ref_hidden=torch.zeros(4, 3, 8)), "exactly one of"),
        (dict(method="simpo", ref_log_probs=torch.zeros(4)), "reference-free"),
        (dict(method="dpo", ref_log_probs=torch.zeros(3)), r"ref_log_probs must have shape \(4,\)"),
        (dict(method="dpo", ref_hidden=torch.zeros(4, 2, 8)), "ref_hidden must have the shape of hidden"),
        (dict(method="dpo", ref_log_probs=torch.zeros(4), ref_weight=torch.zeros(10, 8)), "go with ref_hidden"),
        (dict(method="dpo", ref_log_probs=torch.zeros(4), beta=0.0), "beta must be a positive float"),
        (dict(method="robust", ref_log_probs=torch.zeros(4), label_smoothing=0.5), r"\[0, 0.5\)"),
        (dict(method="ipo", ref_log_probs=torch.zeros(4), label_smoothing=0.1), "label_smoothing is for methods"),
        (dict(method="dpo", ref_log_probs=torch.zeros(4), gamma=0.5), "gamma is SimPO's margin"),
        (dict(method="cpo", nll_weight=-1.0), "nll_weight must be a non-negative float"),
        (dict(method="dpo", ref_log_probs=torch.zeros(4), kl_baseline=0.1), "kl_baseline is for method 'kto'"),
        (dict(method="dpo", ref_log_probs=torch.zeros(4), desirable_weight=2.0), "desirable_weight is for method 'kto'"),
        (dict(method="dpo", ref_log_probs=torch.zeros(4), labels=torch.ones(4, dtype=torch.bool)), "labels are for method 'kto'"),
        (dict(method="kto", ref_log_probs=torch.zeros(4)), r"labels must be a bool tensor of shape \(4,\)"),
        (dict(method="kto", ref_log_probs=torch.zeros(4), labels=torch.ones(4, dtype=torch.bool), kl_baseline=[1.0]), "kl_baseline must be"),
        (dict(method="dpo", ref_log_probs=torch.zeros(4), max_chunk_bytes=0), "max_chunk_bytes must be a positive int"),
        (dict(h=torch.randn(3, 3, 8), t=torch.zeros(3, 3, dtype=torch.long), method="cpo"), "2B sequences"),
        (dict(h=torch.randn(12, 8), t=torch.zeros(12, dtype=torch.long), method="cpo"), r"hidden must have shape \(sequences, tokens"),
        (dict(w=torch.randn(10, 8).half(), method="cpo"), "weight must have the dtype of hidden"),
        (dict(method="exo_pair", ref_log_probs=torch.zeros(4)), r"in \(0, 1\) for method 'exo_pair'"),
        (dict(method="dpo", ref_log_probs=torch.zeros(4), tau=0.1), "tau is DiscoPOP's temperature"),
        (dict(method="discopop", ref_log_probs=torch.zeros(4), tau=0.0), "tau must be a positive float"),
        (dict(method="ipo", ref_log_probs=torch.zeros(4), average_log_probs=True), "per-token means already"),
        (dict(method="dpo", ref_log_probs=torch.zeros(4), average_log_probs=1), "average_log_probs must be a bool"),
        (dict(method="orpo", nll_target=torch.zeros(2, 2, dtype=torch.long)), r"nll_target must hold token ids \(int64 or int32\) of shape \(2, 3\)"),
        (dict(method="cpo", nll_weight=0.0, nll_target=torch.zeros(2, 3, dtype=torch.long)), "nll_weight 0"),
        (dict(method="kto", ref_log_probs=torch.zeros(4), labels=torch.ones(4, dtype=torch.bool),
              nll_target=torch.zeros(2, 3, dtype=torch.long)), "nll_target is for the paired methods"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    args = dict(h=torch.randn(4, 3, 8), w=torch.randn(10, 8), t=torch.zeros(4, 3, dtype=torch.long), b=None)
    args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args})
    with pytest.raises(ValueError, match=match):
        F.linear_preference_loss(args["h"], args["w"], args["t"], args["b"], **kwargs)


def _gpu_inputs(n_seq, seq_len, hidden, vocab, bias=False):
    device = torch.device("cuda")
    h = torch.randn(n_seq, seq_len, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=device) * hidden**-0.5).to(torch.bfloat16).requires_grad_()
    b = (0.1 * torch.randn(vocab, device=device)).to(torch.bfloat16).requires_grad_() if bias else None
    ref_h = (h.detach().float() + 0.1 * torch.randn_like(h, dtype=torch.float32)).to(torch.bfloat16)
    target = torch.randint(0, vocab, (n_seq, seq_len), device=device)
    target[:, : seq_len // 4] = IGNORE
    return h, w, b, ref_h, target


@pytest.mark.gpu
@pytest.mark.parametrize("method,two_pass", [("dpo", False), ("dpo", True), ("simpo", False), ("kto", False)])
def test_bf16_on_gpu(method, two_pass):
    n_seq = 6 if method == "kto" else 4
    h, w, b, ref_h, target = _gpu_inputs(n_seq, 500, 1024, 32064, bias=True)
    labels = torch.tensor([True, False, True, True, False, False], device="cuda") if method == "kto" else None
    kw = dict(METHOD_KWARGS[method])
    budget = 1000 * 32064 if two_pass else None  # 500 rows of bf16 logits: less than a pair
    uses_ref = method in ("dpo", "kto")
    paper = _paper_loss(method, target, labels, ref_h if uses_ref else None, **kw)
    # The oracle's logits are rounded to bf16 as F.linear (and so the op) rounds them: a sum over
    # hundreds of tokens would otherwise carry that rounding past bf16's tolerance.
    compare_fwd_bwd(
        _ours(method, target, labels, ref_h if uses_ref else None, budget, **kw),
        lambda h, w, b: paper(h.bfloat16(), w.bfloat16(), b.bfloat16()),
        (h, w, b), torch.bfloat16, name=f"bf16 {method} two_pass={two_pass}",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("method,kw", [
    ("apo_zero", {}), ("sppo_hard", {}), ("exo_pair", dict(label_smoothing=0.01)), ("discopop", {}),
    ("dpo", dict(average_log_probs=True)), ("cpo", dict(average_log_probs=True)), ("orpo", dict(nll_target=True)),
])
def test_variants_bf16_on_gpu(method, kw):
    # Against the reference in float64 on logits rounded to bf16 as F.linear rounds them.
    h, w, b, ref_h, target = _gpu_inputs(4, 500, 1024, 32064, bias=True)
    kw = dict(kw)
    nll_target = None
    if kw.pop("nll_target", False):
        nll_target = torch.where(target[:2] != IGNORE, target[:2], torch.randint_like(target[:2], 32064))
    # (The op's default NLL weight: 1 for orpo and cpo, part of those methods.)
    options = preference.PreferenceOptions(method, 0.1, nll_weight=1.0 if method in ("orpo", "cpo") else 0.0, **kw)
    reference = method in preference.REFERENCE_METHODS
    full_nll = None if nll_target is None else torch.cat([nll_target, torch.full_like(nll_target, IGNORE)])

    def oracle(h, w, b):
        ref = (ref_h, w.detach().bfloat16(), b.detach().bfloat16()) if reference else (None, None, None)
        return preference.linear_preference_loss_reference(
            h.bfloat16(), w.bfloat16(), target, b.bfloat16(), *ref, None, None, None, full_nll, options)[0]

    compare_fwd_bwd(
        lambda h, w, b: F.linear_preference_loss(h, w, target, b, method=method, beta=0.1, nll_target=nll_target,
                                                 **(dict(ref_hidden=ref_h) if reference else {}), **kw)[0],
        oracle, (h, w, b), torch.bfloat16, name=f"bf16 {method} {kw}",
    )


@pytest.mark.gpu
def test_peak_memory_on_gpu():
    # The bound: policy + reference 2 x (4 x 2048) tokens, H 4096, V 128256, trainable head:
    # at most 2.3 GB beyond the gradients.
    h, w, _, ref_h, target = _gpu_inputs(8, 2048, 4096, 128256)

    def step():
        loss, _ = F.linear_preference_loss(h, w, target, method="dpo", ref_hidden=ref_h)
        loss.backward()

    step()
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - h.grad.nbytes - w.grad.nbytes
    assert extra <= 2.3e9, f"{extra / 1e9:.2f} GB beyond the gradients"


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_no_host_sync_on_gpu(method):
    h, w, b, ref_h, target = _gpu_inputs(4, 500, 1024, 32064, bias=True)
    extra = dict(ref_hidden=ref_h) if method == "dpo" else {}
    F.linear_preference_loss(h, w, target, b, method=method, **extra)[0].backward()  # warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, metrics = F.linear_preference_loss(h, w, target, b, method=method, **extra)
        (loss * 0.5).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("method,average", [(m, False) for m in preference.METHODS]
                         + [(m, True) for m in preference.AVERAGED_METHODS])
def test_closed_form_coefficients_are_the_objectives_gradient(method, average):
    # The kernels scale each sequence's rows by d loss / d (its log-prob sum), written in closed form.
    n = 6 if method == "kto" else 12
    counts = torch.randint(0, 4, (n,), dtype=torch.float64)  # empty sequences included
    logps = -3 * torch.rand(n, dtype=torch.float64) * counts.clamp(min=1) - 0.01
    ref = logps + torch.randn(n, dtype=torch.float64) if method in preference.REFERENCE_METHODS else None
    labels = torch.rand(n) > 0.5 if method == "kto" else None
    kl = torch.tensor(0.2, dtype=torch.float64) if method == "kto" else None
    eps = 0.2 if method in preference.SMOOTHED_METHODS else 0.0
    options = preference.PreferenceOptions(method, 0.3, eps, 0.7, 0.4, 1.3, 0.6, 0.2, average_log_probs=average)
    context = (ref, counts, labels, kl, n if method == "kto" else n // 2, preference._nll_tokens(options, counts, labels))
    leaf = logps.clone().requires_grad_()
    (want,) = torch.autograd.grad(preference._objective(options, leaf, *context), leaf)
    _, got = preference._objective_and_coefficients(options, logps, *context)
    assert_close(got, want, name=f"{method} coefficients")
