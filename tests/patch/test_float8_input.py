"""tigon.patch.float8_input: a torchao Float8Linear fed a tigon kernel's FP8 rows gives what it gives
on the high-precision input, output and gradients bit for bit, without casting its input itself."""

import dataclasses

import pytest
import torch

import tigon.functional as F
from tigon.ops import fp8_rows_reference
from tigon.patch.float8_input import float8_linear_from_rows, input_fp8_mode

float8 = pytest.importorskip("torchao.float8")
from torchao.float8 import float8_linear as ao_linear  # noqa: E402
from torchao.float8.config import Float8LinearConfig  # noqa: E402
from torchao.float8.float8_training_tensor import GemmInputRole  # noqa: E402

RECIPES = {"tensorwise": "amax", "rowwise": "rowwise_pow2", "rowwise_with_gw_hp": "rowwise_pow2"}


def _linear(recipe, device, dtype, emulate, bias=True, features=(64, 48)):
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    plain = torch.nn.Linear(*features, bias=bias, device=device, dtype=dtype)
    return float8.convert_to_float8_training(torch.nn.Sequential(plain), config=config)[0]


def _input_casts(monkeypatch):
    """Counts torchao's dynamic casts of a linear's input (amax pass + cast)."""
    calls = []
    real = ao_linear.hp_tensor_to_float8_dynamic

    def counting(*args, **kwargs):
        if kwargs.get("gemm_input_role") is GemmInputRole.INPUT:
            calls.append(kwargs.get("axiswise_dim"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ao_linear, "hp_tensor_to_float8_dynamic", counting)
    return calls


def _same(ours, theirs, name):
    assert torch.equal(ours, theirs), f"{name}: max diff {(ours - theirs).abs().max().item()}"


def _check_handoff(linear, x, rows, monkeypatch):
    casts = _input_casts(monkeypatch)
    out = float8_linear_from_rows(linear, x, rows)
    assert casts == [], "the linear cast its input itself"
    grad = torch.randn_like(out)
    params = (x, linear.weight) + ((linear.bias,) if linear.bias is not None else ())
    got = torch.autograd.grad(out, params, grad)
    want_out = linear(x)
    want = torch.autograd.grad(want_out, params, grad)
    _same(out, want_out, "output")
    for g, w, name in zip(got, want, ("d input", "d weight", "d bias")):
        _same(g, w, name)


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("bias", [False, True])
def test_handoff_is_torchao_bit_for_bit(monkeypatch, recipe, bias):
    # torchao's emulated GEMMs on the CPU; the rows by tigon's reference (the kernels' payload is
    # checked against torchao in tests/ops/test_fp8_quant.py).
    torch.manual_seed(0)
    linear = _linear(recipe, "cpu", torch.float32, emulate=True, bias=bias)
    assert input_fp8_mode(linear) == RECIPES[recipe]
    x = torch.randn(2, 16, 64, requires_grad=True)
    _check_handoff(linear, x, fp8_rows_reference(x.detach(), RECIPES[recipe]), monkeypatch)


def test_handoff_uses_the_rows():
    # Rows that are not x's cast change the output: the linear reads them, not x, in its forward.
    linear = _linear("rowwise", "cpu", torch.float32, emulate=True)
    x = torch.randn(4, 64)
    rows = fp8_rows_reference(x, "rowwise_pow2")
    other = rows._replace(scale=rows.scale * 2)
    assert not torch.equal(float8_linear_from_rows(linear, x, other), linear(x))


def test_rows_of_another_mode_fall_back_to_the_linear(monkeypatch):
    linear = _linear("rowwise", "cpu", torch.float32, emulate=True)
    x = torch.randn(4, 64)
    casts = _input_casts(monkeypatch)
    out = float8_linear_from_rows(linear, x, fp8_rows_reference(x, "amax"))
    assert casts == [-1]  # torchao's own cast
    _same(out, linear(x), "fallback output")
    assert input_fp8_mode(torch.nn.Linear(4, 4)) is None


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_bf16_handoff_from_kernels_on_gpu(monkeypatch, recipe):
    # tigon's kernels write the rows (norm, then SwiGLU), torchao's real float8 GEMMs take them.
    torch.manual_seed(0)
    hidden, intermediate = 2048, 8192
    x = torch.randn(4, 512, hidden, device="cuda", dtype=torch.bfloat16)
    norm_weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    mode = RECIPES[recipe]
    normed, rows = F.rms_norm(x, norm_weight, fp8=mode)
    normed = normed.detach().requires_grad_()
    _check_handoff(_linear(recipe, "cuda", torch.bfloat16, False, features=(hidden, intermediate)), normed, rows, monkeypatch)
    gate = torch.randn(4, 512, intermediate, device="cuda", dtype=torch.bfloat16)
    product, rows = F.swiglu(gate, torch.randn_like(gate), fp8=mode)
    product = product.detach().requires_grad_()
    _check_handoff(_linear(recipe, "cuda", torch.bfloat16, False, features=(intermediate, hidden)), product, rows, monkeypatch)
