"""linear_policy_loss against each loss as its paper writes it (float64, from materialised logits),
against TRL's GRPOTrainer._compute_loss on given per-token log-probs, and over the chunking plans
(token chunks that cut completions, whole completions per chunk, two passes, a frozen head)."""

import pytest
import torch
import torch.nn.functional as TF

import tigon.functional as F
from tests.helpers import (
    REL_TOL, assert_close, compare_fwd_bwd, count_gemms, peak_bytes_beyond_grads, run_without_host_sync,
)
from tigon.bench.ops.rl import trl_grpo_inputs, trl_grpo_trainer, trl_sampling_ratio

B, T, H = 5, 6, 19  # 5 completions padded to 6 tokens, an odd hidden size
LENGTHS = [6, 4, 5, 2, 6]
ADVANTAGES = [1.3, -0.7, 0.4, -1.1, 0.9]  # both signs, so that both clip sides can bind
# log(pi / pi_old) per token (token level) or per completion (sequence level): well inside or
# outside the clip range [log 0.8, log 1.28], so that rounding cannot move a token across its edge.
LOG_RATIOS = torch.tensor([-0.6, -0.35, -0.08, 0.06, 0.4, 0.65])

CASES = {
    "grpo": dict(loss_type="grpo", beta=0.04, temperature=0.7),
    "dapo": dict(loss_type="dapo", epsilon_high=0.28),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.02, max_completion_length=8),
    "bnpo": dict(loss_type="bnpo", beta=0.04),
    "gspo": dict(loss_type="gspo", temperature=1.3),
}


def _inputs(dtype, device, vocab=257, bias=True):
    h = torch.randn(B, T, H, device=device).to(dtype).requires_grad_()
    w = (torch.randn(vocab, H, device=device) * 2 * H**-0.5).to(dtype).requires_grad_()
    b = (0.5 * torch.randn(vocab, device=device)).to(dtype).requires_grad_() if bias else None
    target = torch.randint(0, vocab, (B, T), device=device)
    mask = torch.arange(T, device=device) < torch.tensor(LENGTHS, device=device)[:, None]
    return h, w, b, target, mask, torch.tensor(ADVANTAGES, device=device)


