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


def test_cross_entropy_loss_weight_is_torch_modules(device):
    weight = torch.rand(300, device=device) + 0.1
    ours = tigon.nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1)
    theirs = torch.nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1)
    logits = torch.randn(9, 300, device=device)
    target = torch.randint(0, 300, (9,), device=device)
    target[0] = -100
    assert_close(ours(logits, target), theirs(logits, target), name="weighted loss")
    assert "weight" in dict(ours.named_buffers())


def test_new_options_reach_the_ops(device):
    logits = torch.randn(7, 300, device=device)
    target = torch.randint(0, 300, (7,), device=device)
    weight = torch.rand(300, device=device)
    options = dict(z_loss_scale=1e-2, token_scaling=True, return_z_loss=True, return_argmax=True)
    got = tigon.nn.CrossEntropyLoss(weight=weight, **options)(logits, target)
    want = tigon.functional.cross_entropy(logits, target, weight=weight, **options)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    hidden, head = torch.randn(7, 16, device=device), torch.randn(300, 16, device=device)
    module = tigon.nn.LinearCrossEntropyLoss(class_weight=weight, fp32_weight_grad=True, **options)
    got = module(hidden, head, target)
    want = tigon.functional.linear_cross_entropy(hidden, head, target, class_weight=weight, fp32_weight_grad=True,
                                                 **options)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert "token_scaling=True" in repr(module) and "fp32_weight_grad=True" in repr(module)


@pytest.mark.parametrize("cls,name", [(tigon.nn.CrossEntropyLoss, "weight"), (tigon.nn.LinearCrossEntropyLoss, "class_weight")])
def test_bad_class_weight_fails_at_construction(cls, name):
    with pytest.raises(ValueError, match=f"{name} must be None or a 1-D float tensor"):
        cls(**{name: torch.ones(3, 4)})
    with pytest.raises(ValueError, match="return_argmax must be a bool"):
        cls(return_argmax="yes")
