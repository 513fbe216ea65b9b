"""Every fused linear loss under autocast (the HF Trainer's bf16=True: fp32 weights, autocast
around the forward) takes the same path: the head's operands cast to autocast's dtype as F.linear's
would be, the loss run with autocast off, the fp32 weights' gradients back in fp32."""

import pytest
import torch

import tigon.functional as F
from tests.helpers import assert_close

V, H, B, T = 301, 16, 2, 7


def _target(device):
    target = torch.randint(0, V, (B, T), device=device)
    target[0, :2] = -100
    return target


def _cross_entropy(h, w, b, target):
    return F.linear_cross_entropy(h, w, target, b, label_smoothing=0.1, z_loss_scale=1e-3)


def _log_probs(h, w, b, target):
    return F.linear_log_probs(h, w, target, b).sum()


def _policy(h, w, b, target):
    advantages = torch.linspace(-1.0, 1.0, B, device=h.device)
    old = torch.full(target.shape, -5.0, device=h.device)
    return F.linear_policy_loss(h, w, target.clamp_min(0), old, advantages, bias=b, mask=target != -100)[0]


def _preference(h, w, b, target):
    ref = torch.tensor([-40.0, -45.0], device=h.device)
    return F.linear_preference_loss(h, w, target, b, method="dpo", ref_log_probs=ref)[0]


def _distill(h, w, b, target):
    teacher = torch.randn(B, T, 12, device=h.device, generator=torch.Generator(h.device).manual_seed(1))
    teacher_weight = torch.randn(V, 12, device=h.device, generator=torch.Generator(h.device).manual_seed(2))
    # The teacher in the student's dtype: autocast casts both heads' operands alike.
    teacher, teacher_weight = teacher.to(h.dtype), teacher_weight.to(h.dtype)
    return F.linear_distill_loss(h, w, teacher, teacher_weight, target, hard_weight=0.3, student_bias=b)[0]


LOSSES = dict(cross_entropy=_cross_entropy, log_probs=_log_probs, policy=_policy, preference=_preference,
              distill=_distill)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16])
def test_fp32_head_under_cpu_autocast(poison_outputs, loss, hidden_dtype):
    # The decoder's last hidden states under autocast are bf16 (or fp32 after a norm kept in fp32).
    fn = LOSSES[loss]
    target = _target("cpu")
    hidden = torch.randn(B, T, H).to(hidden_dtype).requires_grad_()
    weight = (torch.randn(V, H) / 4).requires_grad_()
    bias = torch.randn(V).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fn(hidden, weight, bias, target)
    out.backward()
    assert out.dtype == torch.float32 and weight.grad.dtype == bias.grad.dtype == torch.float32
    assert hidden.grad.dtype == hidden_dtype

    # The same as the op on operands cast by hand, outside autocast: bit for bit.
    cast = [t.detach().to(torch.bfloat16).requires_grad_() for t in (hidden, weight, bias)]
    want = fn(*cast, target)
    want.backward()
    assert torch.equal(out, want)
    for got, by_hand in zip((hidden, weight, bias), cast):
        assert torch.equal(got.grad, by_hand.grad.to(got.grad.dtype))

    # And within bf16 rounding of the loss in fp32 throughout.
    exact = fn(hidden.detach().float(), weight.detach(), bias.detach(), target)
    assert_close(out.detach(), exact, torch.bfloat16, name=f"{loss} under autocast")


@pytest.mark.parametrize("loss", LOSSES)
def test_mixed_dtypes_without_autocast_still_refused(loss):
    hidden, weight = torch.randn(B, T, H, dtype=torch.bfloat16), torch.randn(V, H)
    with pytest.raises(ValueError, match="dtype"):
        LOSSES[loss](hidden, weight, None, _target("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_head_under_cuda_autocast_on_gpu(loss, dtype):
    fn = LOSSES[loss]
    target = _target("cuda")
    hidden = torch.randn(B, T, H, device="cuda").to(dtype).requires_grad_()
    weight = (torch.randn(V, H, device="cuda") / 4).requires_grad_()
    bias = torch.randn(V, device="cuda").requires_grad_()
    with torch.autocast("cuda", dtype=dtype):
        out = fn(hidden, weight, bias, target)
    out.backward()
    assert weight.grad.dtype == torch.float32
    cast = [t.detach().to(dtype).requires_grad_() for t in (hidden, weight, bias)]
    want = fn(*cast, target)
    want.backward()
    assert torch.equal(out, want)
    for got, by_hand in zip((hidden, weight, bias), cast):
        assert torch.equal(got.grad, by_hand.grad.to(got.grad.dtype))