def _log_probs(h, w, b, target, temperature=1.0, logits_dtype=None):
    """Per-token log-probabilities and entropies in float64 from the materialised logits, rounded
    to the inputs' dtype (or to `logits_dtype`: an oracle's float64 inputs stand for lower-precision
    ones), as F.linear and so the op round them."""
    logits = TF.linear(h, w, b)
    log_p = torch.log_softmax(logits.to(logits_dtype or logits.dtype).double() / temperature, -1)
    return log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def _old_and_ref(h, w, b, target, mask, level, temperature=1.0):
    """Sampling-policy log-probs whose ratios to the policy's are LOG_RATIOS (per token, or per
    completion as the mean over its tokens), and reference log-probs near the policy's."""
    with torch.no_grad():
        logp, _ = _log_probs(h, w, b, target, temperature)
    device = logp.device
    ratios = LOG_RATIOS.to(device)
    if level == "token":  # every ratio along each completion, so that both clips bind somewhere
        position = torch.arange(B, device=device)[:, None] + torch.arange(T, device=device)
        log_ratio = ratios[position % 6] + 0.04 * (torch.rand(B, T, device=device) - 0.5)
    else:  # completions 0 and 4 clipped high (A > 0), 1 and 3 low (A < 0), 2 inside the range
        jitter = 0.3 * torch.randn(B, T, device=device, dtype=torch.float64)
        jitter = jitter - (jitter * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = ratios[[5, 0, 2, 1, 4]][:, None] + jitter
    return (logp - log_ratio).float(), (logp + 0.3 * torch.randn_like(logp)).float()


def _paper_loss(target, mask, old, advantages, ref, loss_type="grpo", beta=0.0, epsilon=0.2, epsilon_high=None,
                temperature=1.0, max_completion_length=T):
    """Each loss written from its paper, in float64."""
    eps_low, eps_high = epsilon, epsilon if epsilon_high is None else epsilon_high
    m = mask.double()
    n = m.sum(-1)
    adv = advantages.double()

    def fn(h, w, b=None):
        logp, _ = _log_probs(h, w, b, target, temperature)
        if loss_type == "gspo":
            # Zheng et al. 2025, eqs. 5-7: s_i = (pi(y_i) / pi_old(y_i))^(1 / |y_i|)
            s = torch.exp(((logp - old.double()) * m).sum(-1) / n)
            return -torch.min(s * adv, s.clamp(1 - eps_low, 1 + eps_high) * adv).mean()
        ratio = torch.exp(logp - old.double())
        surrogate = torch.min(ratio * adv[:, None], ratio.clamp(1 - eps_low, 1 + eps_high) * adv[:, None])
        if beta:
            # Shao et al. 2024, eq. 4: D_KL = pi_ref / pi - log(pi_ref / pi) - 1
            q = torch.exp(ref.double() - logp)
            surrogate = surrogate - beta * (q - torch.log(q) - 1)
        if loss_type == "grpo":  # Shao et al. 2024, eq. 3: 1/G sum_i 1/|o_i| sum_t
            objective = ((surrogate * m).sum(-1) / n).mean()
        elif loss_type == "dr_grpo":  # Liu et al. 2025: no 1/|o_i|, a constant divisor G * L
            objective = (surrogate * m).sum() / (target.shape[0] * max_completion_length)
        else:  # dapo (Yu et al. 2025, eq. 8: 1 / sum_i |o_i|) and bnpo, its local-batch form
            objective = (surrogate * m).sum() / n.sum()
        return -objective

    return fn


def _ours(target, mask, old, advantages, ref, budget=None, **kw):
    def fn(h, w, b=None):
        return F.linear_policy_loss(
            h, w, target, old, advantages, ref_log_probs=ref, mask=mask, bias=b, max_chunk_bytes=budget, **kw
        )[0]

    return fn


def _case(name, h, w, b, target, mask):
    kw = dict(CASES[name])
    level = "sequence" if name == "gspo" else "token"
    old, ref = _old_and_ref(h, w, b, target, mask, level, kw.get("temperature", 1.0))
    return kw, old, ref if kw.get("beta") else None


@pytest.mark.parametrize(
    "name,dtype,vocab",
    [(name, torch.float32, 1031) for name in CASES] + [(name, torch.float16, 257) for name in ("grpo", "gspo")],
)
def test_matches_paper_formula(poison_outputs, device, name, dtype, vocab):
    h, w, b, target, mask, adv = _inputs(dtype, device, vocab)
    kw, old, ref = _case(name, h, w, b, target, mask)
    # fp16: the weight gradient sums every row's fp16-rounded logits gradient; 2.4e-3 was seen on
    # one draw in ~70 against the fp16 bound of 2e-3, so the bound here leaves room for that sum.
    tol = 4e-3 if dtype == torch.float16 else None
    out = compare_fwd_bwd(_ours(target, mask, old, adv, ref, **kw), _paper_loss(target, mask, old, adv, ref, **kw),
                          (h, w, b), name=name, tol=tol)
    with torch.no_grad():
        metrics = F.linear_policy_loss(h, w, target, old, adv, ref_log_probs=ref, mask=mask, bias=b, **kw)[1]
    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0, "the test needs both clips active"
    assert out[0].dtype == torch.float32


@pytest.mark.parametrize("name", list(CASES))
def test_reference_path_matches_paper_formula(device, name):
    # float64 runs the PyTorch reference, the op's fallback
    h, w, b, target, mask, adv = _inputs(torch.float64, device)
    kw, old, ref = _case(name, h, w, b, target, mask)
    compare_fwd_bwd(_ours(target, mask, old, adv, ref, **kw), _paper_loss(target, mask, old, adv, ref, **kw),
                    (h, w, b), name=f"reference {name}")


@pytest.mark.parametrize(
    "name,plan",
    [("grpo", "token chunks of 4 rows"), ("gspo", "one completion per chunk"), ("gspo", "two completions per chunk"),
     ("gspo", "two passes"), ("gspo", "two passes, frozen head"), ("grpo", "frozen head")],
)
def test_chunking_plans(poison_outputs, device, name, plan):
    h, w, b, target, mask, adv = _inputs(torch.float32, device)
    kw, old, ref = _case(name, h, w, b, target, mask)
    rows = {"token chunks of 4 rows": 4, "one completion per chunk": T, "two completions per chunk": 2 * T}
    budget = rows.get(plan, T - 1) * 257 * 4  # two passes: 5-row chunks that cut completions
    if "frozen" in plan:
        w.requires_grad_(False)
        b.requires_grad_(False)
    compare_fwd_bwd(_ours(target, mask, old, adv, ref, budget, **kw), _paper_loss(target, mask, old, adv, ref, **kw),
                    (h, w, b), name=plan)


@pytest.mark.parametrize("level,frozen,plan_gemms", [
    ("token", False, 3), ("token", True, 2), ("sequence", False, 3), ("sequence", True, 2), ("two passes", False, 4),
])
def test_gemms_per_chunk(poison_outputs, device, monkeypatch, level, frozen, plan_gemms):
    # One pass: the logits and the two gradient GEMMs; a frozen head skips the weight's; two
    # passes recompute the logits once.
    h, w, b, target, mask, adv = _inputs(torch.float32, device, bias=False)
    w.requires_grad_(not frozen)
    old, _ = _old_and_ref(h, w, b, target, mask, "token")
    budget = (T - 1 if level == "two passes" else T) * 257 * 4  # one completion per chunk, or less
    shapes = count_gemms(monkeypatch)
    loss, _ = F.linear_policy_loss(h, w, target, old, adv, mask=mask, max_chunk_bytes=budget,
                                   importance_level="token" if level == "token" else "sequence")
    loss.backward()
    chunks = -(-B * T // (T - 1)) if level == "two passes" else B
    assert len(shapes) == plan_gemms * chunks
    assert (tuple(w.shape) in shapes) != frozen


def test_no_grad_runs_the_logits_gemms_only(device, monkeypatch):
    h, w, b, target, mask, adv = _inputs(torch.float32, device, bias=False)
    old, _ = _old_and_ref(h, w, b, target, mask, "token")
    shapes = count_gemms(monkeypatch)
    with torch.no_grad():
        loss, _ = F.linear_policy_loss(h, w, target, old, adv, mask=mask, max_chunk_bytes=T * 257 * 4)
    assert len(shapes) == B
    assert_close(loss, _paper_loss(target, mask, old, adv, None)(h, w).float(), name="loss")


def _entropy_mean(h, w, b, target, mask, temperature):
    _, entropy = _log_probs(h.detach(), w.detach(), b.detach(), target, temperature)
    return (entropy * mask).sum() / mask.sum()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_metrics(poison_outputs, device, level):
    h, w, b, target, mask, adv = _inputs(torch.float32, device)
    old, ref = _old_and_ref(h, w, b, target, mask, level, 0.7)
    _, metrics = F.linear_policy_loss(h, w, target, old, adv, ref_log_probs=ref, mask=mask, bias=b,
                                      importance_level=level, temperature=0.7)
    logp, _ = _log_probs(h.detach(), w.detach(), b.detach(), target, 0.7)
    m = mask.double()
    log_ratio = logp - old.double()
    if level == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1))[:, None]
    ratio, a = torch.exp(log_ratio), torch.tensor(ADVANTAGES, dtype=torch.float64, device=device)[:, None]
    low, high = ((ratio < 0.8) & (a < 0)).double(), ((ratio > 1.2) & (a > 0)).double()
    q = torch.exp(ref.double() - logp)
    if level == "token":
        means = [(x * m).sum() / m.sum() for x in (low, high, torch.maximum(low, high))]
        low_min, high_max = ((low * m).sum(-1) / m.sum(-1)).min(), ((high * m).sum(-1) / m.sum(-1)).max()
    else:  # one flag per completion
        means = [x.mean() for x in (low, high, torch.maximum(low, high))]
        low_min, high_max = low.min(), high.max()
    want = {
        "kl": ((q - torch.log(q) - 1) * m).sum() / m.sum(),
        "entropy": _entropy_mean(h, w, b, target, mask, 0.7),
        "clip_ratio/low_mean": means[0], "clip_ratio/high_mean": means[1], "clip_ratio/region_mean": means[2],
        "clip_ratio/low_min": low_min, "clip_ratio/high_max": high_max,
    }
    assert set(metrics) == set(want)
    for key, value in want.items():
        assert not metrics[key].requires_grad and metrics[key].shape == ()
        assert_close(metrics[key], value.float(), name=key)


