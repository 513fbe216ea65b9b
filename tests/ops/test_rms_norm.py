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


def _trap_ones(monkeypatch):
    """Make torch.ones raise: weight=None must reach the kernels as None, not as a scale of ones."""

    def ones(*args, **kwargs):
        raise AssertionError("weight=None was replaced by a tensor of ones")

    monkeypatch.setattr(torch, "ones", ones)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0), ("none", 0.5)])
def test_no_weight_reaches_the_kernels_as_none(poison_outputs, monkeypatch, device, dtype, casting, offset):
    """The scale of a weightless norm is ``offset + 1``, applied in the kernels; rms_norm and
    add_rms_norm alike, with a NaN row staying NaN (forward and backward) and the others exact."""
    _trap_ones(monkeypatch)
    x = torch.randn(4, 3, 301, dtype=dtype, device=device)
    x[1, 2, 17] = float("nan")
    x.requires_grad_()
    residual = torch.randn_like(x, requires_grad=True)

    def plain(x):  # the formula in plain PyTorch, not tigon's reference
        up = x.to(torch.promote_types(x.dtype, torch.float32))
        x_hat = up * torch.rsqrt(up.pow(2).mean(-1, keepdim=True) + 1e-5)
        if casting == "llama":
            return (offset + 1.0) * x_hat.to(x.dtype)
        return (x_hat * (offset + 1.0)).to(x.dtype)

    cases = [
        (lambda x: F.rms_norm(x, None, 1e-5, offset=offset, casting=casting), plain, (x,)),
        (
            lambda x, r: F.add_rms_norm(x, r, None, 1e-5, offset=offset, casting=casting),
            lambda x, r: (plain(x + r), x + r),
            (x, residual),
        ),
    ]
    for ours, theirs, args in cases:
        finite = [a.detach()[[0, 2, 3]].requires_grad_() for a in args]
        compare_fwd_bwd(ours, theirs, finite, name=f"no weight {casting}")
        leaves = [a.detach().requires_grad_() for a in args]
        out = ours(*leaves)
        out = out if isinstance(out, torch.Tensor) else out[0]
        assert out.dtype == dtype
        out.backward(torch.randn_like(out))
        assert out[1, 2].isnan().all() and not out[[0, 2, 3]].isnan().any()
        assert leaves[0].grad[1, 2].isnan().all() and not leaves[0].grad[[0, 2, 3]].isnan().any()


def _inplace_case(dtype, device, residual):
    x = torch.randn(3, 5, 299, dtype=dtype, device=device)
    x[2, 1, 0] = float("inf")  # a non-finite row: NaN forward and backward, in place too
    x.requires_grad_()
    weight = (1 + 0.2 * torch.randn(299, dtype=dtype, device=device)).requires_grad_()
    r = torch.randn_like(x, requires_grad=True) if residual else None
    return x, r, weight


def _norm_grads(x, r, weight, casting, inplace, grad_out, grad_sum):
    """(dx, dweight) of the norm (and of add_rms_norm's sum, when `r` is given) for the given
    output gradients, by autograd.grad, so no leaf's .grad buffer is involved."""
    if r is None:
        out = F.rms_norm(x, weight, casting=casting, inplace_backward=inplace)
        return torch.autograd.grad(out, (x, weight), grad_out)
    normed, total = F.add_rms_norm(x, r, weight, casting=casting, inplace_backward=inplace)
    return torch.autograd.grad((normed, total), (x, weight), (grad_out, grad_sum))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("casting", ["llama", "gemma", "none"])
