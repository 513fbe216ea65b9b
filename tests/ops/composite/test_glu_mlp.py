import pytest
import torch

import tigon.functional as F
from tigon.ops import NormedInput, glu_mlp_reference
from tests.helpers import assert_close, compare_fwd_bwd


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias, with_source", [(False, False), (True, True)])
def test_glu_mlp_recompute_keeps_neither_gate_nor_up_and_gives_the_same_numbers(device, dtype, bias, with_source):
    """recompute=True: backward forms gate and up again; outputs and every gradient equal the
    default's bit for bit (also where x is renormalised from its norm's source)."""
    tokens, hidden, intermediate = 9, 24, 40
    x, weights, biases = _mlp_args((tokens,), hidden, intermediate, dtype, device, bias)
    norm_weight = torch.randn(hidden, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn(tokens, hidden, dtype=dtype, device=device)
    results = []
    for recompute in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (x, norm_weight, *weights, *biases)]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            if with_source:
                normed, total = F.add_rms_norm(leaves[0], torch.zeros_like(leaves[0]), leaves[1], 1e-6)
                source = NormedInput(total, leaves[1], 1e-6, 0.0, "llama")
            else:
                normed, source = leaves[0], None
            out = F.glu_mlp(normed, *_split(leaves[2:]), normed_input=source, recompute=recompute)
        (out * grad).sum().backward()
        intermediates = [t for t in saved if t.shape[-1:] == (intermediate,) and t.numel() == tokens * intermediate]
        assert len(intermediates) == (0 if recompute else 2)
        results.append([out, *(leaf.grad for leaf in leaves if leaf.grad is not None)])
    for default, recomputed in zip(*results, strict=True):
        assert torch.equal(default, recomputed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("op", ["glu_mlp", "add_rms_norm_glu_mlp"])
def test_a_discarded_output_is_nan_and_the_gradients_are_the_same(device, dtype, recompute, op):
    """output_discarded=True (a checkpointed layer's replay) forms only what the op keeps: the MLP's
    output is NaN; what is saved and every gradient equal the default's, bit for bit; the
    add_rms_norm_glu_mlp sum is formed as ever."""
    tokens, hidden, intermediate = 11, 24, 40
    x, weights, biases = _mlp_args((tokens,), hidden, intermediate, dtype, device, True)
    residual = torch.randn_like(x)
    norm_weight = torch.randn(hidden, dtype=dtype, device=device)
    grad = torch.randn(tokens, hidden, dtype=dtype, device=device)
    results, saved_shapes = [], []
    for discarded in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (x, residual, norm_weight, *weights, *biases)]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            if op == "glu_mlp":
                outs = (F.glu_mlp(leaves[0], *_split(leaves[3:]), recompute=recompute, output_discarded=discarded),)
            else:
                outs = F.add_rms_norm_glu_mlp(leaves[0], leaves[1], leaves[2], 1e-6, *_split(leaves[3:]),
                                              recompute=recompute, output_discarded=discarded)
        saved_shapes.append([tuple(t.shape) for t in saved])
        torch.autograd.backward(outs, [grad] * len(outs))
        results.append((outs, [leaf.grad for leaf in leaves if leaf.grad is not None]))
    (outs, grads), (discarded_outs, discarded_grads) = results
    assert not outs[0].isnan().any() and discarded_outs[0].isnan().all()
    assert discarded_outs[0].dtype == outs[0].dtype and discarded_outs[0].shape == outs[0].shape
    assert all(torch.equal(a, b) for a, b in zip(outs[1:], discarded_outs[1:]))
    assert saved_shapes[0] == saved_shapes[1]
    assert len(grads) == len(discarded_grads)
    for default, skipped in zip(grads, discarded_grads):
        assert torch.equal(default, skipped)


def test_glu_mlp_normed_input_bad_arguments():
    x, weights, _ = _mlp_args((4,), 8, 12, torch.float32, torch.device("cpu"), False)
    with pytest.raises(ValueError, match="normed_input must be a tigon.ops.NormedInput"):
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
