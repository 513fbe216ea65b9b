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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("affine", ["weight+bias", "none"])
def test_inplace_backward_writes_dx_over_dy(poison_outputs, device, dtype, affine):
    """inplace_backward: dx is the incoming gradient's own storage and equals the default
    backward's dx bit for bit, a non-finite row's NaN included; a non-contiguous dy is left alone."""
    x = 3 + 2 * torch.randn(3, 5, 299, dtype=dtype, device=device)
    x[1, 4, 7] = float("nan")
    x.requires_grad_()
    params = [
        (scale * torch.randn(299, dtype=dtype, device=device) + shift).requires_grad_() if "weight" in affine else None
        for scale, shift in ((0.2, 1.0), (0.2, 0.0))
    ]
    leaves = [x] + [p for p in params if p is not None]
    grad_out = torch.randn(x.shape, dtype=dtype, device=device)
    default_out = grad_out.clone()
    want = torch.autograd.grad(F.layer_norm(x, *params), leaves, default_out)
    assert torch.equal(default_out, grad_out)
    got = torch.autograd.grad(F.layer_norm(x, *params, inplace_backward=True), leaves, grad_out)
    assert got[0].data_ptr() == grad_out.data_ptr()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    assert got[0][1, 4].isnan().all() and not got[0][0].isnan().any()
    strided = torch.randn(3, 5, 2 * 299, dtype=dtype, device=device)[..., ::2]
    kept = strided.clone()
    (dx,) = torch.autograd.grad(F.layer_norm(x, *params, inplace_backward=True), x, strided)
    assert torch.equal(strided, kept) and dx.data_ptr() != strided.data_ptr()
    torch.testing.assert_close(dx, torch.autograd.grad(F.layer_norm(x, *params), x, kept)[0], equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4, 2048, 4096), (3, 65536), (37, 4099)])
def test_bf16_on_gpu(shape):
    x = torch.randn(*shape, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    w = torch.randn(shape[-1], dtype=torch.bfloat16, device="cuda", requires_grad=True)
    b = torch.randn(shape[-1], dtype=torch.bfloat16, device="cuda", requires_grad=True)
    compare_fwd_bwd(F.layer_norm, layer_norm_reference, (x, w, b), name="bf16")


@pytest.mark.gpu
def test_bf16_inplace_backward_on_gpu():
    x = torch.randn(8192, 4096, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    weight = torch.randn(4096, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    bias = torch.randn(4096, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    grad_out = torch.randn_like(x)
    want = torch.autograd.grad(F.layer_norm(x, weight, bias), (x, weight, bias), grad_out.clone())
    got = torch.autograd.grad(F.layer_norm(x, weight, bias, inplace_backward=True), (x, weight, bias), grad_out)
    assert got[0].data_ptr() == grad_out.data_ptr()
    for g, w in zip(got, want):
        assert torch.equal(g, w)
