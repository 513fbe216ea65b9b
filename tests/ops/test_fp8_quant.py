"""The fused FP8 quantisation of rms_norm / add_rms_norm / swiglu (forward) and of the SwiGLU
gradients (glu_backward): against torchao.float8's own rowwise quantisation of the op's output.

Scales, amaxes and e4m3 payloads are compared everywhere (under Triton's interpreter, whose own
fp32 to float8e4nv cast rounds otherwise, the kernels round the payload on its bits).
"""

import pytest
import torch

import tigon.functional as F
from tigon.ops import fp8_rows_reference
from tigon.ops._fp8 import fp8_rows_buffers
from tigon.ops.fp8 import quantize_rows, rows_operand
from tigon.ops.glu import glu_backward

ao_scaling = pytest.importorskip("torchao.float8.float8_scaling_utils")
from torchao.float8.config import ScalingGranularity  # noqa: E402
from torchao.float8.float8_training_tensor import LinearMMConfig  # noqa: E402

ROWWISE = ["rowwise", "rowwise_pow2"]


def _torchao_rows(hp: torch.Tensor, mode: str):
    """torchao's cast of `hp` for a Float8Linear input with rowwise scaling: (payload, scale)."""
    t = ao_scaling.hp_tensor_to_float8_dynamic(
        hp.detach(), torch.float8_e4m3fn, LinearMMConfig(), scaling_granularity=ScalingGranularity.AXISWISE,
        axiswise_dim=-1, round_scales_to_power_of_2=mode == "rowwise_pow2",
    )
    return t._data, t._scale


def _assert_same_floats(ours, theirs, name):
    """Bit-equal, NaN where NaN (a NaN's bits differ between CPUs and GPUs)."""
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, name
    nan = theirs.isnan()
    assert torch.equal(ours.isnan(), nan), f"{name}: NaN in other places"
    bits = {2: torch.int16, 4: torch.int32}[ours.element_size()]
    assert torch.equal(ours[~nan].view(bits), theirs[~nan].view(bits)), f"{name} differs"


def _assert_same_payload(ours, theirs, name):
    bits, want = ours.view(torch.uint8), theirs.view(torch.uint8)
    nan = (want & 0x7F) == 0x7F
    assert torch.equal((bits & 0x7F) == 0x7F, nan), f"{name}: NaN in other places"
    mismatch = (bits != want) & ~nan
    assert not mismatch.any(), f"{name}: {int(mismatch.sum())} payload bytes differ, first at {mismatch.nonzero()[0].tolist()}"


def _check_rows(hp, rows, mode, name, payload):
    """`rows` is torchao's quantisation of the op's own output `hp`."""
    data, scale = _torchao_rows(hp, mode)
    _assert_same_floats(rows.scale, scale, f"{name} scale")
    _assert_same_floats(rows.amax, hp.detach().float().abs().amax(-1, keepdim=True), f"{name} amax")
    if payload:
        _assert_same_payload(rows.data, data, f"{name} payload")


