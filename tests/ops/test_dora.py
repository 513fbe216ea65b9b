import pytest
import torch

from tigon.ops.dora import ROWS_PER_PROGRAM, dora_norm, dora_norm_reference, dora_scale, dora_scale_reference
from tests.helpers import assert_close, compare_fwd_bwd


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rank", [1, 8, 13])
def test_norm_matches_reference(device, dtype, rank):
    weight = (torch.randn(37, 300, device=device) / 300**0.5).to(dtype)
    lora_a = torch.randn(rank, 300, device=device) / 300**0.5
    lora_b = torch.randn(37, rank, device=device)
    got = dora_norm(weight, lora_a, lora_b, 0.7)
    assert got.dtype == torch.float32 and got.shape == (37,)
    assert_close(got, dora_norm_reference(weight.double(), lora_a.double(), lora_b.double(), 0.7).float(),
                 torch.float32, "norm")


def test_norm_of_strided_weight_and_nan(device):
    weight = torch.randn(9, 80, device=device)[:, :65]
    lora_a, lora_b = torch.randn(4, 65, device=device), torch.randn(9, 4, device=device)
    assert_close(dora_norm(weight, lora_a, lora_b, 2.0), dora_norm_reference(weight, lora_a, lora_b, 2.0), name="norm")
    weight[3, 7] = float("nan")
    got = dora_norm(weight, lora_a, lora_b, 2.0)
    assert got[3].isnan() and not got[[0, 1, 2, 4]].isnan().any()


def _scale_inputs(lead, width, dtype, device, bias):
    z = torch.randn(*lead, width, device=device).to(dtype).requires_grad_()
    magnitude = (torch.rand(width, device=device) + 0.5).requires_grad_()
    weight_norm = torch.rand(width, device=device) + 0.5
    b = torch.randn(width, device=device).to(dtype).requires_grad_() if bias else None
    return z, magnitude, weight_norm, b


# Each dtype and each bias setting once: the interpreter takes seconds per case.
@pytest.mark.parametrize("dtype, bias", [(torch.float32, True), (torch.float16, False)])
def test_scale_matches_reference(poison_outputs, device, dtype, bias):
    # More rows than one backward program reduces, and a width that is no multiple of its block.
    lead = (3, ROWS_PER_PROGRAM // 2 + 5)
    compare_fwd_bwd(dora_scale, dora_scale_reference, _scale_inputs(lead, 150, dtype, device, bias), name="dora_scale")


def test_scale_of_strided_input(poison_outputs, device):
    z, magnitude, weight_norm, bias = _scale_inputs((7,), 40, torch.float32, device, True)
    strided = torch.randn(7, 60, device=device)[:, 5:45].requires_grad_()
    compare_fwd_bwd(dora_scale, dora_scale_reference, (strided, magnitude, weight_norm, bias), name="strided")


def test_norm_gets_no_gradient(device):
    z, magnitude, weight_norm, _ = _scale_inputs((5,), 12, torch.float32, device, False)
    weight_norm.requires_grad_()
    dora_scale(z, magnitude, weight_norm).sum().backward()
    assert weight_norm.grad is None and magnitude.grad is not None


def test_nan_reaches_the_output_and_gradient(device):
    z, magnitude, weight_norm, _ = _scale_inputs((4,), 10, torch.float32, device, False)
    z = z.detach().clone()
    z[2, 3] = float("nan")
    z.requires_grad_()
    out = dora_scale(z, magnitude, weight_norm)
    assert out[2, 3].isnan() and out.isnan().sum() == 1
    out.sum().backward()
    assert magnitude.grad[3].isnan() and magnitude.grad.isnan().sum() == 1


def test_bad_arguments(device):
    z, magnitude, weight_norm, _ = _scale_inputs((4,), 10, torch.float32, device, False)
    with pytest.raises(ValueError, match=r"magnitude must have shape \(10,\)"):
        dora_scale(z, magnitude[:9], weight_norm)
    with pytest.raises(ValueError, match="weight_norm must be float32"):
        dora_scale(z, magnitude, weight_norm.double())
    with pytest.raises(ValueError, match=r"lora_a must be \(r, 10\) and lora_b \(4, r\)"):
        dora_norm(torch.randn(4, 10), torch.randn(2, 9), torch.randn(4, 2), 1.0)
