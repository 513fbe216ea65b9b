"""FP8 rows and weights (tigon.ops.fp8): the quantisation kernel against torch's own e4m3 cast, bit
for bit; the FP8 linear and LoRA on an FP8 base against the dequantised weight's math; on a GPU
with FP8, the torch._scaled_mm GEMMs against the same products formed in fp32."""

import logging

import pytest
import torch

import tigon.functional as F
from tigon.ops import Fp8Weight, LoraProjection, dequantize_fp8, lora_linear_reference, quantize_weight
from tigon.ops import fp8
from tigon.ops.fp8 import (
    FP8_MAX, fp8_gemm_reason, fp8_matmul, fp8_matmul_grad, quantize_rows, quantize_rows_reference,
)
from tests.helpers import assert_close, compare_fwd_bwd
from tests.ops.composite.test_lora import one_cpu_thread  # noqa: F401 (autouse fixture)


def _bits(q):
    return q.view(torch.uint8)


def _assert_same_rows(got, want):
    (q, scale), (ref_q, ref_scale) = got, want
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert torch.equal(_bits(q), _bits(ref_q)), f"{(_bits(q) != _bits(ref_q)).sum()} payloads differ"
    assert torch.equal(scale, ref_scale) or torch.equal(scale.isnan(), ref_scale.isnan())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(7, 40), (5, 97), (3, 1000)])
@pytest.mark.parametrize("with_col_scale", [False, True])
def test_quantize_rows_bit_for_bit(device, dtype, shape, with_col_scale):
    # Rows spanning nine decades, so that payloads land in e4m3's subnormals as well as its normals.
    x = (torch.randn(shape, device=device) * torch.logspace(-4, 4, shape[0], device=device)[:, None]).to(dtype)
    col_scale = torch.rand(shape[1], device=device) * 3 + 0.01 if with_col_scale else None
    got = quantize_rows(x, col_scale)
    _assert_same_rows(got, quantize_rows_reference(x, col_scale))
    q, scale = got
    # The payload is the row over its scale, to e4m3's precision.
    want = x.float() * (col_scale if with_col_scale else 1)
    assert_close(q.float() * scale[:, None], want, tol=0.07, name="dequantised rows")
    assert (q.float().abs().amax(1) == FP8_MAX).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("in_place", [False, True])
def test_glu_gradient_rows_with_column_scales_are_quantize_rows(device, dtype, in_place):
    """The SwiGLU backward kernel's FP8 rows of d gate and d up, each times its column scales (an
    FP8 weight's row scales), are what quantize_rows makes of the returned gradients with those
    scales, bit for bit (as rows_operand hands them to the input-gradient GEMM); the bf16
    gradients themselves are not scaled. A NaN row stays NaN."""
    from tigon.ops._fp8 import fp8_rows_buffers
    from tigon.ops.glu import glu_backward

    gate, up = (torch.randn(9, 300, device=device, dtype=dtype) * 3 for _ in range(2))
    grad_out = torch.randn(9, 300, device=device, dtype=dtype)
    grad_out[4, 7] = float("nan")
    scales = [torch.rand(300, device=device) / 100 + 1e-4 for _ in range(2)]
    want_gate, want_up, _ = glu_backward(grad_out, gate.clone(), up.clone(), "silu", False, False)
    buffers = (fp8_rows_buffers(gate, "rowwise"), fp8_rows_buffers(gate, "rowwise"))
    grad_gate, grad_up, _ = glu_backward(grad_out, gate, up, "silu", False, in_place, fp8="rowwise",
                                         fp8_grads=buffers, fp8_column_scales=tuple(scales))
    for grad, want, rows, scale in zip((grad_gate, grad_up), (want_gate, want_up), buffers, scales):
        assert torch.equal(grad.nan_to_num(), want.nan_to_num()) and torch.equal(grad.isnan(), want.isnan())
        q, row_scale = fp8.rows_operand(rows)
        want_q, want_scale = quantize_rows(grad, scale)
        finite = ~want_scale.isnan()
        assert not finite[4] and row_scale[4].isnan()
        _assert_same_rows((q[finite], row_scale[finite]), (want_q[finite], want_scale[finite]))


