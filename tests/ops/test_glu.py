import pytest
import torch

import tigon.functional as F
from tigon.ops.glu import geglu_reference, glu_mlp_reference, swiglu_reference
from tigon.ops.rms_norm import NormedInput
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


def _mlp_args(tokens, hidden, intermediate, dtype, device, bias):
    def param(*shape):
        return (torch.randn(*shape, dtype=dtype, device=device) / shape[-1] ** 0.5).requires_grad_()

    x = torch.randn(*tokens, hidden, dtype=dtype, device=device, requires_grad=True)
    weights = [param(intermediate, hidden), param(intermediate, hidden), param(hidden, intermediate)]
    biases = [param(intermediate), param(intermediate), param(hidden)] if bias else []
    return x, weights, biases


def _split(params):
    """(gate_w, up_w, down_w[, gate_b, up_b, down_b]) -> the six projection arguments."""
    return (*params[:3], *(params[3:] or (None, None, None)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("bias", [False, True])
def test_glu_mlp_matches_reference(poison_outputs, device, dtype, activation, bias):
    x, weights, biases = _mlp_args((3, 7), 24, 40, dtype, device, bias)
    compare_fwd_bwd(
        lambda x, *p: F.glu_mlp(x, *_split(p), activation=activation),
        lambda x, *p: glu_mlp_reference(x, *_split(p), activation=activation),
        (x, *weights, *biases), name=f"glu_mlp {activation}",
    )


def test_glu_mlp_input_gradient_accumulates_in_place(device, monkeypatch):
    """dx = dgate Wg + dup Wu: the second GEMM accumulates into the first's output; an
    out-of-place addmm would first copy that tokens x hidden tensor."""
    x, weights, _ = _mlp_args((6,), 16, 24, torch.float32, device, False)
    expected = torch.autograd.grad(glu_mlp_reference(x, *weights).sum(), x)[0]
    out = F.glu_mlp(x, *weights)

    def forbidden(*args, **kwargs):
        raise AssertionError("out-of-place addmm in glu_mlp's backward")

    monkeypatch.setattr(torch, "addmm", forbidden)
    out.sum().backward()
    assert_close(x.grad, expected, torch.float32, name="dx")


def test_glu_mlp_frozen_weights_and_input(device):
    x, (wg, wu, wd), _ = _mlp_args((5,), 16, 24, torch.float32, device, False)
    wd.requires_grad_(False)
    x = x.detach()
    F.glu_mlp(x, wg, wu, wd).sum().backward()
    assert wg.grad is not None and wu.grad is not None and wd.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("casting, offset", [("llama", 0.0), ("gemma", 1.0)])
def test_glu_mlp_with_normed_input_keeps_the_source_and_matches_exactly(poison_outputs, device, dtype, casting, offset):
    # x = add_rms_norm(a, r)'s output; with normed_input the MLP saves the sum, not x, and
    # renormalises it in backward: every gradient is bit for bit the one without.
    _, weights, _ = _mlp_args((9,), 24, 40, dtype, device, False)
    a, r = (torch.randn(3, 9, 24, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    norm_weight = torch.randn(24, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn(3, 9, 24, dtype=dtype, device=device)

    def run(with_source):
        leaves = [t.detach().clone().requires_grad_() for t in (a, r, norm_weight, *weights)]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            x, total = F.add_rms_norm(*leaves[:3], 1e-6, offset=offset, casting=casting)
            normed = NormedInput(total, leaves[2], 1e-6, offset, casting) if with_source else None
            out = F.glu_mlp(x, *leaves[3:], normed_input=normed)
        (out * grad).sum().backward()
        saved_x = any(t.data_ptr() == x.data_ptr() for t in saved)
        return out, [leaf.grad for leaf in leaves], saved_x

    out, grads, saved_x = run(True)
    want_out, want_grads, want_saved_x = run(False)
    assert want_saved_x and not saved_x
    assert torch.equal(out, want_out)
    for got, want in zip(grads, want_grads):
        assert torch.equal(got, want)


def test_glu_mlp_normed_input_bad_arguments():
    x, weights, _ = _mlp_args((4,), 8, 12, torch.float32, torch.device("cpu"), False)
    with pytest.raises(ValueError, match="normed_input must be a tigon.ops.rms_norm.NormedInput"):
        F.glu_mlp(x, *weights, normed_input=(x, torch.ones(8), 1e-6, 0.0, "llama"))
    with pytest.raises(ValueError, match=r"normed_input.source must have x's shape \(4, 8\)"):
        F.glu_mlp(x, *weights, normed_input=NormedInput(torch.ones(5, 8), torch.ones(8), 1e-6, 0.0, "llama"))
    with pytest.raises(ValueError, match=r"normed_input.weight must have shape \(8,\)"):
        F.glu_mlp(x, *weights, normed_input=NormedInput(torch.ones(4, 8), torch.ones(7), 1e-6, 0.0, "llama"))


def test_glu_mlp_second_backward_through_retained_graph_fails_loudly(device):
    # The backward writes its gradients over the saved gate and up: a second pass must not read them.
    x, weights, _ = _mlp_args((5,), 16, 24, torch.float32, device, False)
    out = F.glu_mlp(x, *weights)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: F.glu_mlp(torch.randn(2, 8), torch.randn(6, 7), torch.randn(6, 8), torch.randn(8, 6)),
         r"gate_weight must have shape \(intermediate, 8\)"),
        (lambda: F.glu_mlp(torch.randn(2, 8), torch.randn(6, 8), torch.randn(5, 8), torch.randn(8, 6)),
         r"up_weight must have shape \(6, 8\)"),
        (lambda: F.glu_mlp(torch.randn(2, 8), torch.randn(6, 8), torch.randn(6, 8), torch.randn(6, 8)),
         r"down_weight must have shape \(8, 6\)"),
        (lambda: F.glu_mlp(torch.randn(2, 8), torch.randn(6, 8), torch.randn(6, 8), torch.randn(8, 6),
                           down_bias=torch.randn(6)), r"down_bias must have shape \(8,\)"),
        (lambda: F.glu_mlp(torch.randn(2, 8), torch.randn(6, 8), torch.randn(6, 8), torch.randn(8, 6),
                           activation="relu"), "activation must be one of"),
    ],
)
def test_glu_mlp_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", [None, "tanh", "none"], ids=["swiglu", "geglu-tanh", "geglu-erf"])
@pytest.mark.parametrize("shape", [(16384, 14336), (3, 2049, 11008)])
def test_bf16_on_gpu(approximate, shape):
    gate, up = _pair(shape, torch.bfloat16, torch.device("cuda"))
    compare_fwd_bwd(_tigon_glu(approximate), _torch_glu(approximate), (gate, up), torch.bfloat16, name="bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_glu_mlp_bf16_on_gpu(activation):
    x, weights, _ = _mlp_args((2, 1024), 2048, 8192, torch.bfloat16, torch.device("cuda"), False)
    compare_fwd_bwd(
        lambda *a: F.glu_mlp(*a, activation=activation),
        lambda *a: glu_mlp_reference(*a, activation=activation),
        (x, *weights), torch.bfloat16, name="glu_mlp bf16",
    )


@pytest.mark.gpu
def test_glu_mlp_backward_allocates_one_intermediate_sized_buffer_on_gpu():
    # The training step's peak is the last layer's MLP backward: gradients of gate and up and the
    # recomputed product reuse the saved buffers, so only dh is new.
    n, hidden, intermediate = 8192, 2048, 8192
    x, weights, _ = _mlp_args((n,), hidden, intermediate, torch.bfloat16, torch.device("cuda"), False)
    out = F.glu_mlp(x, *weights)
    grad = torch.randn_like(out)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out.backward(grad)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    returned = (3 * intermediate * hidden + n * hidden) * 2  # three weight gradients and dx
    assert extra <= returned + n * intermediate * 2 + 2**22, (extra - returned) / 2**20


@pytest.mark.gpu
def test_glu_mlp_under_autocast_on_gpu():
    x, weights, biases = _mlp_args((4, 256), 512, 1376, torch.float32, torch.device("cuda"), True)
    args = (x, *weights, *biases)
    ours = [a.detach().clone().requires_grad_() for a in args]
    theirs = [a.detach().clone().requires_grad_() for a in args]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = F.glu_mlp(*ours)
        ref = glu_mlp_reference(*theirs)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert_close(out, ref, torch.bfloat16, name="autocast output")
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.grad.dtype == torch.float32
        assert_close(a.grad, b.grad, torch.bfloat16, name=f"autocast grad {i}")


@pytest.mark.gpu
def test_int64_offsets_on_gpu():
    # Strided (non-flat) path with row * stride past 2**31 in the last rows.
    rows, cols = 2**31 // 8192 + 3, 4096
    fused = torch.randn(rows, 2 * cols, dtype=torch.bfloat16, device="cuda")
    gate, up = fused[:, :cols], fused[:, cols:]
    out = F.swiglu(gate, up)
    assert_close(out[-5:], swiglu_reference(gate[-5:], up[-5:]), name="tail rows")
