"""linear_cross_entropy's class weights, z-loss output, argmax/accuracy, token scaling and fp32
weight-gradient sum, against torch on materialised logits."""

import pytest
import torch
import torch.nn.functional as TF

import tigon.functional as F
from tigon.ops.cross_entropy import cross_entropy_reference
from tigon.ops.linear_cross_entropy import linear_cross_entropy_reference
from tests.helpers import assert_close, compare_fwd_bwd
from tests.ops.test_linear_cross_entropy import _budget, _inputs

IGNORE = -100


@pytest.mark.parametrize(
    "dtype,vocab,reduction,label_smoothing",
    [(torch.float32, 2053, "mean", 0.0), (torch.float32, 2053, "none", 0.1), (torch.float16, 1000, "sum", 0.1),
     (torch.float16, 1000, "mean", 0.2)],
)
def test_class_weight_matches_torch(poison_outputs, device, dtype, vocab, reduction, label_smoothing):
    h, w, b, target = _inputs((13,), 16, vocab, dtype, device)
    class_weight = torch.rand(vocab, device=device) + 0.1

    def by_torch(h, w, b):
        logits = TF.linear(h, w, b)
        return TF.cross_entropy(logits, target, weight=class_weight.to(logits.dtype), reduction=reduction,
                                label_smoothing=label_smoothing)

    compare_fwd_bwd(
        lambda h, w, b: F.linear_cross_entropy(
            h, w, target, b, class_weight=class_weight, reduction=reduction, label_smoothing=label_smoothing,
            max_chunk_bytes=_budget(vocab, dtype),
        ),
        by_torch, (h, w, b), name=f"class_weight {reduction} eps={label_smoothing}",
    )


@pytest.mark.parametrize("dtype,reduction", [(torch.float32, "none"), (torch.float16, "mean"), (torch.float32, "mean")])
def test_token_scaling_and_z_loss(poison_outputs, device, dtype, reduction):
    h, w, b, target = _inputs((2, 7), 16, 1000, dtype, device)
    class_weight = torch.rand(1000, device=device) + 0.1

    def by_torch(h, w, b):  # the scaled rows over materialised logits, the scale detached
        capped = 5.0 * torch.tanh(TF.linear(h, w, b) / 5.0)
        valid = target != IGNORE
        ce = TF.cross_entropy(capped.flatten(0, 1), target.view(-1), weight=class_weight.double(), reduction="none",
                              label_smoothing=0.1).view(target.shape)
        z_rows = 1e-3 * torch.logsumexp(capped, -1) ** 2 * valid  # the z-loss: not weighted
        p = capped.softmax(-1).gather(-1, target.clamp_min(0)[..., None])[..., 0].detach()
        if reduction == "none":
            return (ce + z_rows) * p
        # torch's weighted mean for the cross-entropy, the rows' count for the z-loss
        return (ce * p).sum() / (class_weight.double()[target.clamp_min(0)] * valid).sum() + (z_rows * p).sum() / valid.sum()

    compare_fwd_bwd(
        lambda h, w, b: F.linear_cross_entropy(
            h, w, target, b, reduction=reduction, label_smoothing=0.1, z_loss_scale=1e-3, softcap=5.0,
            class_weight=class_weight, token_scaling=True, max_chunk_bytes=_budget(1000, dtype),
        ),
        by_torch, (h, w, b), name=f"token scaling {reduction}",
    )


