import pytest
import torch

import tigon.nn
from tests.helpers import assert_close


def test_cross_entropy_loss_matches_torch_module(device):
    ours = tigon.nn.CrossEntropyLoss(ignore_index=3, label_smoothing=0.1)
    theirs = torch.nn.CrossEntropyLoss(ignore_index=3, label_smoothing=0.1)
    logits = torch.randn(11, 1000, device=device, requires_grad=True)
    target = torch.randint(0, 1000, (11,), device=device)
    target[:2] = 3
    ref = logits.detach().clone().requires_grad_()
    loss, want = ours(logits, target), theirs(ref, target)
    loss.backward()
    want.backward()
    assert_close(loss, want, name="loss")
    assert_close(logits.grad, ref.grad, name="grad")
    assert "label_smoothing=0.1" in repr(ours) and "ignore_index=3" in repr(ours)


def test_cross_entropy_loss_options_reach_the_op(device):
    logits = torch.randn(2, 5, 300, device=device)
    target = torch.randint(0, 300, (2, 5), device=device)
    module = tigon.nn.CrossEntropyLoss(reduction="none", z_loss_scale=1e-2, softcap=4.0)
    want = tigon.functional.cross_entropy(logits, target, reduction="none", z_loss_scale=1e-2, softcap=4.0)
    assert torch.equal(module(logits, target), want)


def test_linear_cross_entropy_loss_matches_unfused(device):
    hidden = torch.randn(2, 6, 16, device=device, requires_grad=True)
    head = torch.nn.Linear(16, 1000, device=device)
    target = torch.randint(0, 1000, (2, 6), device=device)
    target[0, 0] = -100
    module = tigon.nn.LinearCrossEntropyLoss(max_chunk_bytes=5 * 1000 * 4)
    loss = module(hidden, head.weight, target, head.bias, num_items_in_batch=20)
    loss.backward()
    grads = [hidden.grad, head.weight.grad, head.bias.grad]
    hidden.grad = head.weight.grad = head.bias.grad = None
    want = torch.nn.functional.cross_entropy(head(hidden).view(-1, 1000), target.view(-1), reduction="sum") / 20
    want.backward()
    assert_close(loss, want, name="loss")
    for name, got, ref in zip(("hidden", "weight", "bias"), grads, (hidden.grad, head.weight.grad, head.bias.grad)):
        assert_close(got, ref, name=name)
    assert "max_chunk_bytes=20000" in repr(module)


@pytest.mark.parametrize("cls", [tigon.nn.CrossEntropyLoss, tigon.nn.LinearCrossEntropyLoss])
def test_bad_options_fail_at_construction(cls):
    with pytest.raises(ValueError, match="reduction must be one of"):
        cls(reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing must be"):
        cls(label_smoothing=2.0)