def test_empty_completions_add_nothing(poison_outputs, device):
    # An empty completion's tokens add nothing; GRPO still divides by all B. Whatever the
    # unscored tokens' old/ref log-probs and advantages hold (NaN here), they change nothing.
    h, w, b, target, mask, adv = _inputs(torch.float32, device)
    old, ref = _old_and_ref(h, w, b, target, mask, "token")
    mask[1] = False
    planted = [x.clone() for x in (old, ref, adv[:, None].expand(B, T))]
    for x in planted:
        x[~mask] = float("nan")
    loss, metrics = F.linear_policy_loss(h, w, target, planted[0], planted[2], ref_log_probs=planted[1], beta=0.04,
                                         mask=mask, bias=b)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in (h, w, b)) and torch.isfinite(metrics["kl"])
    assert torch.equal(h.grad[1], torch.zeros(T, H))
    keep = [0, 2, 3, 4]
    sub = _paper_loss(target[keep], mask[keep], old[keep], adv[keep], ref[keep], beta=0.04)
    want = sub(h.detach()[keep], w.detach(), b.detach()) * len(keep) / B
    assert_close(loss, want.float(), name="loss over the non-empty completions")


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_all_masked_gives_zero(poison_outputs, device, level):
    h, w, b, target, mask, adv = _inputs(torch.float32, device)
    loss, metrics = F.linear_policy_loss(h, w, target, None, adv, mask=torch.zeros_like(mask), bias=b,
                                         importance_level=level)
    loss.backward()
    assert loss.item() == 0.0 and metrics["entropy"].item() == 0.0
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in (h, w, b))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_on_policy_is_the_ratio_one(poison_outputs, device, level):
    # old_log_probs=None: the current policy's log-probs, detached (the ratio is 1 with its gradient).
    h, w, b, target, mask, adv = _inputs(torch.float32, device)
    with torch.no_grad():
        own, _ = _log_probs(h, w, b, target)
    compare_fwd_bwd(_ours(target, mask, None, adv, None, importance_level=level),
                    _paper_loss(target, mask, own.float(), adv, None, loss_type="gspo" if level == "sequence" else "grpo"),
                    (h, w, b), name=f"on-policy {level}")


