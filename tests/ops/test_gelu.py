import pytest
import torch

import tigon.functional as F
from tigon.ops.gelu import gelu_reference
from tests.helpers import compare_fwd_bwd, kernel_launches

APPROXIMATIONS = ["none", "tanh", "sigmoid"]


def _transformers_activation(approximate):
    """transformers' own activation modules: nn.GELU / gelu_pytorch_tanh / quick_gelu (ACT2FN)."""
    from transformers.activations import ACT2FN

    return ACT2FN[{"none": "gelu", "tanh": "gelu_pytorch_tanh", "sigmoid": "quick_gelu"}[approximate]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("shape", [(7,), (3, 1000), (2, 5, 4099)])
def test_gelu_matches_transformers(poison_outputs, device, dtype, approximate, shape):
    x = (3 * torch.randn(shape, dtype=dtype, device=device)).requires_grad_()
    act = _transformers_activation(approximate)
    out = compare_fwd_bwd(lambda x: F.gelu(x, approximate), act, (x,), name=approximate)
    assert out[0].is_contiguous()


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_gelu_reference_is_transformers(approximate):
    x = 4 * torch.randn(301, dtype=torch.float64)
    torch.testing.assert_close(gelu_reference(x, approximate), _transformers_activation(approximate)(x), rtol=0, atol=0)


def test_gelu_strided_input(poison_outputs, device):
    x = torch.randn(6, 2 * 33, device=device)[:, ::2].detach().requires_grad_()
    compare_fwd_bwd(lambda x: F.gelu(x, "sigmoid"), lambda x: gelu_reference(x, "sigmoid"), (x,), name="strided")


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_gelu_nan_and_inf_in_give_torchs_out(device, approximate):
    x = torch.randn(4, 37, device=device)
    x[1, 3], x[3, 7] = float("nan"), float("-inf")
    if approximate != "none":  # torch's CPU erf GELU of +inf is NaN (its CUDA one inf); the kernels give inf
        x[2, 5] = float("inf")
    grad = torch.randn(4, 37, device=device)
    results = []
    for fn in (lambda t: F.gelu(t, approximate), lambda t: gelu_reference(t, approximate)):
        leaf = x.clone().requires_grad_()
        out = fn(leaf)
        out.backward(grad)
        results.append((out.detach(), leaf.grad))
    for ours, theirs in zip(*results):
        assert torch.equal(ours.isnan(), theirs.isnan()), (ours, theirs)
        assert torch.equal(ours.isfinite(), theirs.isfinite())
    assert results[0][0][1, 3].isnan() and results[0][1][1, 3].isnan()


def test_gelu_saves_only_its_input_and_launches_one_kernel_each_way(device):
    x = torch.randn(5, 40, device=device, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with kernel_launches() as launches:
            out = F.gelu(x, "sigmoid")
    assert len(saved) == 1 and saved[0] is x
    with kernel_launches() as back:
        out.sum().backward()
    assert launches == {"_gelu_fwd_kernel": 1} and back == {"_gelu_bwd_kernel": 1}


def test_gelu_bad_arguments():
    with pytest.raises(ValueError, match="approximate must be one of"):
        F.gelu(torch.randn(3), "quick")
    with pytest.raises(ValueError, match="x must be a floating-point"):
        F.gelu(torch.ones(3, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_gelu_bf16_on_gpu(approximate):
    x = (3 * torch.randn(4096, 4304, device="cuda", dtype=torch.bfloat16)).requires_grad_()
    compare_fwd_bwd(lambda x: F.gelu(x, approximate), lambda x: gelu_reference(x, approximate), (x,), torch.bfloat16,
                    name=f"gelu {approximate} bf16")