def _planted_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` (rows, width) with a NaN row, an inf row (one element), an all-zero row; the others random."""
    t = t.clone()
    t[1, 2] = float("nan")
    t[2, 0] = float("inf")
    t[3] = 0
    return t


def _norm_case(dtype, device, width, residual):
    x = _planted_rows(3 * torch.randn(6, width, device=device)).to(dtype)
    w = torch.randn(width, device=device).to(dtype)
    r = torch.randn(6, width, device=device).to(dtype) if residual else None
    return x, r, w


def _norm(x, r, w, casting, fp8):
    if r is None:
        return F.rms_norm(x, w, 1e-6, casting=casting, fp8=fp8)
    out, _, rows = F.add_rms_norm(x, r, w, 1e-6, casting=casting, fp8=fp8)
    return out, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ROWWISE)
@pytest.mark.parametrize("casting", ["llama", "gemma"])
@pytest.mark.parametrize("residual", [False, True], ids=["rms_norm", "add_rms_norm"])
def test_norm_scales_match_torchao(poison_outputs, device, dtype, mode, casting, residual):
    x, r, w = _norm_case(dtype, device, 37, residual)
    out, rows = _norm(x, r, w, casting, mode)
    _check_rows(out, rows, mode, "norm", payload=True)
    # The option changes nothing else.
    plain = F.rms_norm(x, w, 1e-6, casting=casting) if r is None else F.add_rms_norm(x, r, w, 1e-6, casting=casting)[0]
    _assert_same_floats(out, plain, "normed output")
    assert rows.data.dtype == torch.float8_e4m3fn and rows.scale.shape == (6, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norm_amax_mode_writes_only_amax(poison_outputs, device, dtype):
    x, r, w = _norm_case(dtype, device, 300, False)
    out, rows = F.rms_norm(x, w, fp8="amax")
    assert rows.data is None and rows.scale is None
    _assert_same_floats(rows.amax, out.float().abs().amax(-1, keepdim=True), "amax")


def test_tiny_rows_take_torchao_eps_scale(device):
    # A row whose amax is below torchao's EPS (1e-12) gets the scale of 1e-12; one just above, its own.
    w = torch.full((40,), 1e-13, device=device)
    w[::2] = 3e-12
    x = torch.randn(4, 40, device=device)
    for weight in (w, w * 1e-3):
        out, rows = F.rms_norm(x, weight, fp8="rowwise")
        _check_rows(out, rows, "rowwise", "tiny rows", payload=True)


def _glu_case(dtype, device, width):
    gate = _planted_rows(2 * torch.randn(6, width, device=device)).to(dtype)
    up = torch.randn(6, width, device=device).to(dtype)
    up[4] = 0  # an all-zero row of the product
    return gate, up


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ROWWISE)
@pytest.mark.parametrize("width", [37, 300])
def test_swiglu_scales_match_torchao(poison_outputs, device, dtype, mode, width):
    gate, up = _glu_case(dtype, device, width)
    gate.requires_grad_()
    out, rows = F.swiglu(gate, up, fp8=mode)
    _check_rows(out, rows, mode, "swiglu", payload=True)
    _assert_same_floats(out, F.swiglu(gate, up), "swiglu output")
    # The output still carries the gradient; the quantised rows do not.
    assert out.requires_grad and not rows.data.requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ROWWISE)
@pytest.mark.parametrize("in_place", [False, True])
def test_swiglu_gradients_scales_match_torchao(poison_outputs, device, dtype, mode, in_place):
    gate, up = _glu_case(dtype, device, 37)
    grad_out = torch.randn_like(gate)
    want_gate, want_up, _ = glu_backward(grad_out, gate.clone(), up.clone(), "silu", False, False)
    buffers = (fp8_rows_buffers(gate, mode), fp8_rows_buffers(gate, mode))
    grad_gate, grad_up, _ = glu_backward(grad_out, gate, up, "silu", False, in_place, fp8=mode, fp8_grads=buffers)
    for grad, want, rows, name in ((grad_gate, want_gate, buffers[0], "d gate"), (grad_up, want_up, buffers[1], "d up")):
        _assert_same_floats(grad, want, name)
        _check_rows(grad, rows, mode, name, payload=True)


def test_gradients_unchanged_by_fp8(device):
    x, r, w = _norm_case(torch.float32, device, 37, True)
    x, r, w = (t.clone().requires_grad_() for t in (x, r, w))
    for fp8 in (None, "rowwise_pow2"):
        outs = F.add_rms_norm(x, r, w, fp8=fp8)
        grads = torch.autograd.grad(outs[0].nan_to_num().sum() + outs[1].nan_to_num().sum(), (x, r, w))
        if fp8 is None:
            want = grads
    for got, expected in zip(grads, want):
        _assert_same_floats(got, expected, "gradient")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ROWWISE)
def test_reference_is_torchao_bit_for_bit(dtype, mode):
    # The oracle of the kernels' payload on the CPU, and the ops' fallback: rows over 60 decades,
    # NaN, inf, -inf, zero and sub-EPS rows.
    values = torch.randn(64, 999) * torch.logspace(-30, 30, 64)[:, None]
    values = _planted_rows(values)
    values[5, :3] = -float("inf")
    values[6] = 1e-13
    values = values.to(dtype)
    rows = fp8_rows_reference(values, mode)
    data, scale = _torchao_rows(values, mode)
    _assert_same_floats(rows.scale, scale, "scale")
    _assert_same_payload(rows.data, data, "payload")


def test_reference_path_gives_the_rows(monkeypatch):
    # TIGON_DISABLE (or a device without kernels) runs the reference, which returns the same shape of answer.
    monkeypatch.setenv("TIGON_DISABLE", "rms_norm,swiglu")
    x = torch.randn(5, 33)
    out, rows = F.rms_norm(x, None, fp8="rowwise")
    _check_rows(out, rows, "rowwise", "reference rms_norm", payload=True)
    out, rows = F.swiglu(x, x.flip(0), fp8="rowwise_pow2")
    _check_rows(out, rows, "rowwise_pow2", "reference swiglu", payload=True)


@pytest.mark.parametrize("call", [
    lambda x: F.rms_norm(x, None, fp8="tensorwise"),
    lambda x: F.swiglu(x, x, fp8="e4m3"),
])
def test_bad_fp8_mode_raises(call):
    with pytest.raises(ValueError, match="fp8 must be None or one of 'rowwise', 'rowwise_pow2', 'amax'"):
        call(torch.randn(2, 8))


# The GPU: every payload byte, in bf16 at the 1B/8B shapes and in the inputs' fp32/fp16.
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ROWWISE)
@pytest.mark.parametrize("hidden", [2048, 4096])
@pytest.mark.parametrize("residual", [False, True], ids=["rms_norm", "add_rms_norm"])
def test_bf16_norm_payload_on_gpu(mode, hidden, residual):
    x, r, w = _norm_case(torch.bfloat16, torch.device("cuda"), hidden, residual)
    x = torch.cat([x, torch.randn(4 * 2048, hidden, device="cuda", dtype=torch.bfloat16)])
    r = None if r is None else torch.cat([r, torch.randn_like(x[6:])])
    out, rows = _norm(x, r, w, "llama", mode)
    _check_rows(out, rows, mode, "bf16 norm", payload=True)
    if mode == "rowwise":  # what an FP8-base GEMM takes: the same as quantising the output apart
        data, scale = rows_operand(rows)
        want_data, want_scale = quantize_rows(out.view(-1, hidden))
        _assert_same_payload(data, want_data, "rows against quantize_rows")
        _assert_same_floats(scale, want_scale, "row scales against quantize_rows")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ROWWISE)
@pytest.mark.parametrize("intermediate", [8192, 14336])
def test_bf16_swiglu_payload_on_gpu(mode, intermediate):
    gate, up = _glu_case(torch.bfloat16, torch.device("cuda"), intermediate)
    gate = torch.cat([gate, 2 * torch.randn(2048, intermediate, device="cuda", dtype=torch.bfloat16)])
    up = torch.cat([up, torch.randn_like(gate[6:])])
    out, rows = F.swiglu(gate, up, fp8=mode)
    _check_rows(out, rows, mode, "bf16 swiglu", payload=True)
    buffers = (fp8_rows_buffers(gate, mode), fp8_rows_buffers(gate, mode))
    grad_gate, grad_up, _ = glu_backward(torch.randn_like(gate), gate, up, "silu", False, True, fp8=mode, fp8_grads=buffers)
    _check_rows(grad_gate, buffers[0], mode, "bf16 d gate", payload=True)
    _check_rows(grad_up, buffers[1], mode, "bf16 d up", payload=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_payload_on_gpu(dtype):
    cuda = torch.device("cuda")
    x, r, w = _norm_case(dtype, cuda, 4099, True)
    for mode in ROWWISE:
        _check_rows(*_norm(x, r, w, "gemma", mode), mode, "norm", payload=True)
        _check_rows(*F.swiglu(*_glu_case(dtype, cuda, 4099), fp8=mode), mode, "swiglu", payload=True)


@pytest.mark.gpu
def test_bf16_compiled_option_on_gpu():
    # Inside torch.compile the option runs the reference, which inductor compiles: still torchao's cast.
    cuda = torch.device("cuda")
    x, r, w = _norm_case(torch.bfloat16, cuda, 2048, True)
    gate, up = _glu_case(torch.bfloat16, cuda, 8192)
    norm = torch.compile(lambda x, r, w: F.add_rms_norm(x, r, w, fp8="rowwise_pow2"), fullgraph=True)
    glu = torch.compile(lambda gate, up: F.swiglu(gate, up, fp8="rowwise_pow2"), fullgraph=True)
    out, _, rows = norm(x, r, w)
    _check_compiled_rows(out, rows, "compiled add_rms_norm")
    _check_compiled_rows(*glu(gate, up), "compiled swiglu")


def _check_compiled_rows(hp, rows, name):
    """Inductor takes the amax of the unrounded output (it elides the rounding to bf16 before the
    reduction), so the amax is within one bf16 rounding of the output's, the scale is the
    power-of-two scale of that amax, and each payload value is within e4m3's rounding of the output."""
    ok = hp.isfinite().all(-1)  # (the planted NaN / inf rows are the eager tests' business)
    hp, amax, scale, data = hp.detach().float()[ok], rows.amax[ok], rows.scale[ok], rows.data[ok].float()
    torch.testing.assert_close(amax, hp.abs().amax(-1, keepdim=True), rtol=2**-8, atol=0, msg=f"{name} amax")
    want_scale = torch.exp2(torch.floor(torch.log2(448.0 / amax.double().clamp_min(1e-12)))).float()
    assert torch.equal(scale, want_scale), f"{name} scale"
    # e4m3 keeps 3 mantissa bits (a relative half-step of 2^-4) and steps of 2^-9 / scale below
    # its normals; the payload was cast from the unrounded value (one more bf16 rounding, 2^-8).
    bound = hp.abs() * (2**-4 + 2**-8) + 2**-10 / scale
    assert ((data / scale - hp).abs() <= bound).all(), f"{name} payload"
