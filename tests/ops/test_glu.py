import pytest
import torch

import tigon.functional as F
from tigon.ops.glu import geglu_reference, swiglu_reference
from tests.helpers import assert_close, compare_fwd_bwd

SHAPES = [(7,), (3, 1000), (2, 5, 4099)]


def _torch_glu(approximate):
    """The plain-PyTorch formula each op must reproduce (not tigon's reference)."""
    if approximate is None:
        return lambda g, u: torch.nn.functional.silu(g) * u
    return lambda g, u: torch.nn.functional.gelu(g, approximate=approximate) * u


def _tigon_glu(approximate):
    return F.swiglu if approximate is None else (lambda g, u: F.geglu(g, u, approximate=approximate))


def _pair(shape, dtype, device, scale=2.0):
    gate = (scale * torch.randn(shape, dtype=dtype, device=device)).requires_grad_()
    up = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    return gate, up


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("approximate", [None, "tanh", "none"], ids=["swiglu", "geglu-tanh", "geglu-erf"])
@pytest.mark.parametrize("shape", SHAPES)
def test_glu_matches_torch(poison_outputs, device, dtype, approximate, shape):
    gate, up = _pair(shape, dtype, device)
    out = compare_fwd_bwd(_tigon_glu(approximate), _torch_glu(approximate), (gate, up), name=str(approximate))
    assert out[0].is_contiguous()


def test_references_are_the_torch_formulas():
    gate, up = torch.randn(5, 33), torch.randn(5, 33)
    assert torch.equal(swiglu_reference(gate, up), _torch_glu(None)(gate, up))
    for approximate in ("tanh", "none"):
        assert torch.equal(geglu_reference(gate, up, approximate), _torch_glu(approximate)(gate, up))


@pytest.mark.parametrize("approximate", [None, "tanh", "none"], ids=["swiglu", "geglu-tanh", "geglu-erf"])
def test_strided_halves_of_a_fused_projection(poison_outputs, device, approximate):
    # Phi-3 style: gate and up are the two halves of one (tokens, 2 * I) projection.
    fused = torch.randn(4, 9, 2 * 301, device=device)
    gate = fused[..., :301].detach().requires_grad_()
    up = fused[..., 301:].detach().requires_grad_()
    assert not gate.is_contiguous()
    compare_fwd_bwd(_tigon_glu(approximate), _torch_glu(approximate), (gate, up), name="halves")
    transposed = torch.randn(301, 6, device=device).t().requires_grad_()  # last dim not unit-stride
    compare_fwd_bwd(_tigon_glu(approximate), _torch_glu(approximate), (transposed, up[0, :6]), name="transposed")


@pytest.mark.parametrize("approximate", [None, "tanh", "none"], ids=["swiglu", "geglu-tanh", "geglu-erf"])
def test_large_inputs_stay_finite(device, approximate):
    gate = torch.tensor([-1e4, -90.0, -30.0, 0.0, 30.0, 90.0, 1e4], device=device).requires_grad_()
    up = torch.ones(7, device=device, requires_grad=True)
    compare_fwd_bwd(_tigon_glu(approximate), _torch_glu(approximate), (gate, up), name="large")


def test_backward_saves_only_gate_and_up(device):
    gate, up = _pair((6, 130), torch.float32, device)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = F.swiglu(gate, up)
    assert sorted(t.data_ptr() for t in saved) == sorted([gate.data_ptr(), up.data_ptr()])
    out.sum().backward()
    assert gate.grad is not None and up.grad is not None


def test_gradient_buffers_are_fresh(device):
    # The kernel must not write gradients into grad_output (autograd may still read it).
    gate, up = _pair((3, 50), torch.float32, device)
    grad = torch.randn(3, 50, device=device)
    kept = grad.clone()
    F.geglu(gate, up).backward(grad)
    assert torch.equal(grad, kept)


def test_only_one_input_requires_grad(device):
    gate = torch.randn(4, 40, device=device)
    up = torch.randn(4, 40, device=device, requires_grad=True)
    F.swiglu(gate, up).sum().backward()
    assert_close(up.grad, torch.nn.functional.silu(gate), name="grad up")


def test_empty_input(device):
    gate = torch.randn(0, 16, device=device)
    assert F.swiglu(gate, gate).shape == (0, 16)
    assert F.geglu(gate, gate).shape == (0, 16)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: F.swiglu(torch.randn(3, 8), torch.randn(3, 7)), r"up must have the shape of gate \(3, 8\)"),
        (lambda: F.swiglu(torch.randn(3, 8), torch.randn(3, 8).half()), "up must have the dtype of gate"),
        (lambda: F.swiglu(torch.ones(3, dtype=torch.int32), torch.ones(3)), "gate must be a floating-point"),
        (lambda: F.swiglu(torch.randn(3), torch.randn(3, device="meta")), "up is on meta"),
        (lambda: F.geglu(torch.randn(3), torch.randn(3), approximate="erf"), "approximate must be one of"),
    ],
)
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", [None, "tanh", "none"], ids=["swiglu", "geglu-tanh", "geglu-erf"])
@pytest.mark.parametrize("shape", [(16384, 14336), (3, 2049, 11008)])
def test_bf16_on_gpu(approximate, shape):
    gate, up = _pair(shape, torch.bfloat16, torch.device("cuda"))
    compare_fwd_bwd(_tigon_glu(approximate), _torch_glu(approximate), (gate, up), torch.bfloat16, name="bf16")


@pytest.mark.gpu
def test_int64_offsets_on_gpu():
    # Strided (non-flat) path with row * stride past 2**31 in the last rows.
    rows, cols = 2**31 // 8192 + 3, 4096
    fused = torch.randn(rows, 2 * cols, dtype=torch.bfloat16, device="cuda")
    gate, up = fused[:, :cols], fused[:, cols:]
    out = F.swiglu(gate, up)
    assert_close(out[-5:], swiglu_reference(gate[-5:], up[-5:]), name="tail rows")
