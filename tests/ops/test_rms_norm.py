import pytest
import torch

import tigon.functional as F
from tigon.ops.rms_norm import add_rms_norm_reference, rms_norm_reference
from tests.helpers import assert_close, compare_fwd_bwd

WIDTHS = [1, 7, 1000, 4099]
LEADING = [(3,), (2, 5)]


def _rms_norm_inputs(lead, width, dtype, device):
    x = torch.randn(*lead, width, dtype=dtype, device=device, requires_grad=True)
    weight = (1 + 0.2 * torch.randn(width, dtype=dtype, device=device)).requires_grad_()
    return x, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0), ("none", 0.0), ("llama", 0.5)])
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("lead", LEADING)
def test_rms_norm_matches_reference(poison_outputs, device, dtype, casting, offset, width, lead):
    x, weight = _rms_norm_inputs(lead, width, dtype, device)
    # A width-1 row's input gradient is w dy eps rstd^3, which any fp32 code forms as the difference
    # of two nearly equal terms: it is only good to ~1e-4 there, whatever computes it.
    tolerance = torch.float16 if width == 1 and dtype == torch.float32 else None
    compare_fwd_bwd(
        lambda x, w: F.rms_norm(x, w, 1e-5, offset=offset, casting=casting),
        lambda x, w: rms_norm_reference(x, w, 1e-5, offset, casting),
        (x, weight), tolerance, name=f"rms_norm {casting}",
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0), ("none", 0.0)])
@pytest.mark.parametrize("width", [7, 1000])
def test_add_rms_norm_matches_reference(poison_outputs, device, dtype, casting, offset, width):
    x, weight = _rms_norm_inputs((4, 3), width, dtype, device)
    residual = torch.randn_like(x, requires_grad=True)
    compare_fwd_bwd(
        lambda x, r, w: F.add_rms_norm(x, r, w, offset=offset, casting=casting),
        lambda x, r, w: add_rms_norm_reference(x, r, w, 1e-6, offset, casting),
        (x, residual, weight), name=f"add_rms_norm {casting}",
    )


def test_add_rms_norm_sum_is_rounded_like_unfused(device):
    # The normalised value must come from the sum rounded to fp16, as `x + r` then RMSNorm gives.
    x = torch.randn(5, 300, dtype=torch.float16, device=device) * 100
    r = torch.randn(5, 300, dtype=torch.float16, device=device) * 1e-2
    w = torch.ones(300, dtype=torch.float16, device=device)
    normed, total = F.add_rms_norm(x, r, w)
    assert torch.equal(total, x + r)
    assert_close(normed, rms_norm_reference(x + r, w), name="normed")


def test_non_contiguous_input(poison_outputs, device):
    base = torch.randn(6, 9, 130, device=device)
    x = base[:, ::2, :129].detach().requires_grad_()  # strided rows, sliced last dim
    assert not x.is_contiguous()
    weight = torch.randn(129, device=device, requires_grad=True)
    compare_fwd_bwd(F.rms_norm, rms_norm_reference, (x, weight), name="strided")
    transposed = torch.randn(129, 6, device=device).t().requires_grad_()  # last dim not unit-stride
    compare_fwd_bwd(F.rms_norm, rms_norm_reference, (transposed, weight), name="transposed")


