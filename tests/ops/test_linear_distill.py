"""linear_distill_loss against each divergence as its paper writes it (float64, from materialised
logits), against TRL's GKD generalized_jsd_loss and its chunked distillation loss, over chunk
budgets, a frozen student head, and student/teacher heads of different widths and dtypes."""

import pytest
import torch
import torch.nn.functional as TF

import tigon.functional as F
from tests.helpers import assert_close, compare_fwd_bwd, count_gemms, peak_bytes_beyond_grads, run_without_host_sync

IGNORE = -100
LEAD, HS, HT = (3, 5), 13, 21  # 15 tokens; the teacher is wider than the student

CASES = {
    "forward_kl": dict(loss="forward_kl"),
    "reverse_kl": dict(loss="reverse_kl", temperature=0.7, hard_weight=0.3),
    "jsd": dict(loss="jsd", beta=0.3, temperature=1.5, hard_weight=0.5),
    "jsd-default": dict(loss="jsd"),
    "jsd-beta0": dict(loss="jsd", beta=0.0, temperature=0.8),
    "jsd-beta1": dict(loss="jsd", beta=1.0),
    "tvd": dict(loss="tvd", temperature=1.2, hard_weight=0.2),
}


def _inputs(dtype, device, vocab=257, bias=True, teacher_dtype=None):
    teacher_dtype = teacher_dtype or dtype
    hs = torch.randn(*LEAD, HS, device=device).to(dtype).requires_grad_()
    ws = (torch.randn(vocab, HS, device=device) * 2 * HS**-0.5).to(dtype).requires_grad_()
    bs = (0.5 * torch.randn(vocab, device=device)).to(dtype).requires_grad_() if bias else None
    ht = torch.randn(*LEAD, HT, device=device).to(teacher_dtype)
    wt = (torch.randn(vocab, HT, device=device) * 2 * HT**-0.5).to(teacher_dtype)
    bt = (0.5 * torch.randn(vocab, device=device)).to(teacher_dtype) if bias else None
    target = torch.randint(0, vocab, LEAD, device=device)
    target[0, :2] = IGNORE
    target[2, 3] = IGNORE
    return hs, ws, bs, ht, wt, bt, target


def _paper_loss(target, teacher, loss="jsd", beta=0.5, temperature=1.0, hard_weight=0.0):
    """Each divergence from its definition, in float64, mixed with the cross-entropy. The teacher's
    logits are rounded to its dtype as F.linear (and so the op) rounds them."""
    ht, wt, bt = teacher

    def fn(hs, ws, bs=None):
        logits = TF.linear(hs, ws, bs).double()
        p = torch.softmax(logits / temperature, -1)
        with torch.no_grad():
            q = torch.softmax(TF.linear(ht, wt, bt).double() / temperature, -1)
        if loss == "forward_kl" or (loss == "jsd" and beta == 0):
            divergence = (q * torch.log(q / p)).sum(-1)
        elif loss == "reverse_kl" or (loss == "jsd" and beta == 1):
            divergence = (p * torch.log(p / q)).sum(-1)
        elif loss == "jsd":
            # Agarwal et al. 2024, eq. 1 with P the teacher, Q the student
            m = beta * q + (1 - beta) * p
            divergence = beta * (q * torch.log(q / m)).sum(-1) + (1 - beta) * (p * torch.log(p / m)).sum(-1)
        else:  # total variation distance
            divergence = 0.5 * (p - q).abs().sum(-1)
        if target is None:
            return divergence.mean()
        valid = target != IGNORE
        nll = -torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (1 - hard_weight) * divergence[valid].mean() + hard_weight * nll[valid].mean()

    return fn


def _ours(target, teacher, budget=None, **kw):
    ht, wt, bt = teacher

    def fn(hs, ws, bs=None):
        return F.linear_distill_loss(hs, ws, ht, wt, target, student_bias=bs, teacher_bias=bt, max_chunk_bytes=budget,
                                     **kw)[0]

    return fn


def _paper_kw(kw):
    return {"beta": 0.5, **kw}