@pytest.mark.parametrize("dtype,reduction", [(torch.float16, "mean"), (torch.float32, "sum"), (torch.float32, "none")])
def test_z_loss_argmax_and_accuracy_without_logits(poison_outputs, device, dtype, reduction):
    h, w, b, target = _inputs((13,), 16, 1000, dtype, device)
    logits = TF.linear(h, w, b).detach()
    torch_argmax = logits.float().argmax(-1)
    target[:5] = torch_argmax[:5]  # hits, whatever the draw
    target[5] = IGNORE
    options = dict(reduction=reduction, z_loss_scale=1e-2, label_smoothing=0.1)
    out = F.linear_cross_entropy(h, w, target, b, return_z_loss=True, return_argmax=True,
                                 max_chunk_bytes=_budget(1000, dtype), **options)
    want = cross_entropy_reference(logits, target, IGNORE, return_z_loss=True, return_argmax=True, **options)
    assert torch.equal(out.argmax, want.argmax)
    assert (out.argmax[target == IGNORE] == -1).all()
    valid = target != IGNORE
    assert_close(out.accuracy, (((torch_argmax == target) & valid).sum() / valid.sum()).float(), name="accuracy")
    assert_close(out.z_loss, want.z_loss, dtype, name="z_loss")
    assert not out.z_loss.requires_grad and not out.argmax.requires_grad
    plain = F.linear_cross_entropy(h, w, target, b, max_chunk_bytes=_budget(1000, dtype), **options)
    assert_close(out.loss.detach(), plain.detach(), name="loss unchanged")
    # The gradients are the plain loss's.
    grad = torch.randn_like(out.loss)
    out.loss.backward(grad)
    got = [t.grad.clone() for t in (h, w, b)]
    for t in (h, w, b):
        t.grad = None
    plain.backward(grad)
    for g, t in zip(got, (h, w, b)):
        assert_close(g, t.grad, name="grad")


def test_nan_row_argmax_and_loss(poison_outputs, device):
    h, w, b, target = _inputs((9,), 16, 1000, torch.float32, device)
    with torch.no_grad():
        h[2, 3] = float("nan")  # a NaN logit everywhere in row 2
    target[2] = 4
    out = F.linear_cross_entropy(h, w, target, b, reduction="none", return_argmax=True, class_weight=torch.rand(1000, device=device),
                                 token_scaling=True, max_chunk_bytes=_budget(1000, torch.float32))
    assert torch.isnan(out.loss[2]) and out.argmax[2] == 0  # every logit NaN: the first, as torch.argmax
    rest = torch.arange(9) != 2
    assert torch.isfinite(out.loss[rest]).all()
    out.loss.sum().backward()
    assert torch.isnan(h.grad[2]).all() and torch.isfinite(h.grad[rest]).all()


def test_fp32_weight_grad_is_closer_to_fp64(device):
    # fp16 over 24 chunks of 4 rows: summing the chunks' weight gradients in fp16 rounds after
    # each one; the fp32 sum rounds once (about half the error here).
    h, w, _, target = _inputs((96,), 32, 120, torch.float16, device, bias=False)
    target[target == IGNORE] = 0
    budget = _budget(120, torch.float16, rows=4)
    exact = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    linear_cross_entropy_reference(*exact, target, reduction="sum").backward()
    errors = {}
    for fp32 in (False, True):
        w.grad = None
        loss = F.linear_cross_entropy(h, w, target, reduction="sum", max_chunk_bytes=budget, fp32_weight_grad=fp32)
        loss.backward()
        assert w.grad.dtype == torch.float16
        errors[fp32] = (w.grad.double() - exact[1].grad).norm() / exact[1].grad.norm()
        assert_close(w.grad, exact[1].grad.half(), torch.float16, name=f"fp32_weight_grad={fp32}", tol=1e-2)
    assert errors[True] < 0.75 * errors[False], errors


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp32_weight_grad_matches_reference(poison_outputs, device, reduction):
    # In forward (mean) and in the recomputation of backward (none), with a grad_output.
    h, w, b, target = _inputs((13,), 16, 1000, torch.float16, device)
    compare_fwd_bwd(
        lambda h, w, b: F.linear_cross_entropy(h, w, target, b, reduction=reduction, fp32_weight_grad=True,
                                               max_chunk_bytes=_budget(1000, torch.float16)),
        lambda h, w, b: linear_cross_entropy_reference(h, w, target, b, reduction=reduction),
        (h, w, b), name=f"fp32_weight_grad {reduction}",
    )