def test_widest_supported_row(device):
    x = torch.randn(2, 65536, device=device, requires_grad=True)
    weight = torch.randn(65536, device=device, requires_grad=True)
    compare_fwd_bwd(F.rms_norm, rms_norm_reference, (x, weight), name="65536 wide")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_no_weight_is_the_plain_normalisation(poison_outputs, device, dtype, casting):
    """weight=None (a norm with elementwise_affine=False, Llama 4's QK L2 norm) normalises only:
    ``x * rsqrt(mean(x^2) + eps)`` in fp32, rounded to x's dtype, forward and backward."""
    x = torch.randn(3, 5, 97, dtype=dtype, device=device, requires_grad=True)

    def plain(x):
        up = x.to(torch.promote_types(x.dtype, torch.float32))
        return (up * torch.rsqrt(up.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)

    out = compare_fwd_bwd(lambda x: F.rms_norm(x, None, 1e-5, casting=casting), plain, (x,), name="no weight")
    assert out[0].dtype == dtype


def test_frozen_weight_gets_no_gradient(device):
    x = torch.randn(3, 40, device=device, requires_grad=True)
    weight = torch.randn(40, device=device)
    F.rms_norm(x, weight).sum().backward()
    assert weight.grad is None and x.grad is not None


def test_mixed_dtype_promotes_like_hf(device):
    x = torch.randn(3, 40, dtype=torch.float16, device=device)
    weight = torch.randn(40, dtype=torch.float32, device=device)
    out = F.rms_norm(x, weight)
    assert out.dtype == torch.float32
    assert_close(out, rms_norm_reference(x, weight), torch.float16)
    assert F.rms_norm(x, weight, casting="gemma").dtype == torch.float16


def test_empty_input_gives_empty_output(device):
    x = torch.randn(0, 16, device=device)
    assert F.rms_norm(x, torch.ones(16, device=device)).shape == (0, 16)
    out, total = F.add_rms_norm(x, x, torch.ones(16, device=device))
    assert out.shape == total.shape == (0, 16)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: F.rms_norm(torch.randn(3, 8), torch.ones(7)), r"weight must have shape \(8,\)"),
        (lambda: F.rms_norm(torch.ones(3, 8, dtype=torch.int64), torch.ones(8)), "x must be a floating-point"),
        (lambda: F.rms_norm(torch.randn(3, 8), torch.ones(8, device="meta")), "weight is on meta"),
        (lambda: F.rms_norm(torch.randn(3, 8), torch.ones(8), casting="t5"), "casting must be one of"),
        (lambda: F.rms_norm(torch.randn(3, 8), torch.ones(8), eps=-1.0), "eps must be"),
        (lambda: F.rms_norm(torch.tensor(1.0), torch.ones(1)), "at least one dimension"),
        (lambda: F.add_rms_norm(torch.randn(3, 8), torch.randn(2, 8), torch.ones(8)), "residual must have the shape"),
        (lambda: F.add_rms_norm(torch.randn(3, 8), torch.randn(3, 8).half(), torch.ones(8)), "residual must have the dtype"),
    ],
)
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_reference_matches_hf_modules():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4, 7, 96, dtype=dtype)
        llama = LlamaRMSNorm(96, eps=1e-5).to(dtype)
        gemma = GemmaRMSNorm(96, eps=1e-5).to(dtype)
        with torch.no_grad():
            llama.weight.normal_()
            gemma.weight.normal_()
        assert torch.equal(rms_norm_reference(x, llama.weight, 1e-5), llama(x))
        assert torch.equal(rms_norm_reference(x, gemma.weight, 1e-5, 1.0, "gemma"), gemma(x))


@pytest.mark.gpu
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0), ("none", 0.0)])
@pytest.mark.parametrize("shape", [(4, 2048, 4096), (3, 65536), (37, 4099)])
def test_bf16_on_gpu(casting, offset, shape):
    x, weight = _rms_norm_inputs(shape[:-1], shape[-1], torch.bfloat16, torch.device("cuda"))
    compare_fwd_bwd(
        lambda x, w: F.rms_norm(x, w, offset=offset, casting=casting),
        lambda x, w: rms_norm_reference(x, w, 1e-6, offset, casting),
        (x, weight), torch.bfloat16, name="bf16",
    )
    r = torch.randn_like(x, requires_grad=True)
    compare_fwd_bwd(
        lambda x, r, w: F.add_rms_norm(x, r, w, offset=offset, casting=casting),
        lambda x, r, w: add_rms_norm_reference(x, r, w, 1e-6, offset, casting),
        (x, r, weight), torch.bfloat16, name="add bf16",
    )


@pytest.mark.gpu
def test_int64_offsets_on_gpu():
    # 2**31 / 4096 rows and a few more: row * stride passes 2**31 in the last rows.
    rows, cols = 2**31 // 4096 + 3, 4096
    x = torch.randn(rows, cols, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    weight = torch.ones(cols, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    out = F.rms_norm(x, weight)
    grad = torch.randn_like(out[-5:])
    out[-5:].backward(grad)
    tail = x[-5:].detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    ref = rms_norm_reference(tail, w)
    ref.backward(grad)
    assert_close(out[-5:], ref, name="tail rows")
    assert_close(x.grad[-5:], tail.grad, name="tail grads")
    assert_close(weight.grad, w.grad, name="weight grad")