@pytest.mark.parametrize(
    "name,dtype,vocab,rows",
    [(name, torch.float32, 1031, None) for name in CASES]
    + [(name, torch.float16, 257, 4) for name in ("forward_kl", "jsd", "tvd")]
    + [("reverse_kl", torch.float32, 257, 4), ("jsd", torch.float32, 257, 1)],
)
def test_matches_paper_formula(poison_outputs, device, name, dtype, vocab, rows):
    hs, ws, bs, ht, wt, bt, target = _inputs(dtype, device, vocab)
    budget = None if rows is None else rows * vocab * 2 * dtype.itemsize  # both chunks: 4 chunks of 4 rows, or 15 of 1
    kw = CASES[name]
    out = compare_fwd_bwd(_ours(target, (ht, wt, bt), budget, **kw), _paper_loss(target, (ht, wt, bt), **_paper_kw(kw)),
                          (hs, ws, bs), name=name)
    assert out[0].dtype == torch.float32


@pytest.mark.parametrize("name", ["forward_kl", "jsd", "tvd"])
def test_reference_path_matches_paper_formula(device, name):
    # float64 runs the PyTorch reference, the op's fallback
    hs, ws, bs, ht, wt, bt, target = _inputs(torch.float64, device)
    kw = CASES[name]
    compare_fwd_bwd(_ours(target, (ht, wt, bt), **kw), _paper_loss(target, (ht, wt, bt), **_paper_kw(kw)),
                    (hs, ws, bs), name=f"reference {name}")


def test_without_target_every_token_counts(poison_outputs, device):
    hs, ws, bs, ht, wt, bt, _ = _inputs(torch.float32, device)
    compare_fwd_bwd(_ours(None, (ht, wt, bt), loss="jsd", beta=0.2), _paper_loss(None, (ht, wt, bt), beta=0.2),
                    (hs, ws, bs), name="no target")


def test_fp16_student_fp32_teacher(poison_outputs, device):
    hs, ws, bs, ht, wt, bt, target = _inputs(torch.float16, device, teacher_dtype=torch.float32)
    compare_fwd_bwd(_ours(target, (ht, wt, bt), 4 * 257 * 6, loss="reverse_kl"),
                    _paper_loss(target, (ht, wt, bt), loss="reverse_kl"), (hs, ws, bs), name="mixed dtypes")


def test_metrics(poison_outputs, device):
    hs, ws, bs, ht, wt, bt, target = _inputs(torch.float32, device)
    kw = dict(loss="jsd", beta=0.3, temperature=1.5, hard_weight=0.4)
    loss, metrics = F.linear_distill_loss(hs, ws, ht, wt, target, student_bias=bs, teacher_bias=bt, **kw)
    detached = [t.detach() for t in (hs, ws, bs)]
    divergence = _paper_loss(target, (ht, wt, bt), **{**kw, "hard_weight": 0.0})(*detached)
    nll = _paper_loss(target, (ht, wt, bt), **{**kw, "hard_weight": 1.0})(*detached)
    assert set(metrics) == {"divergence", "cross_entropy"}
    assert all(not m.requires_grad and m.shape == () for m in metrics.values())
    assert_close(metrics["divergence"], divergence.float(), name="divergence")
    assert_close(metrics["cross_entropy"], nll.float(), name="cross_entropy")
    assert_close(loss.detach(), (0.6 * divergence + 0.4 * nll).float(), name="loss")


@pytest.mark.parametrize("frozen", [False, True])
def test_gemms_per_chunk(poison_outputs, device, monkeypatch, frozen):
    # Per chunk: the teacher's logits, the student's, dH and (trainable head) dW; no recompute.
    hs, ws, _, ht, wt, _, target = _inputs(torch.float32, device, bias=False)
    ws.requires_grad_(not frozen)
    shapes = count_gemms(monkeypatch)
    loss, _ = F.linear_distill_loss(hs, ws, ht, wt, target, max_chunk_bytes=5 * 257 * 8)
    loss.backward()
    assert len(shapes) == (3 if frozen else 4) * 3
    assert (tuple(ws.shape) in shapes) != frozen
    assert shapes.count((5, HS)) == 3  # dH into its rows, 5 at a time


def test_no_grad_runs_the_logits_gemms_only(device, monkeypatch):
    hs, ws, _, ht, wt, _, target = _inputs(torch.float32, device, bias=False)
    shapes = count_gemms(monkeypatch)
    with torch.no_grad():
        loss, _ = F.linear_distill_loss(hs, ws, ht, wt, target, max_chunk_bytes=5 * 257 * 8)
    assert len(shapes) == 2 * 3
    assert_close(loss, _paper_loss(target, (ht, wt, None))(hs, ws).float(), name="loss")