def test_per_token_advantages_and_kl_bias_correction(poison_outputs, device):
    # TRL's use_bias_correction_kl: the KL term times the ratio (token level); advantages per token.
    h, w, b, target, mask, _ = _inputs(torch.float32, device)
    old, ref = _old_and_ref(h, w, b, target, mask, "token")
    adv = torch.randn(B, T, device=device)
    m = mask.double()

    def paper(h, w, b):
        logp, _ = _log_probs(h, w, b, target)
        ratio = torch.exp(logp - old.double())
        a = adv.double()
        q = torch.exp(ref.double() - logp)
        per_token = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a) + 0.1 * ratio * (q - torch.log(q) - 1)
        return ((per_token * m).sum(-1) / m.sum(-1)).mean()

    compare_fwd_bwd(_ours(target, mask, old, adv, ref, beta=0.1, kl_bias_correction=True), paper, (h, w, b),
                    name="bias-corrected KL")


def test_nan_hidden_gives_nan_loss(poison_outputs, device):
    h, w, b, target, mask, adv = _inputs(torch.float32, device)
    with torch.no_grad():
        h[0, 2, 4] = float("nan")  # a scored token
    loss, metrics = F.linear_policy_loss(h, w, target, None, adv, mask=mask, bias=b)
    loss.backward()
    assert torch.isnan(loss) and torch.isnan(metrics["entropy"])
    assert torch.isnan(w.grad).any() and torch.isnan(h.grad[0, 2]).all()


def test_second_backward_and_upstream_scale(poison_outputs, device):
    h, w, b, target, mask, adv = _inputs(torch.float32, device)
    old, _ = _old_and_ref(h, w, b, target, mask, "token")
    loss, _ = F.linear_policy_loss(h, w, target, old, adv, mask=mask, bias=b)
    (loss * 0.5).backward(retain_graph=True)
    first = [p.grad.clone() for p in (h, w, b)]
    (loss * 2.0).backward()
    refs = [p.detach().double().requires_grad_() for p in (h, w, b)]
    _paper_loss(target, mask, old, adv, None)(*refs).backward()
    for name, p, once, ref in zip("hwb", (h, w, b), first, refs):
        assert_close(once, 0.5 * ref.grad.float(), name=f"grad {name}")
        assert_close(p.grad, 2.5 * ref.grad.float(), name=f"accumulated grad {name}")


def test_dapo_divides_by_num_items_in_batch(poison_outputs, device):
    h, w, b, target, mask, adv = _inputs(torch.float32, device)
    old, _ = _old_and_ref(h, w, b, target, mask, "token")
    global_tokens = torch.tensor(3.0 * mask.sum().item(), device=device)  # this batch is a third of the global one
    compare_fwd_bwd(_ours(target, mask, old, adv, None, loss_type="dapo", num_items_in_batch=global_tokens),
                    lambda *a: _paper_loss(target, mask, old, adv, None, loss_type="dapo")(*a) / 3, (h, w, b),
                    name="dapo global batch")


# TRL's own loss: GRPOTrainer._compute_loss on a stand-in for the trainer (the attributes it reads;
# the benchmark's TRL column uses the same one) given per-token log-probs and entropies.

@pytest.mark.parametrize("loss_type,level,beta,bias_correction,on_policy", [
    ("grpo", "token", 0.04, False, False),
    ("grpo", "token", 0.04, True, True),
    ("dapo", "token", 0.0, False, False),
    ("dr_grpo", "token", 0.02, True, False),
    ("bnpo", "sequence", 0.04, False, False),
    ("grpo", "sequence", 0.04, True, False),
    ("dapo", "sequence", 0.0, False, True),
])
def test_matches_trl_grpo_trainer(poison_outputs, device, loss_type, level, beta, bias_correction, on_policy):
    grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    h, w, b, target, mask, adv = _inputs(torch.float32, device)
    old, ref = _old_and_ref(h, w, b, target, mask, level, 0.8)
    old = None if on_policy else old
    max_length = 7
    trainers = []

    def trl_loss(h, w, b):
        logps, entropies = _log_probs(h, w, b, target, 0.8)
        trainers.append(trl_grpo_trainer(
            lambda: (logps, entropies), loss_type=loss_type, importance_level=level, beta=beta, epsilon_high=0.28,
            kl_bias_correction=bias_correction, max_completion_length=max_length,
        ))
        inputs = trl_grpo_inputs(target, mask, adv.double(), None if old is None else old.double(), ref.double())
        return grpo_trainer.GRPOTrainer._compute_loss(trainers[-1], None, inputs)

    kw = dict(loss_type=loss_type, importance_level=level, beta=beta, epsilon_high=0.28, temperature=0.8,
              kl_bias_correction=bias_correction, max_completion_length=max_length if loss_type == "dr_grpo" else None)
    compare_fwd_bwd(_ours(target, mask, old, adv, ref, **kw), trl_loss, (h, w, b), name=f"TRL {loss_type} {level}")
    with torch.no_grad():
        _, metrics = F.linear_policy_loss(h, w, target, old, adv, ref_log_probs=ref, mask=mask, bias=b, **kw)
    logged = trainers[0]._metrics["train"]
    for key in ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                "clip_ratio/low_min", "clip_ratio/high_max") + (("kl",) if beta else ()):
        assert_close(metrics[key], torch.tensor(logged[key][0], dtype=torch.float32), name=f"metric {key}")