def test_reference_fallback_and_compile_give_the_same_outputs(device, monkeypatch):
    h, w, b, target = _inputs((9,), 16, 1000, torch.float32, device)
    options = dict(class_weight=torch.rand(1000, device=device), token_scaling=True, z_loss_scale=1e-3,
                   return_z_loss=True, return_argmax=True, fp32_weight_grad=True)
    ours = F.linear_cross_entropy(h, w, target, b, **options)
    monkeypatch.setenv("TIGON_DISABLE", "linear_cross_entropy")
    ref = F.linear_cross_entropy(h, w, target, b, **options)
    monkeypatch.delenv("TIGON_DISABLE")
    compiled = torch.compile(lambda h: F.linear_cross_entropy(h, w, target, b, **options), backend="eager")(h)
    for other in (ref, compiled):
        for name in ("loss", "z_loss", "accuracy"):
            assert_close(getattr(ours, name).detach(), getattr(other, name).detach(), name=name)
        assert torch.equal(ours.argmax, other.argmax)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(class_weight=torch.ones(7)), r"class_weight must have shape \(8,\)"),
        (dict(class_weight=torch.ones(8, dtype=torch.int32)), "class_weight must be a float tensor"),
        (dict(token_scaling="on"), "token_scaling must be a bool"),
        (dict(return_argmax=1), "return_argmax must be a bool"),
        (dict(fp32_weight_grad=None), "fp32_weight_grad must be a bool"),
    ],
)
def test_bad_new_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        F.linear_cross_entropy(torch.randn(3, 4), torch.randn(8, 4), torch.zeros(3, dtype=torch.long), **kwargs)


def test_weighted_mean_z_loss_on_backward_recompute_and_with_item_count(poison_outputs, device):
    # A second backward (retain_graph) recomputes the chunks: the z-loss keeps its own divisor.
    h, w, b, target = _inputs((19,), 16, 1000, torch.float32, device)
    class_weight = torch.rand(1000, device=device) + 0.1
    options = dict(class_weight=class_weight, z_loss_scale=1e-2, label_smoothing=0.1)
    loss = F.linear_cross_entropy(h, w, target, b, max_chunk_bytes=_budget(1000, torch.float32), **options)
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in (h, w, b)]
    for t in (h, w, b):
        t.grad = None
    loss.backward()
    exact = [t.detach().double().requires_grad_() for t in (h, w, b)]
    linear_cross_entropy_reference(*exact[:2], target, exact[2], **options).backward()
    for name, got, again, want in zip("hwb", first, (h.grad, w.grad, b.grad), exact):
        assert_close(got, want.grad.float(), name=f"grad {name}")
        assert_close(again, want.grad.float(), name=f"recomputed grad {name}")
    # num_items_in_batch is the divisor of both terms.
    out = F.linear_cross_entropy(h, w, target, b, num_items_in_batch=7, return_z_loss=True, **options)
    logits = TF.linear(h, w, b).detach().double()
    want = cross_entropy_reference(logits, target, IGNORE, "sum", 0.1, 1e-2, None, class_weight, return_z_loss=True)
    assert_close(out.loss, (want.loss / 7).float(), name="loss over num_items_in_batch")
    assert_close(out.z_loss, (want.z_loss / 7).float(), name="z-loss over num_items_in_batch")