def test_teacher_gets_no_gradient(poison_outputs, device):
    hs, ws, bs, ht, wt, bt, target = _inputs(torch.float32, device)
    for t in (ht, wt, bt):
        t.requires_grad_()
    F.linear_distill_loss(hs, ws, ht, wt, target, student_bias=bs, teacher_bias=bt)[0].backward()
    assert all(t.grad is None for t in (ht, wt, bt))
    assert all(t.grad is not None for t in (hs, ws, bs))


def test_all_ignored_gives_zero(poison_outputs, device):
    hs, ws, bs, ht, wt, bt, target = _inputs(torch.float32, device)
    loss, metrics = F.linear_distill_loss(hs, ws, ht, wt, torch.full_like(target, IGNORE), hard_weight=0.5,
                                          student_bias=bs, teacher_bias=bt)
    loss.backward()
    assert loss.item() == 0.0 and metrics["divergence"].item() == 0.0
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in (hs, ws, bs))


@pytest.mark.parametrize("model", ["student", "teacher"])
@pytest.mark.parametrize("loss", ["forward_kl", "jsd"])
def test_nan_hidden_gives_nan_loss(poison_outputs, device, model, loss):
    hs, ws, bs, ht, wt, bt, target = _inputs(torch.float32, device)
    with torch.no_grad():
        (hs if model == "student" else ht)[1, 2, 4] = float("nan")  # a scored token
    out, metrics = F.linear_distill_loss(hs, ws, ht, wt, target, loss=loss, student_bias=bs, teacher_bias=bt)
    out.backward()
    assert torch.isnan(out) and torch.isnan(metrics["divergence"])
    assert torch.isnan(hs.grad[1, 2]).all() and torch.isnan(ws.grad).any()


def test_second_backward_and_upstream_scale(poison_outputs, device):
    hs, ws, bs, ht, wt, bt, target = _inputs(torch.float32, device)
    kw = dict(loss="tvd", hard_weight=0.2)
    loss, _ = F.linear_distill_loss(hs, ws, ht, wt, target, student_bias=bs, teacher_bias=bt, **kw)
    (loss * 0.5).backward(retain_graph=True)
    first = [t.grad.clone() for t in (hs, ws, bs)]
    (loss * 2.0).backward()
    refs = [t.detach().double().requires_grad_() for t in (hs, ws, bs)]
    _paper_loss(target, (ht, wt, bt), **kw)(*refs).backward()
    for name, t, once, ref in zip("hwb", (hs, ws, bs), first, refs):
        assert_close(once, 0.5 * ref.grad.float(), name=f"grad {name}")
        assert_close(t.grad, 2.5 * ref.grad.float(), name=f"accumulated grad {name}")


def test_num_items_in_batch_divides_the_sums(poison_outputs, device):
    hs, ws, bs, ht, wt, bt, target = _inputs(torch.float32, device)
    tokens = (target != IGNORE).sum().item()
    compare_fwd_bwd(_ours(target, (ht, wt, bt), hard_weight=0.5, num_items_in_batch=torch.tensor(4.0 * tokens)),
                    lambda *a: _paper_loss(target, (ht, wt, bt), hard_weight=0.5)(*a) / 4, (hs, ws, bs),
                    name="num_items_in_batch")


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_matches_trl_generalized_jsd_loss(poison_outputs, device, beta):
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    hs, ws, bs, ht, wt, bt, target = _inputs(torch.float32, device)

    def trl_loss(hs, ws, bs):
        return gkd.GKDTrainer.generalized_jsd_loss(
            TF.linear(hs, ws, bs), TF.linear(ht, wt, bt).double(), labels=target, beta=beta, temperature=0.9
        )

    compare_fwd_bwd(_ours(target, (ht, wt, bt), loss="jsd", beta=beta, temperature=0.9), trl_loss, (hs, ws, bs),
                    name=f"TRL generalized_jsd_loss beta={beta}")


