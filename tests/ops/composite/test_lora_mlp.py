import pytest
import torch

import tigon.functional as F
from tigon.ops import NormedInput
from tigon.ops.composite.lora import LoraProjection, lora_linear_group, restore_projections, saved_tensors
from tigon.ops.composite.lora_mlp import lora_gated_mlp, lora_gated_mlp_reference
from tests.helpers import assert_close, compare_fwd_bwd
from tests.ops.composite.test_lora import _float32_adapters, _graph_node_names, _projection, one_cpu_thread  # noqa: F401 (autouse fixture)

ACTIVATIONS = ["silu", "gelu_tanh", "gelu"]


def _mlp(hidden, intermediate, ranks, dtype, device, **kwargs):
    gate = _projection(hidden, intermediate, ranks[0], dtype, device, **kwargs)
    up = _projection(hidden, intermediate, ranks[1], dtype, device, **kwargs)
    down = _projection(intermediate, hidden, ranks[2], dtype, device, **kwargs)
    return gate, up, down


def _check_mlp(x, projections, activation, dtype=None, recompute=False):
    fields = saved_tensors(projections)
    scalings = [p.scaling for p in projections]

    def regroup(tensors):
        return restore_projections(tensors, scalings)

    def flat(tensors):
        return [v for p in regroup(tensors) for v in p]

    compare_fwd_bwd(
        lambda x, *t: lora_gated_mlp(x, *regroup(t), activation=activation, recompute=recompute),
        lambda x, *t: lora_gated_mlp_reference(x, activation, *flat(t)),
        (x, *fields), dtype, name=f"lora_gated_mlp {activation}",
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("rank", [1, 8, 64])
def test_matches_reference(poison_outputs, device, dtype, activation, rank):
    x = torch.randn(3, 11, 37, dtype=dtype, device=device, requires_grad=True)
    _check_mlp(x, _mlp(37, 91, (rank, rank, rank), dtype, device), activation)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("trainable_base", [False, True])
def test_bias_and_trainable_base(poison_outputs, device, bias, trainable_base):
    x = torch.randn(2, 9, 40, device=device, requires_grad=True)
    projections = _mlp(40, 72, (4, 6, 2), torch.float32, device, bias=bias, trainable_base=trainable_base)
    _check_mlp(x, projections, "silu")


def test_float32_adapters_on_half_input(poison_outputs, device):
    x = torch.randn(2, 5, 24, dtype=torch.float16, device=device, requires_grad=True)
    projections = [_float32_adapters(p) for p in _mlp(24, 40, (3, 5, 2), torch.float16, device)]
    _check_mlp(x, projections, "silu", torch.float16)
    out = lora_gated_mlp(x, *projections)
    assert out.dtype == torch.float16 and "ToCopyBackward0" not in _graph_node_names(out)
    out.float().sum().backward()
    assert all(t.grad.dtype == torch.float32 for p in projections for t in (p.lora_a, p.lora_b))


def test_frozen_input_and_down_adapter(poison_outputs, device):
    # Nothing needs h in backward: the activation's backward skips recomputing it.
    x = torch.randn(7, 24, device=device)
    gate, up, down = _mlp(24, 50, (3, 3, 3), torch.float32, device)
    down.lora_a.requires_grad_(False)
    down.lora_b.requires_grad_(False)
    out = lora_gated_mlp(x, gate, up, down)
    grads = torch.autograd.grad(out, (gate.lora_a, up.lora_b), torch.ones_like(out))
    # The oracle in float64: two float32 summation orders differ by more than assert_close's
    # elementwise default on the odd element of a fresh draw.
    gate64, up64, down64 = (p._replace(**{f: t.detach().double().requires_grad_(t.requires_grad) for f, t in
                                          p._asdict().items() if isinstance(t, torch.Tensor)}) for p in (gate, up, down))
    ref = lora_gated_mlp_reference(x.double(), "silu", *gate64, *up64, *down64)
    want = torch.autograd.grad(ref, (gate64.lora_a, up64.lora_b), torch.ones_like(ref))
    for name, g, w in zip(("gate lora_a", "up lora_b"), grads, want):
        assert_close(g, w.float(), torch.float32, name)


def test_second_backward_through_retained_graph_fails_loudly(device):
    x = torch.randn(6, 24, device=device, requires_grad=True)
    out = lora_gated_mlp(x, *_mlp(24, 50, (3, 3, 3), torch.float32, device))
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_saves_only_x_gate_up_and_rank_sized_products(device):
    n, hidden, intermediate = 30, 24, 50
    x = torch.randn(n, hidden, device=device, requires_grad=True)
    projections = _mlp(hidden, intermediate, (3, 5, 2), torch.float32, device)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lora_gated_mlp(x, *projections)
    activations = sorted(tuple(t.shape) for t in saved if t.shape[:1] == (n,))
    assert activations == sorted([(n, hidden), (n, intermediate), (n, intermediate), (n, 3 + 5), (n, 2)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_recompute_matches_reference(poison_outputs, device, dtype, bias):
    x = torch.randn(2, 13, 40, dtype=dtype, device=device, requires_grad=True)
    _check_mlp(x, _mlp(40, 72, (4, 6, 2), dtype, device, bias=bias, trainable_base=bias), "gelu_tanh", recompute=True)


def test_recompute_keeps_no_gate_or_up_and_gives_the_same_numbers(device):
    """recompute=True saves only x and the rank-sized products, and backward's gate and up, formed
    again, are the forward's: outputs and every gradient equal those of the default, bit for bit."""
    n, hidden, intermediate = 30, 24, 50
    projections = _mlp(hidden, intermediate, (3, 5, 2), torch.float16, device)
    leaves = [t for p in projections for t in (p.lora_a, p.lora_b)]
    x = torch.randn(n, hidden, dtype=torch.float16, device=device, requires_grad=True)
    grad = torch.randn(n, hidden, dtype=torch.float16, device=device)
    results = []
    for recompute in (False, True):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = lora_gated_mlp(x, *projections, recompute=recompute)
        results.append((out, *torch.autograd.grad(out, [x, *leaves], grad)))
        activations = sorted(tuple(t.shape) for t in saved if t.shape[:1] == (n,))
        kept = [(n, intermediate), (n, intermediate)] if not recompute else []
        assert activations == sorted([(n, hidden), (n, 3 + 5), (n, 2), *kept])
    for default, recomputed in zip(*results):
        assert torch.equal(default, recomputed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("trainable_base", [False, True])
def test_a_discarded_output_is_nan_and_the_gradients_are_the_same(device, dtype, trainable_base):
    """output_discarded=True (a checkpointed layer's replay) skips the down projection's output:
    the output is NaN, what the op saves and every gradient equal the default's, bit for bit. A
    DoRA down projection, which saves its output's z, still forms it."""
    n, hidden, intermediate = 21, 24, 50
    projections = _mlp(hidden, intermediate, (3, 5, 2), dtype, device, bias=True, trainable_base=trainable_base)
    leaves = [t for p in projections for t in (p.weight, p.lora_a, p.lora_b, p.bias) if t.requires_grad]
    x = torch.randn(n, hidden, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn(n, hidden, dtype=dtype, device=device)
    results, saved_shapes = [], []
    for discarded in (False, True):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = lora_gated_mlp(x, *projections, output_discarded=discarded)
        saved_shapes.append([tuple(t.shape) for t in saved])
        results.append((out, *torch.autograd.grad(out, [x, *leaves], grad)))
    assert not results[0][0].isnan().any() and results[1][0].isnan().all()
    assert saved_shapes[0] == saved_shapes[1]
    for default, skipped in zip(results[0][1:], results[1][1:]):
        assert torch.equal(default, skipped)

    gate, up, down = projections
    dora = down._replace(magnitude=torch.rand(hidden, dtype=dtype, device=device) + 0.5)
    assert torch.equal(lora_gated_mlp(x, gate, up, dora, output_discarded=True), lora_gated_mlp(x, gate, up, dora))


def test_autocast(device):
    x = torch.randn(5, 32, device=device, requires_grad=True)
    projections = _mlp(32, 48, (4, 4, 4), torch.float32, device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = lora_gated_mlp(x, *projections)
    ref = lora_gated_mlp_reference(x, "silu", *(v for p in projections for v in p))
    assert out.dtype == torch.bfloat16
    # x, every weight and each intermediate are rounded to bf16 along the way (as in eager).
    assert ((out.float() - ref).norm() / ref.norm()).item() < 3e-2
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and projections[2].lora_b.grad.dtype == torch.float32


def test_autocast_leaves_float32_adapters_to_the_op(device):
    """As for lora_linear: no cast node for float32 adapters under autocast, results unchanged."""
    x = torch.randn(5, 32, dtype=torch.bfloat16, device=device, requires_grad=True)
    projections = [_float32_adapters(p) for p in _mlp(32, 48, (4, 2, 4), torch.bfloat16, device)]
    adapters = [t for p in projections for t in (p.lora_a, p.lora_b)]
    plain = lora_gated_mlp(x, *projections)
    plain_grads = torch.autograd.grad(plain.float().sum(), [x, *adapters])
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = lora_gated_mlp(x, *projections)
    assert "ToCopyBackward0" not in _graph_node_names(out)
    assert torch.equal(out, plain)
    for ours, expected in zip(torch.autograd.grad(out.float().sum(), [x, *adapters]), plain_grads):
        assert ours.dtype == expected.dtype and torch.equal(ours, expected)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda p: dict(activation="relu"), "activation must be one of"),
        (lambda p: dict(up=_projection(24, 49, 2, torch.float32, "cpu")), r"up weight must have shape \(50, 24\)"),
        (lambda p: dict(down=_projection(49, 24, 2, torch.float32, "cpu")), r"down weight must have shape \(out, 50\)"),
        (lambda p: dict(down=_projection(50, 23, 2, torch.float32, "cpu")), r"down weight must have shape \(24, 50\)"),
        (lambda p: dict(gate=p[0]._replace(scaling=None)), "gate scaling must be a finite number"),
    ],
)
def test_bad_arguments_raise_value_error(make, match):
    gate, up, down = _mlp(24, 50, (2, 2, 2), torch.float32, torch.device("cpu"))
    args = dict(gate=gate, up=up, down=down, activation="silu")
    args.update(make((gate, up, down)))
    with pytest.raises(ValueError, match=match):
        lora_gated_mlp(torch.randn(3, 24), **args)


def _output_and_grads(fn, x, projections, grad, dtype):
    """fn's output and the gradients of x and the adapters, all computed from `dtype` copies."""
    x = x.detach().to(dtype).requires_grad_()
    copies = [LoraProjection(*(t.detach().to(dtype).requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor)
                               else t for t in p)) for p in projections]
    out = fn(x, copies)
    leaves = [x, *(t for p in copies for t in (p.lora_a, p.lora_b))]
    return [out, *torch.autograd.grad(out, leaves, grad.to(dtype))]


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_bf16_llama_8b_sizes_on_gpu_as_accurate_as_eager(activation):
    device = torch.device("cuda")
    x = torch.randn(2, 4096, 4096, dtype=torch.bfloat16, device=device)
    projections = _mlp(4096, 14336, (16, 16, 16), torch.bfloat16, device)
    grad = torch.randn_like(x)

    def eager(x, ps):
        return lora_gated_mlp_reference(x, activation, *(v for p in ps for v in p))

    want = _output_and_grads(eager, x, projections, grad, torch.float64)
    ours = _output_and_grads(lambda x, ps: lora_gated_mlp(x, *ps, activation=activation), x, projections, grad,
                             torch.bfloat16)
    theirs = _output_and_grads(eager, x, projections, grad, torch.bfloat16)
    for i, (o, t, w) in enumerate(zip(ours, theirs, want)):
        def error(got):
            return ((got.double() - w).norm() / w.norm()).item()

        assert error(o) <= 1.5 * error(t) + 1e-3, (i, error(o), error(t))


@pytest.mark.gpu
def test_peak_memory_below_eager_on_gpu():
    device = torch.device("cuda")
    x = torch.randn(8192, 4096, dtype=torch.bfloat16, device=device, requires_grad=True)
    projections = _mlp(4096, 14336, (16, 16, 16), torch.bfloat16, device)
    flat = [v for p in projections for v in p]
    grad = torch.randn_like(x)

    def peak_and_saved(fn):
        fn().backward(grad)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        saved = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
        out.backward(grad)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, saved

    ours, ours_saved = peak_and_saved(lambda: lora_gated_mlp(x, *projections))
    eager, eager_saved = peak_and_saved(lambda: lora_gated_mlp_reference(x, "silu", *flat))
    assert ours <= eager, (ours / 2**20, eager / 2**20)
    # x is the caller's; the layer keeps gate and up (and rank-sized scraps) alive.
    assert ours_saved <= 2 * 8192 * 14336 * 2 + 2**22, ours_saved / 2**20


def _normed_runs(dtype, device, casting, offset, call, with_weight):
    """`call(x, normed_input)` -> (outputs, parameters) on x = add_rms_norm(a, r)'s output, run
    with normed_input (the sum and the norm's weight) and without: for each, the outputs, every
    gradient, and whether x itself was saved for backward."""
    a, r = (torch.randn(2, 7, 24, dtype=dtype, device=device) for _ in range(2))
    norm_weight = torch.randn(24, dtype=dtype, device=device) if with_weight else None
    results = []
    for with_source in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in (a, r, norm_weight) if t is not None]
        weight = leaves[2] if with_weight else None
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            x, total = F.add_rms_norm(leaves[0], leaves[1], weight, 1e-6, offset=offset, casting=casting)
            outs, params = call(x, NormedInput(total, weight, 1e-6, offset, casting) if with_source else None)
        upstream = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)).to(o) for i, o in enumerate(outs)]
        torch.autograd.backward(outs, upstream)
        results.append((outs, [t.grad for t in (*leaves, *params)], any(t.data_ptr() == x.data_ptr() for t in saved)))
        for p in params:
            p.grad = None
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("casting, offset, with_weight", [("llama", 0.0, True), ("gemma", 1.0, True), ("llama", 0.0, False)])
@pytest.mark.parametrize("op", ["group", "mlp", "mlp recompute"])
def test_normed_input_keeps_the_norms_input_and_matches_exactly(poison_outputs, device, dtype, casting, offset,
                                                                with_weight, op):
    """x is an RMSNorm's output: with normed_input the LoRA ops save the norm's input (kept by the
    norm anyway) instead of x and renormalise it in backward; outputs and every gradient are the
    same bits as without."""
    torch.manual_seed(0)
    if op == "group":
        projections = [_projection(24, n, 4, dtype, device, trainable_base=True) for n in (24, 8, 8)]

        def call(x, normed):
            return lora_linear_group(x, projections, normed_input=normed), [t for p in projections for t in p[:3]]
    else:
        projections = _mlp(24, 40, (3, 5, 2), dtype, device, bias=True, trainable_base=True)

        def call(x, normed):
            out = lora_gated_mlp(x, *projections, recompute=op == "mlp recompute", normed_input=normed)
            return [out], [t for p in projections for t in p if isinstance(t, torch.Tensor)]

    (outs, grads, saved_x), (want_outs, want_grads, want_saved_x) = _normed_runs(
        dtype, device, casting, offset, call, with_weight
    )
    assert want_saved_x and not saved_x
    for got, want in zip(outs, want_outs, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(grads, want_grads, strict=True):
        assert (got is None and want is None) or torch.equal(got, want)


def test_normed_input_bad_arguments():
    x = torch.randn(4, 8)
    projections = _mlp(8, 12, (2, 2, 2), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="normed_input must be a tigon.ops.NormedInput"):
        lora_gated_mlp(x, *projections, normed_input=(x, torch.ones(8), 1e-6, 0.0, "llama"))
    with pytest.raises(ValueError, match=r"normed_input.source must have x's shape \(4, 8\)"):
        lora_linear_group(x, projections[:2], normed_input=NormedInput(torch.ones(5, 8), None, 1e-6, 0.0, "llama"))
    with pytest.raises(ValueError, match=r"normed_input.weight must have shape \(8,\)"):
        lora_linear_group(x, projections[:2], normed_input=NormedInput(torch.ones(4, 8), torch.ones(7), 1e-6, 0.0, "llama"))


def test_normed_input_needing_no_gradient_is_kept_itself(device):
    # A norm of a frozen input with a frozen weight saves nothing: renormalising would save the
    # same bytes and add a kernel, so x is kept.
    source, weight = torch.randn(6, 24, device=device), torch.randn(24, device=device)
    x = F.rms_norm(source, weight, 1e-6)
    projections = [_projection(24, 8, 2, torch.float32, device)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lora_linear_group(x, projections, normed_input=NormedInput(source, weight, 1e-6, 0.0, "llama"))
    assert any(t.data_ptr() == x.data_ptr() for t in saved)
    assert not any(t.data_ptr() == source.data_ptr() for t in saved)
