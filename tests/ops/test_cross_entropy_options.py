"""cross_entropy's class weights, z-loss output, argmax/accuracy and token scaling, against torch."""

import functools

import pytest
import torch
import torch.nn.functional as TF

import tigon.functional as F
from tigon.ops.cross_entropy import LossOutput, cross_entropy_reference
from tests.helpers import assert_close, compare_fwd_bwd
from tests.ops.test_cross_entropy import _inputs

IGNORE = -100


def _class_weight(vocab, device):
    return torch.rand(vocab, device=device) + 0.1


@pytest.mark.parametrize(
    "dtype,reduction,label_smoothing",
    [(torch.float32, "mean", 0.0), (torch.float32, "none", 0.15), (torch.float16, "sum", 0.15),
     (torch.float16, "mean", 0.15), (torch.float32, "sum", 0.0), (torch.float16, "none", 0.0)],
)
def test_class_weight_matches_torch(poison_outputs, device, dtype, reduction, label_smoothing):
    vocab = 1000 if dtype == torch.float16 else 2053  # 2053: two blocks of the row
    logits, target = _inputs((2, 5), vocab, dtype, device)
    weight = _class_weight(vocab, device)

    def torch_loss(x):
        out = TF.cross_entropy(
            x.reshape(-1, vocab), target.reshape(-1), weight=weight.to(x.dtype), reduction=reduction,
            label_smoothing=label_smoothing,
        )
        return out.view(target.shape) if reduction == "none" else out

    compare_fwd_bwd(
        lambda x: F.cross_entropy(x, target, weight=weight, reduction=reduction, label_smoothing=label_smoothing),
        torch_loss, (logits,), name=f"weight {reduction} eps={label_smoothing}",
    )


def _torch_with_z_loss(target, weight, eps, z, cap, reduction):
    """torch's own weighted, smoothed cross-entropy of the softcapped logits, plus the z-loss as
    Liger computes it: not weighted, a "mean" over the count of rows whose target is not ignored."""

    def fn(x):
        capped = cap * torch.tanh(x / cap)
        ce = TF.cross_entropy(capped, target, weight=weight.to(x.dtype), label_smoothing=eps, reduction=reduction,
                              ignore_index=IGNORE)
        valid = target != IGNORE
        z_rows = z * torch.logsumexp(capped, -1) ** 2 * valid
        if reduction == "none":
            return ce + z_rows
        return ce + (z_rows.sum() / valid.sum() if reduction == "mean" else z_rows.sum())

    return fn


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_weight_smoothing_z_loss_softcap_match_torch(poison_outputs, device, reduction):
    # Everything torch defines (smoothing under class weights, the weighted mean's divisor) is
    # torch's; the z-loss is Liger's. A z-loss weighted by the class weight misses by ~1e-2.
    logits, target = _inputs((3, 7), 2053, torch.float32, device, scale=4.0)
    weight = _class_weight(2053, device)
    options = dict(weight=weight, label_smoothing=0.1, z_loss_scale=1e-2, softcap=30.0, reduction=reduction)
    torch_loss = _torch_with_z_loss(target.view(-1), weight, 0.1, 1e-2, 30.0, reduction)

    def flat(x):
        out = torch_loss(x.reshape(-1, 2053))
        return out.view(target.shape) if reduction == "none" else out

    compare_fwd_bwd(lambda x: F.cross_entropy(x, target, **options), flat, (logits,), name=f"kernel {reduction}")
    reference = functools.partial(cross_entropy_reference, target=target, ignore_index=IGNORE, reduction=reduction,
                                  label_smoothing=0.1, z_loss_scale=1e-2, softcap=30.0, weight=weight)
    compare_fwd_bwd(lambda x: reference(x), flat, (logits,), name=f"reference {reduction}")


