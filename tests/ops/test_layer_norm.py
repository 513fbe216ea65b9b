import pytest
import torch

import tigon.functional as F
from tigon.ops.layer_norm import layer_norm_reference
from tests.helpers import compare_fwd_bwd


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("affine", ["weight+bias", "weight", "bias", "none"])
@pytest.mark.parametrize("width", [1, 7, 1000, 4099])
@pytest.mark.parametrize("lead", [(3,), (2, 5)])
def test_layer_norm_matches_reference(poison_outputs, device, dtype, affine, width, lead):
    x = (3 + 2 * torch.randn(*lead, width, dtype=dtype, device=device)).requires_grad_()
    weight = (1 + 0.2 * torch.randn(width, dtype=dtype, device=device)).requires_grad_() if "weight" in affine else None
    bias = (0.2 * torch.randn(width, dtype=dtype, device=device)).requires_grad_() if "bias" in affine else None
    compare_fwd_bwd(
        lambda x, w, b: F.layer_norm(x, w, b, 1e-5), lambda x, w, b: layer_norm_reference(x, w, b, 1e-5),
        (x, weight, bias), name=f"layer_norm {affine}",
    )


def test_non_contiguous_and_frozen_params(poison_outputs, device):
    x = torch.randn(5, 8, 300, device=device)[:, 1::3, :257].detach().requires_grad_()
    weight = torch.randn(257, device=device)  # frozen: no gradient expected
    bias = torch.randn(257, device=device, requires_grad=True)
    compare_fwd_bwd(F.layer_norm, layer_norm_reference, (x, weight, bias), name="strided")
    out = F.layer_norm(x, weight, bias)
    out.sum().backward()
    assert weight.grad is None


def test_reference_matches_torch_layer_norm():
    x = torch.randn(4, 50, dtype=torch.float64)
    w, b = torch.randn(50, dtype=torch.float64), torch.randn(50, dtype=torch.float64)
    torch.testing.assert_close(layer_norm_reference(x, w, b, 1e-5), torch.nn.functional.layer_norm(x, (50,), w, b, 1e-5))


def test_empty_and_bad_arguments(device):
    assert F.layer_norm(torch.randn(0, 9, device=device), None, None).shape == (0, 9)
    with pytest.raises(ValueError, match=r"bias must have shape \(9,\)"):
        F.layer_norm(torch.randn(2, 9), None, torch.ones(8))
    with pytest.raises(ValueError, match="x must be a floating-point"):
        F.layer_norm(torch.ones(2, 9, dtype=torch.int32), None, None)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4, 2048, 4096), (3, 65536), (37, 4099)])
def test_bf16_on_gpu(shape):
    x = torch.randn(*shape, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    w = torch.randn(shape[-1], dtype=torch.bfloat16, device="cuda", requires_grad=True)
    b = torch.randn(shape[-1], dtype=torch.bfloat16, device="cuda", requires_grad=True)
    compare_fwd_bwd(F.layer_norm, layer_norm_reference, (x, w, b), name="bf16")
