import torch

import tigon.nn
from tigon.ops import rms_norm_reference


def test_rms_norm_module_loads_hf_llama_state_dict_and_matches(device):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(64, eps=1e-5).to(device)
    with torch.no_grad():
        hf.weight.normal_()
    ours = tigon.nn.RMSNorm(64, eps=1e-5).to(device)
    ours.load_state_dict(hf.state_dict())
    assert ours.variance_epsilon == hf.variance_epsilon
    x = torch.randn(3, 5, 64, device=device)
    torch.testing.assert_close(ours(x), hf(x))


def test_gemma_rms_norm_module(device):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    hf = GemmaRMSNorm(48, eps=1e-6).to(device)
    ours = tigon.nn.RMSNorm(48, eps=1e-6, offset=1.0, casting="gemma").to(device)
    assert torch.equal(ours.weight, hf.weight)  # both start at zero: scale = 1 + weight
    with torch.no_grad():
        hf.weight.normal_()
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 48, device=device)
    torch.testing.assert_close(ours(x), hf(x))
    torch.testing.assert_close(ours(x), rms_norm_reference(x, ours.weight, 1e-6, 1.0, "gemma"))


def test_rms_norm_module_without_a_weight_is_torchs(device):
    ours = tigon.nn.RMSNorm(37, eps=1e-5, offset=1.0, elementwise_affine=False).to(device)
    theirs = torch.nn.RMSNorm(37, eps=1e-5, elementwise_affine=False).to(device)
    assert ours.weight is None and not list(ours.parameters()) and not ours.state_dict()
    assert "elementwise_affine=False" in repr(ours)
    x = (torch.randn(3, 5, 37, device=device) * 3).requires_grad_()
    dy = torch.randn(3, 5, 37, device=device)
    got = ours(x)
    (got_dx,) = torch.autograd.grad(got, x, dy)
    want = theirs(x)
    (want_dx,) = torch.autograd.grad(want, x, dy)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_dx, want_dx)


def test_layer_norm_module_is_torch_compatible(device):
    hf = torch.nn.LayerNorm(33).to(device)
    with torch.no_grad():
        hf.weight.normal_()
        hf.bias.normal_()
    ours = tigon.nn.LayerNorm(33).to(device)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(4, 33, device=device, requires_grad=True)
    torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-5)
    no_bias = tigon.nn.LayerNorm(33, bias=False).to(device)
    assert set(no_bias.state_dict()) == {"weight"}
    no_bias(x).sum().backward()
    assert x.grad is not None


def test_rms_norm_module_inplace_backward(device):
    """inplace_backward=True on the module reaches the op: dx lands in the incoming gradient's
    storage, with the values of the default module's backward; the state dict is unchanged."""
    default = tigon.nn.RMSNorm(53, eps=1e-5).to(device)
    with torch.no_grad():
        default.weight.normal_()
    ours = tigon.nn.RMSNorm(53, eps=1e-5, inplace_backward=True).to(device)
    ours.load_state_dict(default.state_dict())
    assert "inplace_backward=True" in repr(ours) and "inplace_backward" not in repr(default)
    x = torch.randn(4, 53, device=device, requires_grad=True)
    dy = torch.randn(4, 53, device=device)
    want_dx, want_dw = torch.autograd.grad(default(x), (x, default.weight), dy.clone())
    got_dx, got_dw = torch.autograd.grad(ours(x), (x, ours.weight), dy)
    assert got_dx.data_ptr() == dy.data_ptr()
    assert torch.equal(got_dx, want_dx) and torch.equal(got_dw, want_dw)


def test_layer_norm_module_inplace_backward(device):
    ours = tigon.nn.LayerNorm(41, inplace_backward=True).to(device)
    x = torch.randn(6, 41, device=device, requires_grad=True)
    dy = torch.randn(6, 41, device=device)
    (want,) = torch.autograd.grad(torch.nn.functional.layer_norm(x, (41,), ours.weight, ours.bias), x, dy.clone())
    (got,) = torch.autograd.grad(ours(x), x, dy)
    assert got.data_ptr() == dy.data_ptr()
    torch.testing.assert_close(got, want)
