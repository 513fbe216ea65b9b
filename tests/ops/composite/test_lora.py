import pytest
import torch

import tigon.ops.composite.lora as lora_module
from tigon.ops.composite.lora import (
    LoraProjection, lora_linear, lora_linear_group, lora_linear_reference, restore_projections, saved_tensors,
)
from tests.helpers import assert_close, autograd_nodes, compare_fwd_bwd


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    """Tiny CPU matmuls run far faster on one thread than on a contended OpenMP pool."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _projection(in_features, out_features, rank, dtype, device, *, bias=False, trainable_base=False):
    # A and B of comparable size, so the low-rank term matters as much as the base one.
    weight = torch.randn(out_features, in_features, dtype=dtype, device=device) / in_features**0.5
    lora_a = torch.randn(rank, in_features, dtype=dtype, device=device) / in_features**0.5
    lora_b = torch.randn(out_features, rank, dtype=dtype, device=device) / rank**0.5
    b = torch.randn(out_features, dtype=dtype, device=device) if bias else None
    weight.requires_grad_(trainable_base)
    if b is not None:
        b.requires_grad_(trainable_base)
    return LoraProjection(weight, lora_a.requires_grad_(), lora_b.requires_grad_(), 0.5 + torch.rand(()).item(), b)


def _check_linear(x, projection, dtype=None):
    weight, lora_a, lora_b, scaling, bias, _ = projection
    compare_fwd_bwd(
        lambda x, w, a, b, bias: lora_linear(x, w, a, b, scaling, bias),
        lambda x, w, a, b, bias: lora_linear_reference(x, w, a, b, scaling, bias),
        (x, weight, lora_a, lora_b, bias), dtype, name="lora_linear",
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rank", [1, 8, 64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("trainable_base", [False, True])
def test_lora_linear_matches_reference(poison_outputs, device, dtype, rank, bias, trainable_base):
    x = torch.randn(3, 7, 97, dtype=dtype, device=device, requires_grad=True)
    _check_linear(x, _projection(97, 61, rank, dtype, device, bias=bias, trainable_base=trainable_base))


@pytest.mark.parametrize("lead", [(), (5,), (2, 3, 4)])
def test_any_leading_dims(poison_outputs, device, lead):
    x = torch.randn(*lead, 33, device=device, requires_grad=True)
    _check_linear(x, _projection(33, 20, 4, torch.float32, device, bias=True))


def _float32_adapters(projection):
    return projection._replace(
        lora_a=projection.lora_a.detach().float().requires_grad_(),
        lora_b=projection.lora_b.detach().float().requires_grad_(),
    )


def _graph_node_names(out):
    return {type(node).__name__ for node in autograd_nodes(out)}


@pytest.mark.parametrize("grouped", [False, True])
def test_float32_adapters_on_half_input(poison_outputs, device, grouped):
    """PEFT keeps adapters in float32 on a half-precision model: the op casts them itself (no cast
    node in the graph), runs the GEMMs in x's dtype, and returns their gradients in float32."""
    x = torch.randn(5, 33, dtype=torch.float16, device=device, requires_grad=True)
    projections = [_float32_adapters(_projection(33, width, 4, torch.float16, device, bias=True)) for width in (20, 9)]
    if grouped:
        def ours(x, *t):
            return lora_linear_group(x, restore_projections(t, [p.scaling for p in projections]))

        def reference(x, *t):
            return [lora_linear_reference(x, *p) for p in restore_projections(t, [p.scaling for p in projections])]

        compare_fwd_bwd(ours, reference, (x, *saved_tensors(projections)), torch.float16, name="group")
        out = lora_linear_group(x, projections)[0]
    else:
        projections = projections[:1]
        _check_linear(x, projections[0], torch.float16)
        out = lora_linear(x, *projections[0])
    assert out.dtype == torch.float16
    assert "ToCopyBackward0" not in _graph_node_names(out)
    for p in projections:
        p.lora_a.grad = p.lora_b.grad = None
    out.float().sum().backward()
    assert projections[0].lora_a.grad.dtype == projections[0].lora_b.grad.dtype == torch.float32


def test_rank_256_and_rank_above_width(poison_outputs, device):
    x = torch.randn(40, 48, device=device, requires_grad=True)
    _check_linear(x, _projection(48, 30, 256, torch.float32, device))


def test_non_contiguous_input_and_grad(poison_outputs, device):
    base = torch.randn(9, 5, 70, device=device)
    x = base[::2, :, :65].detach().requires_grad_()
    assert not x.is_contiguous()
    _check_linear(x, _projection(65, 24, 8, torch.float32, device, bias=True))
    # An output gradient that arrives transposed (as through a later .transpose()).
    projection = _projection(65, 24, 8, torch.float32, device)
    out = lora_linear(x, *projection)
    grad = torch.randn(24, *out.shape[:-1], device=device).movedim(0, -1)
    assert not grad.is_contiguous()
    (got,) = torch.autograd.grad(out, projection.lora_b, grad)
    ref = lora_linear_reference(x, *projection)
    (want,) = torch.autograd.grad(ref, projection.lora_b, grad)
    assert_close(got, want, name="dB with strided dy")