def test_quantize_rows_rounds_half_to_even_and_subnormals(device):
    """A row whose absmax is 448 is its own payload (scale 1): every midpoint between two e4m3
    values, normal and subnormal, rounds as torch's cast rounds it (half to even)."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn).float()
    mids = (codes[:-1] + codes[1:]) / 2
    x = torch.cat([mids, -mids, codes, torch.tensor([FP8_MAX], device=device)]).view(1, -1)
    q, scale = quantize_rows(x)
    assert scale.item() == 1.0
    assert torch.equal(_bits(q), _bits(x.to(torch.float8_e4m3fn)))


def test_quantize_rows_nonfinite_and_zero_rows(device):
    x = torch.randn(4, 48, device=device)
    x[1, 5] = float("nan")
    x[2, 0] = float("inf")
    x[3] = 0.0
    x[3, 1] = -0.0
    q, scale = quantize_rows(x)
    _assert_same_rows((q, scale), quantize_rows_reference(x))
    assert scale[1].isnan() and q[1].float().isnan().all()  # NaN in, NaN out: the whole row
    assert scale[2].isinf() and q[2, 0].float().isnan()
    assert (q[3].float() == 0).all() and scale[3] > 0  # zeros stay zeros: no 0/0


def test_quantize_rows_checks(device):
    x = torch.randn(3, 32, device=device)
    with pytest.raises(ValueError, match="col_scale"):
        quantize_rows(x, torch.ones(31, device=device))
    with pytest.raises(ValueError, match="unit stride"):
        quantize_rows(x.t())


@pytest.mark.parametrize("shape", [(1, 1), (5, 200), (130, 7), (257, 300)])
def test_transpose_bytes_bit_for_bit(device, shape):
    """The input gradient's weight transpose: every payload byte (NaN codes included) lands at its
    transposed place, partial tiles on both sides, into a fresh tensor and into a poisoned `out`."""
    data = torch.randint(0, 256, shape, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    want = data.view(torch.uint8).t().contiguous()
    assert torch.equal(fp8.transpose_bytes(data).view(torch.uint8), want)
    out = torch.full((shape[1], shape[0]), 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    assert fp8.transpose_bytes(data, out) is out
    assert torch.equal(out.view(torch.uint8), want)


def test_transpose_bytes_checks(device):
    data = torch.zeros(4, 6, dtype=torch.float8_e4m3fn, device=device)
    with pytest.raises(ValueError, match="one-byte elements"):
        fp8.transpose_bytes(torch.zeros(4, 6, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        fp8.transpose_bytes(data.t())
    with pytest.raises(ValueError, match="2-D"):
        fp8.transpose_bytes(data.view(-1))
    with pytest.raises(ValueError, match=r"out must be a contiguous .*\(6, 4\)"):
        fp8.transpose_bytes(data, torch.zeros(4, 6, dtype=torch.float8_e4m3fn, device=device))


def test_dequantize_fp8_blocks():
    """Block scales as HF's checkpoints lay them out: one per (bo, bi) block, the last ones partial."""
    data = torch.randn(10, 19).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 3) + 0.5
    weight = Fp8Weight(data, scale, (4, 8))
    want = torch.empty(10, 19)
    for r in range(10):
        for c in range(19):
            want[r, c] = data[r, c].float() * scale[r // 4, c // 8]
    assert torch.equal(dequantize_fp8(weight, torch.float32), want)
    rowwise = quantize_weight(torch.randn(6, 40))
    assert rowwise.rowwise and rowwise.scale.shape == (6, 1) and not weight.rowwise


def _weight(out_features, in_features, device, block=None):
    if block is None:
        return quantize_weight(torch.randn(out_features, in_features, device=device) / in_features**0.5)
    blocks = (-(-out_features // block[0]), -(-in_features // block[1]))
    # Clamped: e4m3fn has no inf, and torch's cast makes a value past 448 NaN.
    data = (torch.randn(out_features, in_features, device=device) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    return Fp8Weight(data, torch.rand(blocks, device=device) / 1000 + 1e-4, block)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("block", [None, (16, 32)])
def test_fp8_linear_matches_dequantised_linear(poison_outputs, device, bias, block):
    weight = _weight(48, 64, device, block)
    x = torch.randn(3, 5, 64, device=device, requires_grad=True)
    b = torch.randn(48, device=device, requires_grad=True) if bias else None
    compare_fwd_bwd(
        lambda x, b: F.fp8_linear(x, weight, b),
        lambda x, b: torch.nn.functional.linear(x, dequantize_fp8(weight, x.dtype), b),
        (x, b), name="fp8_linear",
    )


def test_fp8_linear_checks(device):
    weight = _weight(48, 64, device)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        F.fp8_linear(torch.randn(2, 64, device=device), weight._replace(data=weight.data.float()))
    with pytest.raises(ValueError, match="scale must be a float32 \\(48, 1\\)"):
        F.fp8_linear(torch.randn(2, 64, device=device), weight._replace(scale=weight.scale[:4]))
    with pytest.raises(ValueError, match="shape \\(out, 63\\)"):
        F.fp8_linear(torch.randn(2, 63, device=device), weight)


@pytest.mark.parametrize("dora", [False, True])
@pytest.mark.parametrize("mixed", [False, True])
def test_lora_group_on_fp8_bases_matches_dequantised_math(poison_outputs, device, dora, mixed):
    """q/k/v-like projections (one with a bias) on FP8 bases (`mixed`: the middle one on a plain
    weight, whose input gradient accumulates onto the FP8 ones'): outputs, dx and the adapters'
    gradients equal those of the same LoRA on the dequantised weights."""
    widths = (64, 32, 32)
    weights = [_weight(w, 48, device) for w in widths]
    if mixed:
        weights[1] = dequantize_fp8(weights[1], torch.float32)
    bias = torch.randn(32, device=device)
    x = torch.randn(2, 7, 48, device=device, requires_grad=True)
    adapters = []
    for w in widths:
        adapters += [(torch.randn(4, 48, device=device) / 7).requires_grad_(),
                     (torch.randn(w, 4, device=device) / 2).requires_grad_(),
                     (torch.rand(w, device=device) + 0.5).requires_grad_() if dora else None]

    def projections(base, tensors):
        return [LoraProjection(weight, a, b, 0.75, bias if i == 1 else None, m)
                for i, (weight, (a, b, m)) in enumerate(zip(base, zip(*[iter(tensors)] * 3)))]

    dequantised = [dequantize_fp8(w, torch.float32) if isinstance(w, Fp8Weight) else w for w in weights]
    compare_fwd_bwd(
        lambda x, *t: F.lora_linear_group(x, projections(weights, t)),
        lambda x, *t: [lora_linear_reference(x, *p._replace(bias=None if p.bias is None else p.bias.to(x.dtype)))
                       for p in projections([d.to(x.dtype) for d in dequantised], t)],
        (x, *adapters), name="lora on fp8",
    )


def _gated_mlp_on_fp8_bases(device, dtype):
    """A run of the LoRA gated MLP on FP8 bases: a function returning its output and gradients."""
    hidden, intermediate, rank = 48, 80, 4
    weights = [_weight(intermediate, hidden, device), _weight(intermediate, hidden, device),
               _weight(hidden, intermediate, device)]
    x = torch.randn(3, 11, hidden, device=device, dtype=dtype)
    adapters = [(torch.randn(rank, w.shape[1], device=device) / 7, torch.randn(w.shape[0], rank, device=device) / 2)
                for w in weights]
    grad = torch.randn(3, 11, hidden, device=device, dtype=dtype)

    def run():
        leaves = [x.clone().requires_grad_()] + [t.clone().requires_grad_() for pair in adapters for t in pair]
        projections = [LoraProjection(w, a, b, 0.5, None, None) for w, (a, b) in zip(weights, zip(*[iter(leaves[1:])] * 2))]
        out = F.lora_gated_mlp(leaves[0], *projections)
        out.backward(grad)
        return [out.detach()] + [leaf.grad for leaf in leaves]

    return run


def _spy_quantize_rows(monkeypatch):
    """The shapes of the rows tigon.ops.fp8's GEMMs quantise themselves, as a list filled from now on."""
    shapes, quantize = [], fp8.quantize_rows
    monkeypatch.setattr(fp8, "quantize_rows", lambda t, *args: shapes.append(tuple(t.shape)) or quantize(t, *args))
    return shapes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemms_read_the_activation_kernels_fp8_rows(device, monkeypatch, dtype):
    """The LoRA gated MLP on FP8 bases: the down projection's FP8 GEMM takes h as the activation
    kernel quantised it in its forward pass, and the gate and up input-gradient GEMMs their output
    gradients as its backward pass quantised them (the weights' row scales folded in): no row
    quantisation of those before the GEMMs, and output and every gradient bit for bit those of the
    path that quantises them apart. The FP8 GEMM path is forced on here, on torch's CPU
    ``_scaled_mm`` where there is no GPU (the next test runs it unforced on one)."""
    from tigon.ops.composite import lora as lora_ops, lora_mlp

    for module in (fp8, lora_ops, lora_mlp):
        monkeypatch.setattr(module, "fp8_gemm_reason", lambda x, weight: None)
    handed = []
    real_operand = lora_mlp.rows_operand
    monkeypatch.setattr(lora_mlp, "rows_operand", lambda rows: handed.append(rows) or real_operand(rows))
    run = _gated_mlp_on_fp8_bases(device, dtype)
    quantized = _spy_quantize_rows(monkeypatch)
    try:
        fused = run()
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"torch._scaled_mm does not run here: {err}")
    # The GEMMs quantise only backward's dy of the down projection (33 × 48) themselves.
    assert quantized == [(33, 48)], "h or the gate/up gradients were quantised apart"
    assert len(handed) == 3 and all(rows.data is not None for rows in handed)  # h, then d gate and d up
    # The kernels write bf16 alone.
    monkeypatch.setattr(lora_mlp, "fp8_rows_buffers", lambda like, mode: None)
    monkeypatch.setattr(lora_mlp, "_fp8_output_grad_buffers", lambda gate, gate_proj, up_proj: None)
    quantized.clear()
    apart = run()
    assert quantized == [(33, 80), (33, 48), (33, 80), (33, 80)]  # the path compared against
    for got, want in zip(fused, apart):
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_fp8_rows_from_the_activation_kernel_are_bit_for_bit_on_gpu(monkeypatch):
    """On a GPU with FP8: the gated MLP whose activation kernel quantises h for the down
    projection, and the gate and up gradients for their input-gradient GEMMs, gives the output and
    gradients of the path that quantises them apart, bit for bit."""
    from tigon.ops.composite import lora_mlp

    device = _fp8_gpu()
    torch.manual_seed(0)
    run = _gated_mlp_on_fp8_bases(device, torch.bfloat16)
    quantized = _spy_quantize_rows(monkeypatch)
    fused = run()
    assert quantized == [(33, 48)]  # backward's dy: h and the gate/up gradients were not quantised apart
    # The kernels write bf16 alone.
    monkeypatch.setattr(lora_mlp, "fp8_rows_buffers", lambda like, mode: None)
    monkeypatch.setattr(lora_mlp, "_fp8_output_grad_buffers", lambda gate, gate_proj, up_proj: None)
    quantized.clear()
    apart = run()
    assert quantized == [(33, 80), (33, 48), (33, 80), (33, 80)]
    for got, want in zip(fused, apart):
        assert torch.equal(got, want)


def test_lora_on_fp8_bases_never_waits_for_the_gpu():
    """A forward and backward of the LoRA gated MLP and a q/k/v-like group on FP8 bases queue
    their kernels without one host sync (a sync a layer left the GPU idle while the host caught
    up: the 8B step's forward ran at the host's pace)."""
    from tests.helpers import run_without_host_sync

    device = _fp8_gpu()
    torch.manual_seed(0)
    mlp = _gated_mlp_on_fp8_bases(device, torch.bfloat16)
    weights = [_weight(64, 48, device), _weight(16, 48, device), _weight(16, 48, device)]
    x = torch.randn(33, 48, device=device, dtype=torch.bfloat16, requires_grad=True)
    projections = [LoraProjection(w, torch.randn(4, 48, device=device, requires_grad=True),
                                  torch.randn(w.shape[0], 4, device=device, requires_grad=True), 0.5, None, None)
                   for w in weights]

    def step():
        mlp()
        sum(out.float().sum() for out in F.lora_linear_group(x, projections)).backward()

    run_without_host_sync(step)


def test_cpu_fallback_is_said_once(fresh_dispatch, caplog, device):
    if device.type != "cpu":
        pytest.skip("the CPU's fallback")
    weight = _weight(48, 64, device)
    with caplog.at_level(logging.WARNING, logger="tigon"):
        for _ in range(2):
            fp8_matmul(torch.randn(3, 64), weight)
    lines = [r.getMessage() for r in caplog.records if "fp8_matmul" in r.getMessage()]
    assert lines == ["tigon: fp8_matmul runs its PyTorch reference: tensors are on cpu; FP8 GEMMs need a CUDA GPU "
                     "of compute capability 8.9+"]


def test_scaled_mm_path_math_where_torch_runs_it_on_the_cpu(device):
    """The FP8 GEMM path's operands, layouts and scales (the weight's row scales folded into dy for
    dx) on torch's own CPU ``_scaled_mm`` where this torch has one: the products of the quantised
    operands, formed in fp32."""
    weight = _weight(48, 64, device)
    x = torch.randn(33, 64, device=device, dtype=torch.bfloat16)
    dy = torch.randn(33, 48, device=device, dtype=torch.bfloat16)
    try:
        out = fp8._fp8_matmul(x, weight)
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"torch._scaled_mm does not run here: {err}")
    assert_close(out.float(), _emulated(*quantize_rows_reference(x), weight.data, weight.scale), tol=8e-3, name="x Wᵀ")
    q_dy, s_dy = quantize_rows_reference(dy, weight.scale.view(-1))
    assert_close(fp8._fp8_matmul_grad(dy, weight).float(), (q_dy.float() * s_dy.view(-1, 1)) @ weight.data.float(),
                 tol=8e-3, name="dy W")


# --- on a GPU with FP8 tensor cores --------------------------------------------------------------

def _fp8_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU of compute capability 8.9+")
    return torch.device("cuda")


def _emulated(q_a, scale_a, q_b, scale_b):
    """``(q_a · s_a) (q_b · s_b)ᵀ`` in fp32: the product an FP8 GEMM with rowwise scales forms."""
    return (q_a.float() * scale_a.view(-1, 1)) @ (q_b.float() * scale_b.view(-1, 1)).t()


@pytest.mark.gpu
@pytest.mark.parametrize("rows,out_features,in_features", [(333, 256, 384), (2048, 4096, 4096), (2048, 1024, 4096),
                                                           (2048, 14336, 4096), (2048, 4096, 14336)])
def test_scaled_mm_gemms_match_their_fp32_emulation(rows, out_features, in_features):
    """Forward ``x Wᵀ`` and input gradient ``dy W`` on torch._scaled_mm (8B Llama projection
    shapes among them) against the same quantised operands multiplied in fp32, and within FP8's
    error of the bf16 GEMMs of the dequantised weight."""
    device = _fp8_gpu()
    weight = quantize_weight(torch.randn(out_features, in_features, device=device, dtype=torch.bfloat16) / 50)
    x = torch.randn(rows, in_features, device=device, dtype=torch.bfloat16)
    dy = torch.randn(rows, out_features, device=device, dtype=torch.bfloat16)
    assert fp8_gemm_reason(x, weight) is None

    out = fp8_matmul(x, weight)
    assert_close(out.float(), _emulated(*quantize_rows_reference(x), weight.data, weight.scale), tol=8e-3, name="x Wᵀ")
    q_dy, s_dy = quantize_rows_reference(dy, weight.scale.view(-1))
    want = (q_dy.float() * s_dy.view(-1, 1)) @ weight.data.float()
    grad = fp8_matmul_grad(dy, weight)
    assert_close(grad.float(), want, tol=8e-3, name="dy W")

    dense = dequantize_fp8(weight, torch.bfloat16)
    assert_close(out, x @ dense.t(), tol=0.06, name="against bf16")
    assert_close(grad, dy @ dense, tol=0.06, name="grad against bf16")


@pytest.mark.gpu
def test_quantize_rows_bf16_on_gpu():
    device = _fp8_gpu()
    x = torch.randn(257, 4096, device=device, dtype=torch.bfloat16) * 3
    col_scale = torch.rand(4096, device=device) + 0.1
    for scale in (None, col_scale):
        _assert_same_rows(quantize_rows(x, scale), quantize_rows_reference(x, scale))