# The variants of issue 42 against TRL's own _compute_loss on the same log-probs (the stand-in
# above). TRL forms the vLLM importance-sampling ratio in _generate_and_score_completions, which
# does not run standalone: trl_sampling_ratio writes it from that definition, and TRL's
# _compute_loss applies it.

VARIANTS = {
    "cispo": dict(loss_type="cispo", epsilon_high=1.3, beta=0.04),
    "cispo sequence": dict(loss_type="cispo", importance_level="sequence", epsilon_high=1.3),
    "sapo": dict(loss_type="sapo", beta=0.04, kl_bias_correction=True),
    # TRL picks SAPO's temperature by torch.where on Python floats, in fp32: 1.05 there is 1.05 to 8
    # digits, so the float64 comparison takes temperatures that fp32 holds exactly.
    "sapo sequence": dict(loss_type="sapo", importance_level="sequence", sapo_temperature_pos=0.75,
                          sapo_temperature_neg=1.5),
    "luspo": dict(loss_type="luspo", beta=0.02),
    "luspo token": dict(loss_type="luspo", importance_level="token"),
    "vespo": dict(loss_type="vespo", beta=0.04),
    "vespo gamma": dict(loss_type="vespo", vespo_gamma=(1.5, 2.5, 2.0, 1.0), kl_bias_correction=True, beta=0.04),
    "delta": dict(loss_type="dapo", delta=1.3, epsilon_high=0.28, beta=0.04),
    "delta luspo": dict(loss_type="luspo", importance_level="token", delta=1.3, beta=0.04),
    "delta inside the clip": dict(loss_type="bnpo", delta=1.1, epsilon_high=0.28),  # the cap binds for A > 0 too
    "token_truncate": dict(loss_type="grpo", beta=0.04, importance_sampling_mode="token_truncate"),
    "token_mask": dict(loss_type="dapo", importance_sampling_mode="token_mask", importance_sampling_clip_min=0.5),
    "sequence_truncate": dict(loss_type="bnpo", importance_sampling_mode="sequence_truncate",
                              importance_sampling_clip_min=0.6),
    "sequence_mask": dict(loss_type="cispo", epsilon_high=1.3, importance_sampling_mode="sequence_mask",
                          importance_sampling_clip_min=0.5),
    "sequence_mask gspo": dict(loss_type="gspo", beta=0.04, importance_sampling_mode="sequence_mask"),
    "token_mask sapo": dict(loss_type="sapo", importance_sampling_mode="token_mask", importance_sampling_clip_min=0.5),
    "token_truncate vespo": dict(loss_type="vespo", importance_sampling_mode="token_truncate",
                                 importance_sampling_clip_min=0.5),
    "token_mask vespo": dict(loss_type="vespo", importance_sampling_mode="token_mask",
                             importance_sampling_clip_max=2.0),
}


def _level(kw):
    return kw.get("importance_level") or ("sequence" if kw["loss_type"] in ("gspo", "luspo") else "token")


def _variant_inputs(kw, h, w, b, target, mask):
    """(old, ref or None, the sampler's log-probs or None): sampler log-probs off the old ones by
    enough that the weight's bounds bind, one of them NaN (vLLM gave none: TRL leaves it uncorrected)."""
    old, ref = _old_and_ref(h, w, b, target, mask, _level(kw))
    sampling = None
    if "importance_sampling_mode" in kw:
        # log(old / sampler) per token: beyond log 3 and below log 0.5 along every completion
        gaps = torch.tensor([-1.5, -0.3, 0.2, 1.4, 0.0, -0.8], device=old.device)
        position = torch.arange(B, device=old.device)[:, None] + torch.arange(T, device=old.device)
        sampling = old - gaps[position % 6] - 0.1 * torch.rand_like(old)
        sampling[0, 1] = float("nan")
    return old, ref if kw.get("beta") else None, sampling


def _trl_variant(kw, target, mask, adv, old, ref, sampling, trainers, logits_dtype=None):
    grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    mode = kw.get("importance_sampling_mode")

    def fn(h, w, b):
        logps, entropies = _log_probs(h, w, b, target, logits_dtype=logits_dtype)
        trainers.append(trl_grpo_trainer(
            lambda: (logps, entropies), loss_type="grpo" if kw["loss_type"] == "gspo" else kw["loss_type"],
            importance_level=_level(kw), beta=kw.get("beta", 0.0), epsilon_high=kw.get("epsilon_high", 0.2),
            kl_bias_correction=kw.get("kl_bias_correction", False), max_completion_length=T, delta=kw.get("delta"),
            sapo_temperatures=(kw.get("sapo_temperature_pos", 1.0), kw.get("sapo_temperature_neg", 1.05)),
            vespo_gamma=kw.get("vespo_gamma", (2.0, 3.0, 3.0, 2.0)), sampling_correction=mode is not None,
        ))
        ratio = None if mode is None else trl_sampling_ratio(
            old.double(), sampling.double(), mask, mode, kw.get("importance_sampling_clip_min"),
            kw.get("importance_sampling_clip_max", 3.0),
        )
        inputs = trl_grpo_inputs(target, mask, adv.double(), old.double(), None if ref is None else ref.double(), ratio)
        return grpo_trainer.GRPOTrainer._compute_loss(trainers[-1], None, inputs)

    return fn