@pytest.mark.parametrize("residual", [False, True], ids=["rms_norm", "add_rms_norm"])
def test_inplace_backward_writes_dx_over_dy(poison_outputs, device, dtype, casting, residual):
    """inplace_backward: dx is the incoming gradient's own storage (no new x-sized buffer) and
    equals the out-of-place backward's dx bit for bit, NaN row included; the weight gradient too."""
    x, r, weight = _inplace_case(dtype, device, residual)
    grad_out = torch.randn(x.shape, dtype=dtype, device=device)
    grad_sum = torch.randn_like(grad_out) if residual else None
    kept_out, kept_sum = grad_out.clone(), (grad_sum.clone() if residual else None)
    default_out = kept_out.clone()
    want_dx, want_dw = _norm_grads(x, r, weight, casting, False, default_out, kept_sum)
    assert torch.equal(default_out, kept_out)  # the default backward leaves the incoming gradient alone
    got_dx, got_dw = _norm_grads(x, r, weight, casting, True, grad_out, grad_sum)
    assert got_dx.data_ptr() == grad_out.data_ptr()
    torch.testing.assert_close(got_dx, want_dx, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got_dw, want_dw, rtol=0, atol=0, equal_nan=True)
    assert got_dx[2, 1].isnan().all() and not got_dx[:2].isnan().any()
    if residual:
        assert torch.equal(grad_sum, kept_sum)  # the sum's gradient is only read


def test_inplace_backward_allocates_where_dy_cannot_hold_dx(poison_outputs, device):
    """A non-contiguous dy, or one of another dtype than x (fp16 x, fp32 weight, "llama" casting:
    the output is fp32), is not written: dx gets its own buffer, with the out-of-place values."""
    x = torch.randn(4, 37, dtype=torch.float16, device=device, requires_grad=True)
    half, full = {"dtype": torch.float16, "device": device}, {"dtype": torch.float32, "device": device}
    cases = [
        (torch.randn(37, **half), torch.randn(37, 4, **half).t()),
        (torch.randn(37, **full), torch.randn(4, 37, **full)),
    ]
    for weight, grad_out in cases:
        kept = grad_out.clone()
        (got,) = torch.autograd.grad(F.rms_norm(x, weight, inplace_backward=True), x, grad_out)
        (want,) = torch.autograd.grad(F.rms_norm(x, weight), x, kept)
        assert torch.equal(grad_out, kept) and got.data_ptr() != grad_out.data_ptr()
        assert got.dtype == torch.float16 and torch.equal(got, want)


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
@pytest.mark.parametrize("residual", [False, True], ids=["rms_norm", "add_rms_norm"])
def test_bf16_inplace_backward_on_gpu(residual):
    """bf16 16384 x 4096: the in-place backward equals the out-of-place one bit for bit and
    allocates no x-sized buffer (the out-of-place one allocates dx)."""
    x = torch.randn(16384, 4096, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    weight = (1 + 0.2 * torch.randn(4096, dtype=torch.bfloat16, device="cuda")).requires_grad_()
    r = torch.randn_like(x, requires_grad=True) if residual else None
    grad_sum = torch.randn_like(x) if residual else None
    extra, grads = {}, {}
    for inplace in (False, True):
        grad_out = torch.randn(x.shape, dtype=x.dtype, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        if r is None:
            outs, wanted = F.rms_norm(x, weight, inplace_backward=inplace), grad_out
        else:
            outs, wanted = F.add_rms_norm(x, r, weight, inplace_backward=inplace), (grad_out, grad_sum)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads[inplace] = torch.autograd.grad(outs, (x, weight), wanted)
        torch.cuda.synchronize()
        extra[inplace] = torch.cuda.max_memory_allocated() - base
        if inplace:
            assert grads[inplace][0].data_ptr() == grad_out.data_ptr()
        del outs, wanted, grad_out
    for got, want in zip(grads[True], grads[False]):
        assert torch.equal(got, want)
    assert extra[False] >= x.numel() * x.element_size()
    assert extra[True] <= extra[False] - x.numel() * x.element_size() + (1 << 20)


@pytest.mark.gpu
@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_bf16_no_weight_on_gpu(casting):
    x = torch.randn(37, 4099, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    compare_fwd_bwd(
        lambda x: F.rms_norm(x, None, casting=casting),
        lambda x: rms_norm_reference(x, None, 1e-6, 0.0, casting),
        (x,), torch.bfloat16, name="bf16 no weight",
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