def test_reference_with_weight_and_z_loss_matches_formula():
    x, target = _inputs((9,), 300, torch.float64, "cpu")
    w = _class_weight(300, "cpu").double()
    eps, z, cap = 0.1, 1e-2, 4.0
    capped = cap * torch.tanh(x / cap)
    logp = capped.log_softmax(-1)
    valid = target != IGNORE
    t = target.clamp_min(0)
    lse = torch.logsumexp(capped, -1)
    per_row = (1 - eps) * w[t] * -logp.gather(1, t[:, None])[:, 0] - eps / 300 * (w * logp).sum(-1)
    p = logp.gather(1, t[:, None])[:, 0].exp()
    want = (per_row * p * valid).sum() / (w[t] * valid).sum() + (z * lse**2 * p * valid).sum() / valid.sum()
    got = cross_entropy_reference(x, target, IGNORE, "mean", eps, z, cap, w, True)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "options",
    [dict(reduction="mean"), dict(reduction="none", label_smoothing=0.1, softcap=5.0), dict(reduction="sum", weight=True)],
    ids=["mean", "none-smooth-softcap", "sum-weight"],
)
def test_token_scaling(poison_outputs, device, dtype, options):
    logits, target = _inputs((11,), 1000, dtype, device, scale=3.0)
    options = dict(options, z_loss_scale=1e-3)
    if options.pop("weight", False):
        options["weight"] = _class_weight(1000, device)

    def by_torch(x):
        # The scale is softmax(x')[t], detached: the loss of every row times a constant.
        rows = cross_entropy_reference(x, target, IGNORE, "none", options.get("label_smoothing", 0.0), 1e-3,
                                       options.get("softcap"), options.get("weight"))
        capped = x if options.get("softcap") is None else options["softcap"] * torch.tanh(x / options["softcap"])
        p = capped.softmax(-1).gather(1, target.clamp_min(0)[:, None])[:, 0].detach()
        rows = rows * p
        if options["reduction"] == "none":
            return rows
        return rows.sum() / ((target != IGNORE).sum() if options["reduction"] == "mean" else 1)

    compare_fwd_bwd(lambda x: F.cross_entropy(x, target, token_scaling=True, **options), by_torch, (logits,),
                    name=f"token scaling {options}")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_return_z_loss(poison_outputs, device, reduction, weighted):
    logits, target = _inputs((3, 4), 2053, torch.float32, device, scale=4.0)
    weight = _class_weight(2053, device) if weighted else None
    out = F.cross_entropy(logits, target, z_loss_scale=1e-2, reduction=reduction, weight=weight, return_z_loss=True)
    assert isinstance(out, LossOutput) and out.argmax is None and out.accuracy is None
    loss, z_loss = out.loss, out.z_loss
    without = F.cross_entropy(logits, target, reduction=reduction, weight=weight)
    x64 = logits.detach().double()
    # Not weighted by the class weight, and a mean over the rows' count, with weights too.
    rows = 1e-2 * torch.logsumexp(x64, -1) ** 2 * (target != IGNORE)
    want = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / (target != IGNORE).sum()}
    assert_close(z_loss, want[reduction].float(), name="z_loss")
    assert not z_loss.requires_grad
    assert_close(loss, (without + z_loss).detach(), name="loss includes z_loss")
    loss.sum().backward()  # the loss keeps its gradient
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize(
    "dtype,vocab,softcap", [(torch.float32, 1000, None), (torch.float16, 8197, None), (torch.float16, 1000, 3.0)]
)
def test_argmax_and_accuracy(poison_outputs, device, dtype, vocab, softcap):
    logits, target = _inputs((13,), vocab, dtype, device)
    x = logits.detach()
    torch_argmax = x.float().argmax(-1)
    target[:4] = torch_argmax[:4]  # some hits, whatever the draw
    target[4] = IGNORE
    out = F.cross_entropy(logits, target, softcap=softcap, return_argmax=True, return_z_loss=False)
    assert out.z_loss is None and out.argmax.dtype == torch.int64 and out.argmax.shape == target.shape
    valid = target != IGNORE
    want = torch.where(valid, torch_argmax, -1)
    if softcap is None:
        assert torch.equal(out.argmax, want)
    else:  # the softcap may tie values that differ in the last bit; the value picked is the max
        capped = softcap * torch.tanh(x.float() / softcap)
        picked = capped.gather(1, out.argmax.clamp_min(0)[:, None])[:, 0]
        assert torch.allclose(picked[valid], capped.max(-1).values[valid], atol=1e-6)
        assert (out.argmax[~valid] == -1).all()
    accuracy = ((torch_argmax == target) & valid).sum() / valid.sum()
    assert_close(out.accuracy, accuracy.float(), name="accuracy")
    assert_close(out.loss, F.cross_entropy(logits, target, softcap=softcap).detach(), name="loss unchanged")
    out.loss.backward()
    ref = logits.detach().clone().requires_grad_()
    cross_entropy_reference(ref, target, softcap=softcap).backward()
    assert_close(logits.grad, ref.grad, name="grad")