def _ours_variant(kw, target, mask, adv, old, ref, sampling, budget=None):
    return _ours(target, mask, old, adv, ref, budget, sampling_log_probs=sampling, **kw)


@pytest.mark.parametrize(
    "name,dtype,vocab",
    [(name, torch.float32, 1031) for name in VARIANTS]
    + [(name, torch.float16, 257) for name in ("cispo", "sapo", "luspo", "vespo", "delta", "token_truncate",
                                               "sequence_mask")]
    + [(name, torch.float64, 257) for name in ("cispo sequence", "sapo sequence", "luspo", "vespo gamma", "delta luspo",
                                               "sequence_truncate", "token_mask vespo")],
)
def test_variants_match_trl_grpo_trainer(poison_outputs, device, name, dtype, vocab):
    # float64 runs the PyTorch reference (the fallback); fp32/fp16 the kernels.
    kw = VARIANTS[name]
    h, w, b, target, mask, adv = _inputs(dtype, device, vocab)
    old, ref, sampling = _variant_inputs(kw, h, w, b, target, mask)
    trainers = []
    # The oracle's logits are rounded to the inputs' dtype as the op's are: in fp16 that rounding
    # alone, through vespo's power of the ratio, moved the loss by up to 5.3e-3 (30 draws).
    compare_fwd_bwd(_ours_variant(kw, target, mask, adv, old, ref, sampling), _trl_variant(
        kw, target, mask, adv, old, ref, sampling, trainers, dtype), (h, w, b), name=f"TRL {name}")
    with torch.no_grad():
        _, metrics = F.linear_policy_loss(h, w, target, old, adv, ref_log_probs=ref, mask=mask, bias=b,
                                          sampling_log_probs=sampling, **kw)
    logged = trainers[0]._metrics["train"]
    assert set(metrics) == set(logged)
    for key in logged:
        value = metrics[key]
        # TRL averages its clip flags in fp32
        assert_close(value, torch.tensor(logged[key][0], dtype=value.dtype), max(dtype, torch.float32, key=REL_TOL.get),
                     name=f"metric {key}")


@pytest.mark.parametrize("name,bound", [
    ("cispo", "the cap"), ("delta", "the cap"), ("delta luspo", "the cap"), ("token_truncate", "the sampler's weight"),
    ("token_mask", "the sampler's weight"), ("sequence_truncate", "the sampler's weight"),
    ("sequence_mask", "the sampler's weight"), ("token_truncate vespo", "the sampler's weight"),
])
def test_variant_bounds_bind(device, name, bound):
    # The comparisons above prove something only where the cap or the weight's bounds change the
    # loss and its gradient: without them both differ.
    kw = dict(VARIANTS[name])
    h, w, b, target, mask, adv = _inputs(torch.float32, device)
    old, ref, sampling = _variant_inputs(kw, h, w, b, target, mask)
    loose = dict(kw)
    if bound == "the cap":
        loose.pop("delta", None)
        loose["epsilon_high"] = 1e6 if kw["loss_type"] == "cispo" else kw.get("epsilon_high", 0.2)
    else:
        loose.update(importance_sampling_mode=kw["importance_sampling_mode"].split("_")[0] + "_truncate",
                     importance_sampling_clip_min=None, importance_sampling_clip_max=None)
    grads = []
    for options in (kw, loose):
        h.grad = None
        F.linear_policy_loss(h, w, target, old, adv, ref_log_probs=ref, mask=mask, bias=b, sampling_log_probs=sampling,
                             **options)[0].backward()
        grads.append(h.grad.clone())
    assert not torch.allclose(*grads, rtol=1e-3), f"{bound} of {name} changes no gradient"


@pytest.mark.parametrize("name,plan", [
    ("vespo", "one completion per chunk"), ("vespo", "two passes"), ("vespo gamma", "two passes, frozen head"),
    ("sequence_mask", "two completions per chunk"), ("sequence_truncate", "two passes"),
    ("sequence_mask gspo", "two passes, frozen head"), ("token_mask", "token chunks of 4 rows"),
    ("luspo", "two passes"), ("cispo sequence", "frozen head"),
])
def test_variant_chunking_plans(poison_outputs, device, name, plan):
    # VESPO's weight and a per-completion sampler weight need whole completions, as a
    # sequence-level ratio does: chunks of whole completions, or two passes.
    kw = VARIANTS[name]
    h, w, b, target, mask, adv = _inputs(torch.float32, device)
    old, ref, sampling = _variant_inputs(kw, h, w, b, target, mask)
    rows = {"token chunks of 4 rows": 4, "one completion per chunk": T, "two completions per chunk": 2 * T}
    budget = rows.get(plan, T - 1) * 257 * 4
    if "frozen" in plan:
        w.requires_grad_(False)
        b.requires_grad_(False)
    compare_fwd_bwd(_ours_variant(kw, target, mask, adv, old, ref, sampling, budget),
                    _trl_variant(kw, target, mask, adv, old, ref, sampling, []), (h, w, b), name=plan)