@pytest.mark.parametrize("beta", [0.0, 0.6, 1.0])
def test_matches_trl_chunked_divergence_loss(poison_outputs, device, beta):
    # TRL 1.16's DistillationTrainer loss (its own chunked kernel, run here by its torch fallback).
    distillation = pytest.importorskip("trl.trainer.distillation_trainer")
    hs, ws, bs, ht, wt, bt, target = _inputs(torch.float32, device)
    mask = (target != IGNORE).long()

    def trl_loss(hs, ws, bs):
        return distillation._chunked_divergence_loss(
            hs.float(), ht, ws.float(), wt, mask, beta, student_lm_head_bias=bs.float(), teacher_lm_head_bias=bt,
            temperature=1.3,
        )[0]

    compare_fwd_bwd(_ours(target, (ht, wt, bt), loss="jsd", beta=beta, temperature=1.3), trl_loss, (hs, ws, bs),
                    name=f"TRL chunked divergence beta={beta}")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(loss="kl"), "loss must be one of"),
        (dict(loss="tvd", beta=0.5), "beta is the JSD's interpolation"),
        (dict(beta=1.5), r"beta must be a float in \[0, 1\]"),
        (dict(temperature=-1.0), "temperature must be a positive float"),
        (dict(hard_weight=0.5), "target must be given"),
        (dict(t=torch.zeros(4, dtype=torch.long), hard_weight=2.0), r"hard_weight must be a float in \[0, 1\]"),
        (dict(t=torch.zeros(3, dtype=torch.long)), r"target must have shape \(4,\)"),
        (dict(ht=torch.randn(3, 12)), "teacher_hidden must hold the tokens of student_hidden"),
        (dict(wt=torch.randn(11, 12)), r"teacher_weight must have the student's vocabulary \(10\)"),
        (dict(wt=torch.randn(10, 8)), r"teacher_weight must have shape \(vocab, 12\)"),
        (dict(ws=torch.randn(10, 8).half()), "student_weight must have the dtype of student_hidden"),
        (dict(num_items_in_batch=0), "num_items_in_batch must be a positive number"),
        (dict(max_chunk_bytes=-1), "max_chunk_bytes must be a positive int"),
        (dict(t=torch.zeros(4, dtype=torch.long), ignore_index=None), "ignore_index must be an int"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    args = dict(hs=torch.randn(4, 8), ws=torch.randn(10, 8), ht=torch.randn(4, 12), wt=torch.randn(10, 12), t=None)
    args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args})
    with pytest.raises(ValueError, match=match):
        F.linear_distill_loss(args["hs"], args["ws"], args["ht"], args["wt"], args["t"], **kwargs)


def _gpu_inputs(tokens, student, teacher, vocab, trainable=True):
    device = torch.device("cuda")
    hs = torch.randn(tokens, student, device=device, dtype=torch.bfloat16, requires_grad=True)
    ws = (torch.randn(vocab, student, device=device) * student**-0.5).to(torch.bfloat16).requires_grad_(trainable)
    ht = torch.randn(tokens, teacher, device=device, dtype=torch.bfloat16)
    wt = (torch.randn(vocab, teacher, device=device) * teacher**-0.5).to(torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), device=device)
    target[: tokens // 4] = IGNORE
    return hs, ws, ht, wt, target


@pytest.mark.gpu
@pytest.mark.parametrize("loss,frozen", [("jsd", False), ("forward_kl", True), ("reverse_kl", False), ("tvd", False)])
def test_bf16_on_gpu(loss, frozen):
    hs, ws, ht, wt, target = _gpu_inputs(3000, 1024, 1536, 32064, trainable=not frozen)
    kw = dict(loss=loss, temperature=1.1, hard_weight=0.25)
    paper = _paper_loss(target, (ht, wt, None), **_paper_kw(kw))
    # The oracle's student logits are rounded to bf16 as F.linear (and so the op) rounds them.
    compare_fwd_bwd(_ours(target, (ht, wt, None), **kw), lambda hs, ws: paper(hs.bfloat16(), ws.bfloat16()),
                    (hs, ws), torch.bfloat16, name=f"bf16 {loss} frozen={frozen}")


@pytest.mark.gpu
def test_peak_memory_on_gpu():
    # The issue-26 target: student 8192 x 2048, teacher 8192 x 4096, V 128256: at most 256 MiB
    # beyond the gradients.
    hs, ws, ht, wt, target = _gpu_inputs(8192, 2048, 4096, 128256)

    def step():
        loss, _ = F.linear_distill_loss(hs, ws, ht, wt, target)
        loss.backward()

    extra = peak_bytes_beyond_grads(step, (hs, ws))
    assert extra <= 256 * 2**20, f"{extra / 2**20:.0f} MiB beyond the gradients"


@pytest.mark.gpu
def test_no_host_sync_on_gpu():
    hs, ws, ht, wt, target = _gpu_inputs(3000, 1024, 1536, 32064)
    run_without_host_sync(lambda: (F.linear_distill_loss(hs, ws, ht, wt, target, hard_weight=0.5)[0] * 0.5).backward())