def test_argmax_of_nan_inf_and_ignored_rows(poison_outputs, device):
    logits = torch.randn(6, 1000, device=device)
    logits[0, 700] = float("nan")
    logits[0, 900] = float("nan")
    logits[1, 300] = float("inf")
    logits[2, 10] = float("inf")
    logits[2, 600] = float("nan")  # the NaN wins, as in torch.argmax
    logits[3] = float("-inf")  # all -inf: index 0, as torch
    target = torch.tensor([1, 300, 2, 3, IGNORE, 5], device=device)
    logits[5, 5] = 50.0
    out = F.cross_entropy(logits, target, reduction="none", return_argmax=True)
    want = torch.where(target != IGNORE, logits.argmax(-1), -1)
    assert torch.equal(out.argmax, want), (out.argmax, want)
    assert torch.isnan(out.loss[[0, 1, 2]]).all() and out.loss[4] == 0
    assert_close(out.accuracy, torch.tensor(2 / 5, device=device), name="accuracy")  # rows 1 and 5


def test_all_ignored_accuracy_and_z_loss_are_zero(poison_outputs, device):
    logits = torch.randn(5, 300, device=device, requires_grad=True)
    target = torch.full((5,), IGNORE, device=device)
    out = F.cross_entropy(logits, target, z_loss_scale=1e-3, return_z_loss=True, return_argmax=True,
                          weight=_class_weight(300, device), token_scaling=True)
    assert out.loss == 0 and out.z_loss == 0 and out.accuracy == 0 and (out.argmax == -1).all()
    out.loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_nan_row_with_new_options(poison_outputs, device):
    logits, target = _inputs((7,), 1000, torch.float32, device)
    target[1] = 3
    with torch.no_grad():
        logits[1, 17] = float("nan")
    out = F.cross_entropy(logits, target, reduction="none", weight=_class_weight(1000, device), token_scaling=True,
                          z_loss_scale=1e-3, return_z_loss=True)
    assert torch.isnan(out.loss[1]) and torch.isnan(out.z_loss[1])
    others = torch.arange(7, device=device) != 1
    assert torch.isfinite(out.loss[others]).all()
    out.loss.sum().backward()
    assert torch.isnan(logits.grad[1]).all() and torch.isfinite(logits.grad[others]).all()


def test_reference_fallback_and_compile_give_the_same_outputs(device, monkeypatch):
    logits, target = _inputs((9,), 1000, torch.float32, device)
    options = dict(weight=_class_weight(1000, device), token_scaling=True, z_loss_scale=1e-3, label_smoothing=0.1,
                   return_z_loss=True, return_argmax=True)
    ours = F.cross_entropy(logits, target, **options)
    monkeypatch.setenv("TIGON_DISABLE", "cross_entropy")
    ref = F.cross_entropy(logits, target, **options)
    monkeypatch.delenv("TIGON_DISABLE")
    compiled = torch.compile(lambda x: F.cross_entropy(x, target, **options), backend="eager")(logits)
    for other in (ref, compiled):
        for name in ("loss", "z_loss", "accuracy"):
            assert_close(getattr(ours, name), getattr(other, name).detach(), name=name)
        assert torch.equal(ours.argmax, other.argmax)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(weight=torch.ones(7)), r"weight must have shape \(8,\)"),
        (dict(weight=torch.ones(8, dtype=torch.long)), "weight must be a float tensor"),
        (dict(weight=[1.0] * 8), "weight must be None or"),
        (dict(weight=torch.ones(8, device="meta")), "weight is on meta"),
        (dict(token_scaling=1), "token_scaling must be a bool"),
        (dict(return_z_loss="yes"), "return_z_loss must be a bool"),
        (dict(return_argmax=None), "return_argmax must be a bool"),
    ],
)
def test_bad_new_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        F.cross_entropy(torch.randn(3, 8), torch.zeros(3, dtype=torch.long), **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2048, 128256), (37, 8197)])
def test_new_options_bf16_on_gpu(shape):
    rows, vocab = shape
    logits, target = _inputs((rows,), vocab, torch.bfloat16, torch.device("cuda"))
    weight = _class_weight(vocab, "cuda")
    options = dict(weight=weight, token_scaling=True, z_loss_scale=1e-4, label_smoothing=0.1, softcap=30.0)
    compare_fwd_bwd(
        lambda x: F.cross_entropy(x, target, **options),
        lambda x: cross_entropy_reference(x, target, IGNORE, "mean", 0.1, 1e-4, 30.0, weight, True),
        (logits,), torch.bfloat16, name=f"bf16 options {shape}",
    )
    out = F.cross_entropy(logits, target, return_argmax=True, return_z_loss=True, z_loss_scale=1e-4)
    want = torch.where(target != IGNORE, logits.detach().float().argmax(-1), -1)
    assert (out.argmax == want).float().mean() > 0.999  # bf16 ties may pick either
