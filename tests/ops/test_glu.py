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


MULTIPLIERS = [(0.7, 1.3), (-1.75, 0.25)]


def _torch_scaled_glu(approximate, gate_multiplier, out_multiplier):
    """Falcon-H1's order in plain PyTorch: the gate scaled, the activation, times up, scaled."""
    plain = _torch_glu(approximate)
    return lambda g, u: plain(g * gate_multiplier, u) * out_multiplier


def _tigon_scaled_glu(approximate, gate_multiplier, out_multiplier):
    multipliers = {"gate_multiplier": gate_multiplier, "out_multiplier": out_multiplier}
    if approximate is None:
        return lambda g, u: F.swiglu(g, u, **multipliers)
    return lambda g, u: F.geglu(g, u, approximate=approximate, **multipliers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("approximate", [None, "tanh", "none"], ids=["swiglu", "geglu-tanh", "geglu-erf"])
@pytest.mark.parametrize("multipliers", MULTIPLIERS, ids=str)
def test_multipliers_match_torch(poison_outputs, device, dtype, approximate, multipliers):
    """``act(gate * gate_multiplier) * up * out_multiplier``, forward and backward, on contiguous
    inputs and on the strided halves of a fused projection (the kernels' two layouts)."""
    ours, theirs = _tigon_scaled_glu(approximate, *multipliers), _torch_scaled_glu(approximate, *multipliers)
    gate, up = _pair((2, 5, 299), dtype, device)
    compare_fwd_bwd(ours, theirs, (gate, up), name=f"{approximate} {multipliers}")
    fused = torch.randn(3, 2 * 301, dtype=dtype, device=device)
    halves = [half.detach().requires_grad_() for half in (fused[:, :301], fused[:, 301:])]
    compare_fwd_bwd(ours, theirs, halves, name=f"{approximate} {multipliers} halves")


@pytest.mark.parametrize("approximate", [None, "tanh"], ids=["swiglu", "geglu-tanh"])
def test_multipliers_keep_nan_and_inf(device, approximate):
    """A NaN or inf gate element gives what the torch formula gives there (NaN/inf, not a finite
    number), forward and backward; the other elements of its row stay finite and right."""
    gate, up = _pair((4, 37), torch.float32, device)
    with torch.no_grad():
        gate[1, 3], gate[2, 5], up[3, 7] = float("nan"), float("inf"), float("-inf")
    grad = torch.randn(4, 37, device=device)
    results = []
    for fn in (_tigon_scaled_glu(approximate, 0.7, 1.3), _torch_scaled_glu(approximate, 0.7, 1.3)):
        g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
        out = fn(g, u)
        out.backward(grad)
        results.append((out.detach(), g.grad, u.grad))
    for got, want in zip(*results):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
        finite = want.isfinite()
        assert_close(got[finite], want[finite], name="finite elements")


def test_down_multiplier_folds_into_a_bias_free_down_projection(device):
    """transformers' FalconH1MLP, ``down(up * act(gate * gm)) * dm``, equals
    ``down(swiglu(gate, up, gm, dm))`` for its bias-free down projection, forward and backward."""
    from transformers import FalconH1Config
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1MLP

    config = FalconH1Config(hidden_size=48, intermediate_size=131, mlp_multipliers=[0.7, 1.3], hidden_act="silu")
    hf = FalconH1MLP(config).double().to(device)  # runs on compare_fwd_bwd's float64 copies
    assert hf.down_proj.bias is None
    names = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")

    def ours(x, gate_w, up_w, down_w):
        gate, up = torch.nn.functional.linear(x, gate_w), torch.nn.functional.linear(x, up_w)
        return torch.nn.functional.linear(F.swiglu(gate, up, gate_multiplier=0.7, out_multiplier=1.3), down_w)

    def theirs(x, *weights):
        return torch.func.functional_call(hf, dict(zip(names, weights)), (x,))

    x = torch.randn(3, 5, 48, device=device, requires_grad=True)
    weights = [(torch.randn(*shape, device=device) / shape[1] ** 0.5).requires_grad_() for shape in
               ((131, 48), (131, 48), (48, 131))]
    compare_fwd_bwd(ours, theirs, (x, *weights), name="falcon_h1 mlp")


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
        (lambda: F.swiglu(torch.randn(3), torch.randn(3), gate_multiplier=torch.tensor(2.0)), "gate_multiplier must be"),
        (lambda: F.geglu(torch.randn(3), torch.randn(3), out_multiplier=float("inf")), "out_multiplier must be"),
        (lambda: F.swiglu(torch.randn(3), torch.randn(3), out_multiplier=True), "out_multiplier must be a finite"),
        (lambda: F.swiglu(torch.randn(3), torch.randn(3), gate_multiplier=float("nan")), "gate_multiplier must be"),
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
@pytest.mark.parametrize("approximate", [None, "tanh", "none"], ids=["swiglu", "geglu-tanh", "geglu-erf"])
def test_bf16_multipliers_on_gpu(approximate):
    gate, up = _pair((3, 2049, 11008), torch.bfloat16, torch.device("cuda"))
    compare_fwd_bwd(
        _tigon_scaled_glu(approximate, 0.7, 1.3), _torch_scaled_glu(approximate, 0.7, 1.3), (gate, up), torch.bfloat16,
        name="bf16 multipliers",
    )


@pytest.mark.gpu
def test_int64_offsets_on_gpu():
    # Strided (non-flat) path with row * stride past 2**31 in the last rows.
    rows, cols = 2**31 // 8192 + 3, 4096
    fused = torch.randn(rows, 2 * cols, dtype=torch.bfloat16, device="cuda")
    gate, up = fused[:, :cols], fused[:, cols:]
    out = F.swiglu(gate, up)
    assert_close(out[-5:], swiglu_reference(gate[-5:], up[-5:]), name="tail rows")


def _rounding_script():
    """scripts/geglu_rounding.py, the figures' code, as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "geglu_rounding.py"
    spec = importlib.util.spec_from_file_location("geglu_rounding", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.gpu
@pytest.mark.parametrize("gate_scale,up_scale", [(1.0, 1.0), (30.0, 30.0), (300.0, 300.0), (1e5, 1.0), (1e5, 1e-2)])
def test_geglu_tanh_bf16_closer_to_float64_than_hf_on_gpu(gate_scale, up_scale):
    # HF's eager gelu_pytorch_tanh(gate) * up rounds gelu(gate) to bf16 before the product (and its
    # 0.5 (1 + tanh(z)) cancels in fp32 for gate below ~-3); the kernel rounds each output once from
    # fp32. Against float64 on the same bf16 inputs, forward and both gradients, it is no further
    # than HF on average and correctly rounded nearly everywhere.
    from transformers.activations import ACT2FN

    script = _rounding_script()
    torch.manual_seed(0)
    gate = (torch.randn(512, 4096, device="cuda") * gate_scale).bfloat16()
    up = (torch.randn(512, 4096, device="cuda") * up_scale).bfloat16()
    grad = torch.randn(512, 4096, device="cuda").bfloat16()
    ours = script.errors(lambda g, u: F.geglu(g, u, approximate="tanh"), gate, up, grad)
    hf = script.errors(lambda g, u: ACT2FN["gelu_pytorch_tanh"](g) * u, gate, up, grad)
    for name, a, b in zip(("out", "grad gate", "grad up"), ours, hf):
        assert a.mean() <= b.mean() + 1e-3, f"{name}: tigon {a.mean():.4f} ulp, HF {b.mean():.4f} ulp"
        assert (a <= 0.51).double().mean() >= 0.99, f"{name}: {(a <= 0.51).double().mean():.4f} correctly rounded"