def test_sampling_weight_on_policy_compares_the_sampler_with_the_policy(poison_outputs, device):
    # Without old_log_probs the sampler's weight is exp(logp - sampler), logp detached: as if the
    # trainer's own log-probs had been passed as the old ones.
    h, w, b, target, mask, adv = _inputs(torch.float32, device)
    with torch.no_grad():
        own, _ = _log_probs(h, w, b, target)
    sampling = own.float() - 0.6 * torch.randn(B, T, device=device)
    kw = dict(loss_type="grpo", importance_sampling_mode="sequence_truncate", importance_sampling_clip_min=0.5)
    compare_fwd_bwd(_ours_variant(kw, target, mask, adv, None, None, sampling),
                    _ours_variant(kw, target, mask, adv, own, None, sampling), (h, w, b), name="on-policy sampler")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(loss_type="ppo"), "loss_type must be one of"),
        (dict(importance_level="group"), "importance_level must be one of"),
        (dict(loss_type="gspo", importance_level="token"), "importance_level must be 'sequence'"),
        (dict(beta=0.1), "ref_log_probs must be given"),
        (dict(beta=-0.1), "beta must be a non-negative float"),
        (dict(epsilon=-0.2), "epsilon must be a non-negative float"),
        (dict(epsilon_high="0.3"), "epsilon_high must be a non-negative float"),
        (dict(temperature=0.0), "temperature must be a positive float"),
        (dict(max_completion_length=8), "max_completion_length is Dr. GRPO's divisor"),
        (dict(loss_type="dr_grpo", max_completion_length=0), "max_completion_length must be a positive int"),
        (dict(num_items_in_batch=10), "num_items_in_batch is the divisor of DAPO, CISPO and VESPO"),
        (dict(loss_type="dapo", num_items_in_batch=[3]), "num_items_in_batch must be"),
        (dict(kl_bias_correction=1), "kl_bias_correction must be a bool"),
        (dict(max_chunk_bytes=0), "max_chunk_bytes must be a positive int"),
        (dict(adv=torch.zeros(3)), r"advantages must have shape \(4,\)"),
        (dict(old=torch.zeros(4, 2)), r"old_log_probs must have shape \(4, 3\)"),
        (dict(ref_log_probs=torch.zeros(4, 3, dtype=torch.long)), "ref_log_probs must be a floating-point tensor"),
        (dict(mask=torch.ones(4, 2)), r"mask must be a tensor of shape \(4, 3\)"),
        (dict(loss_type="sapo", delta=1.5), "delta caps the ratio of the clipped losses"),
        (dict(delta=1.0), "delta must be a float > 1"),
        (dict(loss_type="sapo", sapo_temperature_neg=0.0), "sapo_temperature_neg must be a positive float"),
        (dict(loss_type="vespo", vespo_gamma=(2.0, 0.0, 3.0, 2.0)), "vespo's lambda_pos must be a positive float"),
        (dict(vespo_gamma=(-1.0, 3.0, 3.0, 2.0)), "vespo's k_pos must be a non-negative float"),
        (dict(vespo_gamma=(1.0, 3.0)), "vespo_gamma must be"),
        (dict(importance_sampling_mode="token"), "importance_sampling_mode must be one of"),
        (dict(loss_type="vespo", sampling_log_probs=torch.zeros(4, 3)), "VESPO folds the sampler's"),
        (dict(importance_sampling_clip_min=-1.0), "importance_sampling_clip_min must be a non-negative float"),
        (dict(importance_sampling_clip_min=4.0), r"importance_sampling_clip_min \(4.0\) must not exceed"),
        (dict(sampling_log_probs=torch.zeros(4, 2)), r"sampling_log_probs must have shape \(4, 3\)"),
        (dict(loss_type="luspo", num_items_in_batch=10), "num_items_in_batch is the divisor"),
        (dict(h=torch.randn(12, 8), t=torch.zeros(12, dtype=torch.long)), r"hidden must have shape \(completions"),
        (dict(h=torch.randn(0, 3, 8), t=torch.zeros(0, 3, dtype=torch.long), adv=torch.zeros(0)), "at least one completion"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    args = dict(h=torch.randn(4, 3, 8), w=torch.randn(10, 8), t=torch.zeros(4, 3, dtype=torch.long), old=None,
                adv=torch.zeros(4))
    args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args})
    with pytest.raises(ValueError, match=match):
        F.linear_policy_loss(args["h"], args["w"], args["t"], args["old"], args["adv"], **kwargs)


def _gpu_inputs(n_seq, seq_len, hidden, vocab, bias=False, trainable=True):
    device = torch.device("cuda")
    h = torch.randn(n_seq, seq_len, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=device) * hidden**-0.5).to(torch.bfloat16).requires_grad_(trainable)
    b = (0.1 * torch.randn(vocab, device=device)).to(torch.bfloat16).requires_grad_(trainable) if bias else None
    target = torch.randint(0, vocab, (n_seq, seq_len), device=device)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (n_seq, 1), device=device)
    mask = torch.arange(seq_len, device=device) < lengths
    adv = torch.randn(n_seq, device=device)
    return h, w, b, target, mask, adv