def _issue_42_case(rows, hidden, vocab, logit_scale, device):
    """bf16 inputs with a bias, logits of std ~`logit_scale` (softcap 30 saturates some), and
    targets with ignore_index 0, a class of the vocabulary, on a quarter of the rows."""
    torch.manual_seed(0)
    h = torch.randn(rows, hidden, device=device).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device=device) * logit_scale * hidden**-0.5).bfloat16().requires_grad_()
    b = torch.randn(vocab, device=device).bfloat16().requires_grad_()
    target = torch.randint(1, vocab, (rows,), device=device)
    target[torch.randperm(rows, device=device)[: rows // 4]] = 0
    return h, w, b, target


def _float64_oracle(target, ignore_index, eps, z, cap):
    """torch's smoothed cross-entropy of softcapped float64 logits (no rounding anywhere) plus the
    z-loss over the rows not ignored."""

    def fn(h, w, b):
        capped = cap * torch.tanh(TF.linear(h, w, b) / cap)
        valid = target != ignore_index
        ce = TF.cross_entropy(capped, target, label_smoothing=eps, ignore_index=ignore_index)
        return ce + z * (torch.logsumexp(capped, -1) ** 2 * valid).sum() / valid.sum()

    return fn


@pytest.mark.parametrize(
    "rows,hidden,vocab,logit_scale",
    [(64, 32, 1000, 4.0), (64, 32, 1000, 40.0),
     pytest.param(4096, 2048, 128256, 4.0, marks=pytest.mark.gpu),
     pytest.param(4096, 2048, 128256, 40.0, marks=pytest.mark.gpu)],
)
def test_bf16_bias_softcap_z_loss_smoothing_ignore_index_against_float64(device, rows, hidden, vocab, logit_scale):
    # Issue 42's combination: the fused loss in bf16 rounds only the logits (once, as F.linear
    # does, the bias included); everything after runs in fp32. Against the exact loss of the same
    # bf16 inputs that costs ~1e-4 of the loss at most (float64 triage: <= 6e-5 on the CPU, loss
    # 8..31), so a gap like the reported 1.8% (the size of the z-loss term itself when the softcap
    # saturates) cannot hide under the tolerance.
    options = dict(ignore_index=0, softcap=30.0, z_loss_scale=1e-4, label_smoothing=0.1)
    h, w, b, target = _issue_42_case(rows, hidden, vocab, logit_scale, device)
    loss = F.linear_cross_entropy(h, w, target, b, fp32_weight_grad=True, **options)
    loss.backward()
    exact = [t.detach().double().requires_grad_() for t in (h, w, b)]
    want = _float64_oracle(target, 0, 0.1, 1e-4, 30.0)(*exact)
    want.backward()
    assert_close(loss, want.float(), tol=1e-3, name="loss")
    with torch.no_grad():  # forward alone: the same loss
        assert_close(F.linear_cross_entropy(h, w, target, b, **options), loss.detach(), tol=1e-6, name="forward only")
    for name, got, exact_input in zip("hwb", (h, w, b), exact):
        assert_close(got.grad.double(), exact_input.grad, torch.bfloat16, name=f"grad {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 2048, 128256), (37, 256, 8197)])
def test_new_options_bf16_on_gpu(shape):
    rows, hidden, vocab = shape
    h, w, b, target = _inputs((rows,), hidden, vocab, torch.bfloat16, torch.device("cuda"), bias=False)
    class_weight = torch.rand(vocab, device="cuda") + 0.1
    options = dict(label_smoothing=0.1, z_loss_scale=1e-4, class_weight=class_weight, token_scaling=True)
    compare_fwd_bwd(
        lambda h, w: F.linear_cross_entropy(h, w, target, fp32_weight_grad=True, **options),
        lambda h, w: linear_cross_entropy_reference(h, w, target, **options),
        (h, w), torch.bfloat16, name=f"bf16 options {shape}",
    )
    with torch.no_grad():
        out = F.linear_cross_entropy(h, w, target, return_argmax=True, return_z_loss=True, z_loss_scale=1e-4)
        want = torch.where(target != IGNORE, TF.linear(h, w).float().argmax(-1), -1)
    assert (out.argmax == want).float().mean() > 0.999  # bf16 ties may pick either


@pytest.mark.gpu
def test_fp32_weight_grad_closer_bf16_on_gpu():
    h, w, _, target = _inputs((8192,), 1024, 32064, torch.bfloat16, torch.device("cuda"), bias=False)
    exact = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    linear_cross_entropy_reference(*exact, target).backward()
    errors = []
    for fp32 in (False, True):
        w.grad = None
        F.linear_cross_entropy(h, w, target, max_chunk_bytes=64 * 32064 * 2, fp32_weight_grad=fp32).backward()
        errors.append(((w.grad.double() - exact[1].grad).norm() / exact[1].grad.norm()).item())
    assert errors[1] < errors[0], errors


@pytest.mark.gpu
def test_new_options_no_host_sync_on_gpu():
    h, w, b, target = _inputs((1000,), 1024, 32064, torch.bfloat16, torch.device("cuda"))
    options = dict(class_weight=torch.rand(32064, device="cuda"), token_scaling=True, return_z_loss=True,
                   return_argmax=True, fp32_weight_grad=True, z_loss_scale=1e-4, label_smoothing=0.1)
    F.linear_cross_entropy(h, w, target, b, **options).loss.backward()  # warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = F.linear_cross_entropy(h, w, target, b, **options)
        (out.loss * 0.5).backward()
        F.cross_entropy(TF.linear(h, w, b).detach(), target, weight=options["class_weight"], token_scaling=True,
                        return_argmax=True, return_z_loss=True, z_loss_scale=1e-4)
    finally:
        torch.cuda.set_sync_debug_mode(0)