def test_frozen_base_and_input_get_no_gradient(device):
    x = torch.randn(6, 30, device=device)
    projection = _projection(30, 12, 4, torch.float32, device, bias=True)
    lora_linear(x, *projection).sum().backward()
    assert projection.weight.grad is None and projection.bias.grad is None
    assert projection.lora_a.grad is not None and projection.lora_b.grad is not None


def test_only_b_trainable(poison_outputs, device):
    x = torch.randn(6, 30, device=device)
    projection = _projection(30, 12, 4, torch.float32, device)
    projection.lora_a.requires_grad_(False)
    out = lora_linear(x, *projection)
    (grad_b,) = torch.autograd.grad(out, projection.lora_b, torch.ones_like(out))
    ref = lora_linear_reference(x, *projection)
    (want,) = torch.autograd.grad(ref, projection.lora_b, torch.ones_like(ref))
    assert_close(grad_b, want, name="dB")


def test_saves_only_x_and_the_rank_sized_product(device):
    n, in_features, out_features, rank = 50, 40, 70, 3
    x = torch.randn(n, in_features, device=device, requires_grad=True)
    projection = _projection(in_features, out_features, rank, torch.float32, device, bias=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lora_linear(x, *projection)
    activations = [tuple(t.shape) for t in saved if t.shape[:1] == (n,)]
    assert sorted(activations) == sorted([(n, in_features), (n, rank)]), activations
    assert not any(t.numel() >= n * out_features for t in saved)


def test_second_backward_with_retained_graph(device):
    x = torch.randn(8, 30, device=device, requires_grad=True)
    projection = _projection(30, 12, 4, torch.float32, device)
    out = lora_linear(x, *projection)
    grad = torch.randn_like(out)
    first = torch.autograd.grad(out, (x, projection.lora_a, projection.lora_b), grad, retain_graph=True)
    second = torch.autograd.grad(out, (x, projection.lora_a, projection.lora_b), grad)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_group_matches_separate_reference_layers(poison_outputs, device):
    x = torch.randn(4, 9, 57, device=device, requires_grad=True)
    projections = [
        _projection(57, 57, 8, torch.float32, device, bias=True),
        _projection(57, 19, 3, torch.float32, device, trainable_base=True),
        _projection(57, 19, 1, torch.float32, device),
    ]
    flat = saved_tensors(projections)
    scalings = [p.scaling for p in projections]

    def regroup(tensors):
        return restore_projections(tensors, scalings)

    compare_fwd_bwd(
        lambda x, *t: lora_linear_group(x, regroup(t)),
        lambda x, *t: tuple(lora_linear_reference(x, *p) for p in regroup(t)),
        (x, *flat), name="group",
    )


def test_group_with_an_unused_output(poison_outputs, device):
    x = torch.randn(10, 25, device=device, requires_grad=True)
    projections = [_projection(25, 16, 4, torch.float32, device) for _ in range(3)]
    q, _, v = lora_linear_group(x, projections)
    (q.sum() + (v * v).sum()).backward()
    x_ref = x.detach().clone().requires_grad_()
    refs = [LoraProjection(*(t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                             for t in p)) for p in projections]
    q_ref, k_ref, v_ref = (lora_linear_reference(x_ref, *p) for p in refs)
    (q_ref.sum() + (v_ref * v_ref).sum()).backward()
    assert_close(x.grad, x_ref.grad, name="dx")
    for got, want in zip(projections[::2], refs[::2]):
        assert_close(got.lora_a.grad, want.lora_a.grad, name="dA")
        assert_close(got.lora_b.grad, want.lora_b.grad, name="dB")
    assert projections[1].lora_a.grad is None and projections[1].lora_b.grad is None


def test_group_reads_x_once_for_all_adapters(device, monkeypatch):
    calls = []
    real_mm = torch.mm

    def spy_mm(a, b, *args, **kwargs):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return real_mm(a, b, *args, **kwargs)

    x = torch.randn(12, 40, device=device)
    projections = [_projection(40, 40, 8, torch.float32, device), _projection(40, 10, 4, torch.float32, device)]
    monkeypatch.setattr(torch, "mm", spy_mm)
    lora_linear_group(x, projections)
    assert [c for c in calls if c[0] == (12, 40)] == [((12, 40), (40, 12))]


def test_autocast_casts_like_f_linear(device):
    x = torch.randn(6, 32, device=device, requires_grad=True)
    projection = _projection(32, 16, 4, torch.float32, device, bias=True, trainable_base=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = lora_linear(x, *projection)
        assert lora_linear_reference(x, *projection).dtype == torch.bfloat16
    assert out.dtype == torch.bfloat16
    assert_close(out.float(), lora_linear_reference(x, *projection), torch.bfloat16, "output")
    out.float().sum().backward()
    for t in (x, *(t for t in projection if isinstance(t, torch.Tensor))):
        assert t.grad is not None and t.grad.dtype == torch.float32


@pytest.mark.parametrize("grouped", [False, True])
def test_autocast_leaves_float32_adapters_to_the_op(device, grouped):
    """Under autocast, with x and the weights already in its dtype (a bf16 model under the HF
    Trainer's bf16 autocast) and float32 adapters (PEFT's default): no cast node in the graph (the
    op casts the adapters itself), and the same output and gradients as without autocast."""
    x = torch.randn(7, 24, dtype=torch.bfloat16, device=device, requires_grad=True)
    projections = [_float32_adapters(_projection(24, width, 4, torch.bfloat16, device, bias=True)) for width in (16, 8)]

    def run():
        return lora_linear_group(x, projections) if grouped else (lora_linear(x, *projections[0]),)

    plain = run()
    plain_grads = torch.autograd.grad([o.float().sum() for o in plain], [x, projections[0].lora_a, projections[0].lora_b])
    with torch.autocast(device.type, dtype=torch.bfloat16):
        outs = run()
    assert not any("ToCopyBackward0" in _graph_node_names(o) for o in outs)
    grads = torch.autograd.grad([o.float().sum() for o in outs], [x, projections[0].lora_a, projections[0].lora_b])
    for ours, expected in zip((*outs, *grads), (*plain, *plain_grads)):
        assert ours.dtype == expected.dtype and torch.equal(ours, expected)


def test_tigon_disable_runs_the_reference(device, monkeypatch):
    monkeypatch.setenv("TIGON_DISABLE", "lora_linear")
    calls = []
    monkeypatch.setattr(lora_module.LORA_LINEAR, "reference",
                        lambda *a: calls.append(1) or lora_linear_reference(*a))
    x = torch.randn(4, 16, device=device)
    lora_linear(x, *_projection(16, 8, 2, torch.float32, device))
    assert calls


def test_empty_input(device):
    projection = _projection(16, 8, 2, torch.float32, device)
    assert lora_linear(torch.randn(0, 16, device=device), *projection).shape == (0, 8)


def _bad(**overrides):
    args = dict(x=torch.randn(3, 8), weight=torch.randn(5, 8), lora_a=torch.randn(2, 8),
                lora_b=torch.randn(5, 2), scaling=2.0, bias=None)
    args.update(overrides)
    return lambda: lora_linear(**args)


@pytest.mark.parametrize(
    "call,match",
    [
        (_bad(weight=torch.randn(5, 7)), r"lora weight must have shape \(out, 8\)"),
        (_bad(lora_a=torch.randn(2, 7)), r"lora lora_a must have shape \(r, 8\)"),
        (_bad(lora_a=torch.randn(0, 8), lora_b=torch.randn(5, 0)), "r >= 1"),
        (_bad(lora_b=torch.randn(5, 3)), r"lora lora_b must have shape \(5, 2\)"),
        (_bad(bias=torch.randn(4)), r"lora bias must have shape \(5,\)"),
        (_bad(scaling=float("nan")), "scaling must be a finite number"),
        (_bad(scaling=torch.tensor(2.0)), "scaling must be a finite number"),
        (_bad(weight=torch.randn(5, 8).half()), "lora weight must have the dtype of x"),
        (_bad(bias=torch.randn(5).double()), "lora bias must have the dtype of x"),
        (_bad(lora_b=torch.ones(5, 2, dtype=torch.int32)), "lora lora_b must be a floating-point"),
        (_bad(weight=torch.randn(5, 8, 1)), "lora weight must be a 2-D matrix"),
        (_bad(x=torch.ones(3, 8, dtype=torch.int64)), "x must be a floating-point"),
        (_bad(lora_a=torch.randn(2, 8, device="meta")), "lora lora_a is on meta"),
        (lambda: lora_linear_group(torch.randn(3, 8), []), "at least one LoraProjection"),
        (lambda: lora_linear_group(torch.randn(3, 8), [(torch.randn(5, 8),)]), r"projections\[0\] must be a LoraProjection"),
    ],
)
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("shape,rank", [((16384, 4096, 4096), 16), ((2, 1023, 4096, 14336), 64), ((4099, 1000, 3000), 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_on_gpu(shape, rank, bias):
    *lead, in_features, out_features = shape
    device = torch.device("cuda")
    x = torch.randn(*lead, in_features, dtype=torch.bfloat16, device=device, requires_grad=True)
    _check_linear(x, _projection(in_features, out_features, rank, torch.bfloat16, device, bias=bias), torch.bfloat16)


@pytest.mark.gpu
def test_peak_memory_below_eager_on_gpu():
    device = torch.device("cuda")
    x = torch.randn(16384, 4096, dtype=torch.bfloat16, device=device, requires_grad=True)
    projection = _projection(4096, 4096, 16, torch.bfloat16, device)
    grad = torch.randn(16384, 4096, dtype=torch.bfloat16, device=device)

    def peak(fn):
        fn(x, *projection).backward(grad)  # .grad buffers exist before measuring
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(x, *projection).backward(grad)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    ours, eager = peak(lora_linear), peak(lora_linear_reference)
    assert ours <= eager, (ours / 2**20, eager / 2**20)
    assert ours <= 2 * x.numel() * 2 + 2**24  # the output and dx, plus rank-sized scraps