@pytest.mark.gpu
@pytest.mark.parametrize("loss_type,frozen,budget", [("grpo", False, None), ("dapo", True, None),
                                                     ("gspo", False, None), ("gspo", False, 300 * 32064 * 2)])
def test_bf16_on_gpu(loss_type, frozen, budget):
    h, w, b, target, mask, adv = _gpu_inputs(8, 500, 1024, 32064, bias=True, trainable=not frozen)
    level = "sequence" if loss_type == "gspo" else "token"
    with torch.no_grad():
        logp, _ = _log_probs(h.bfloat16(), w.bfloat16(), b.bfloat16(), target)
    old = (logp - 0.3 * torch.randn_like(logp)).float()
    ref = (logp + 0.2 * torch.randn_like(logp)).float()
    beta = 0.0 if loss_type == "gspo" else 0.04
    paper = _paper_loss(target, mask, old, adv, ref, loss_type=loss_type, beta=beta, max_completion_length=500)
    compare_fwd_bwd(
        _ours(target, mask, old, adv, ref if beta else None, budget, loss_type=loss_type, beta=beta,
              importance_level=level),
        lambda h, w, b: paper(h.bfloat16(), w.bfloat16(), b.bfloat16()),
        (h, w, b), torch.bfloat16, name=f"bf16 {loss_type} frozen={frozen} budget={budget}",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("frozen", [False, True])
def test_peak_memory_on_gpu(frozen):
    # The issue-26 shape: 8 prompts x 8 completions x 1024 tokens, H 2048, V 128256: the logits
    # chunk (224 MiB) and per-token scalars beyond the gradients.
    h, w, _, target, mask, adv = _gpu_inputs(64, 1024, 2048, 128256, trainable=not frozen)
    old = torch.full(target.shape, -11.0, device="cuda")

    def step():
        loss, _ = F.linear_policy_loss(h, w, target, old, adv, mask=mask, loss_type="dapo")
        loss.backward()

    extra = peak_bytes_beyond_grads(step, (h, w))
    assert extra <= 256 * 2**20, f"{extra / 2**20:.0f} MiB beyond the gradients"


@pytest.mark.gpu
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_no_host_sync_on_gpu(level):
    h, w, b, target, mask, adv = _gpu_inputs(8, 500, 1024, 32064, bias=True)
    old = torch.full(target.shape, -10.0, device="cuda")
    ref = torch.full(target.shape, -10.5, device="cuda")
    kw = dict(ref_log_probs=ref, beta=0.04, mask=mask, bias=b, importance_level=level)
    run_without_host_sync(lambda: (F.linear_policy_loss(h, w, target, old, adv, **kw)[0] * 0.5).backward())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cispo", "sapo", "luspo", "vespo gamma", "delta", "token_truncate", "sequence_mask",
                                  "token_mask vespo"])
@pytest.mark.parametrize("frozen", [False, True])
def test_variants_bf16_on_gpu(name, frozen):
    # Against TRL's _compute_loss on the bf16 logits (float64 from there on).
    kw = VARIANTS[name]
    h, w, b, target, mask, adv = _gpu_inputs(8, 500, 1024, 32064, bias=True, trainable=not frozen)
    with torch.no_grad():
        logp, _ = _log_probs(h, w, b, target)
    old = (logp - 0.3 * torch.randn_like(logp)).float()
    ref = (logp + 0.2 * torch.randn_like(logp)).float() if kw.get("beta") else None
    sampling = (old - 0.6 * torch.randn_like(old)) if "importance_sampling_mode" in kw else None
    trl = _trl_variant(kw, target, mask, adv, old, ref, sampling, [])
    compare_fwd_bwd(_ours_variant(kw, target, mask, adv, old, ref, sampling),
                    lambda h, w, b: trl(h.bfloat16(), w.bfloat16(), b.bfloat16()), (h, w, b), torch.bfloat16,
                    name=f"bf16 {name} frozen={frozen}")


@pytest.mark.gpu
@pytest.mark.parametrize("kw,on_policy", [
    (dict(loss_type="vespo", importance_sampling_mode="token_mask"), False),
    (dict(loss_type="dapo", delta=1.3, importance_sampling_mode="sequence_truncate"), True),
    (dict(loss_type="cispo", epsilon_high=5.0), False), (dict(loss_type="sapo"), False), (dict(loss_type="luspo"), False),
])
def test_variants_no_host_sync_on_gpu(kw, on_policy):
    h, w, b, target, mask, adv = _gpu_inputs(8, 500, 1024, 32064, bias=True)
    old = torch.full(target.shape, -10.0, device="cuda")
    sampling = old - 0.2 * torch.randn_like(old) if "importance_sampling_mode" in kw else None
    run_without_host_sync(lambda: (F.linear_policy_loss(
        h, w, target, None if on_policy else old, adv, mask=mask, bias=b, sampling_log_probs=sampling, **kw,
    )[0] * 0.5).backward())
