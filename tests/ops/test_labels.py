"""Targets outside [0, V) that are not ignore_index: one behaviour on every path. The row's loss
and its whole gradient row are NaN (so is any mean or sum over it), the other rows are exact, and
nothing syncs with the host; TIGON_DEBUG=1 raises a ValueError naming the first bad target."""

import pytest
import torch

import tigon.functional as F
from tigon.ops.cross_entropy import cross_entropy_reference
from tests.helpers import assert_close

IGNORE = -100
VOCAB = 1000
BAD_ROWS = [1, 4, 6, 7]


@pytest.fixture(params=["kernel", "reference"])
def path(request, monkeypatch):
    if request.param == "reference":
        monkeypatch.setenv("TIGON_DISABLE", "cross_entropy,linear_cross_entropy")
    return request.param


def _targets(device, ignore_index=IGNORE, dtype=torch.int64):
    target = torch.randint(0, VOCAB, (9,), device=device)
    target[BAD_ROWS] = torch.tensor([VOCAB, -1, VOCAB + 7, -5], device=device)
    target[2] = ignore_index
    return target.to(dtype)


def _good_rows(device):
    good = torch.ones(9, dtype=torch.bool, device=device)
    good[BAD_ROWS] = False
    return good


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("target_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("options", [{}, dict(label_smoothing=0.1, z_loss_scale=1e-3, softcap=20.0)])
def test_cross_entropy(poison_outputs, device, path, dtype, target_dtype, options):
    logits = (2 * torch.randn(9, VOCAB, device=device)).to(dtype).requires_grad_()
    target = _targets(device, dtype=target_dtype)
    losses = F.cross_entropy(logits, target, reduction="none", **options)
    grad_out = torch.randn_like(losses)
    losses.backward(grad_out)
    assert F.cross_entropy(logits, target, **options).isnan()
    assert F.cross_entropy(logits, target, reduction="sum", **options).isnan()

    good = _good_rows(device)
    assert losses[~good].isnan().all(), f"a bad target's loss is {losses[~good].tolist()}"
    assert logits.grad[~good].isnan().all(), "a bad target's gradient row is not all NaN"
    ref = logits.detach()[good].double().requires_grad_()
    want = cross_entropy_reference(ref, target[good], IGNORE, "none", **options)
    want.backward(grad_out[good].double())
    assert_close(losses[good], want.float(), dtype, f"{path} loss")
    assert_close(logits.grad[good], ref.grad.to(dtype), dtype, f"{path} grad")


@pytest.mark.parametrize("reduction,num_items", [("none", None), ("mean", None), ("mean", 17), ("sum", None)])
def test_linear_cross_entropy(poison_outputs, device, path, reduction, num_items):
    h = torch.randn(9, 16, device=device, requires_grad=True)
    w = (torch.randn(VOCAB, 16, device=device) / 2).requires_grad_()
    target = _targets(device)
    out = F.linear_cross_entropy(
        h, w, target, reduction=reduction, num_items_in_batch=num_items, max_chunk_bytes=4 * VOCAB * 4
    )
    out.backward(torch.randn_like(out))
    good = _good_rows(device)
    if reduction == "none":
        assert out[BAD_ROWS].isnan().all() and out[good].isfinite().all()
    else:
        assert out.isnan()
    # A NaN gradient row of the logits reaches every element of grad_weight through the GEMM.
    assert h.grad[BAD_ROWS].isnan().all() and w.grad.isnan().all()
    if reduction == "none":
        assert h.grad[good].isfinite().all()


def test_in_range_ignore_index(poison_outputs, device, path):
    # With ignore_index=0, class 0 is skipped and -100 is just another target outside [0, V).
    logits = torch.randn(9, VOCAB, device=device, requires_grad=True)
    target = _targets(device, ignore_index=0)
    target[3] = IGNORE
    losses = F.cross_entropy(logits, target, ignore_index=0, reduction="none")
    losses.sum().backward()
    assert losses[2] == 0 and logits.grad[2].eq(0).all()
    assert losses[[3] + BAD_ROWS].isnan().all() and logits.grad[[3] + BAD_ROWS].isnan().all()
    assert losses[[0, 5, 8]].isfinite().all()


@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy"])
def test_debug_raises_naming_the_target(device, path, monkeypatch, op):
    monkeypatch.setenv("TIGON_DEBUG", "1")
    target = _targets(device).view(3, 3)
    hidden, weight = torch.randn(3, 3, 16, device=device), torch.randn(VOCAB, 16, device=device)
    with pytest.raises(ValueError, match=rf"target\[0, 1\] is {VOCAB}, outside \[0, {VOCAB}\) .* 4 target"):
        if op == "cross_entropy":
            F.cross_entropy(torch.randn(3, 3, VOCAB, device=device), target)
        else:
            F.linear_cross_entropy(hidden, weight, target)
    target[:] = IGNORE
    target[0, 0] = VOCAB - 1
    assert F.cross_entropy(torch.randn(3, 3, VOCAB, device=device), target).isfinite()  # no false alarm
