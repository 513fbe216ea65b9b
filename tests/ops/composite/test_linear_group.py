import pytest
import torch

import tigon.ops.composite.linear_group as linear_group_module
from tigon.ops.composite.linear_group import linear_group, linear_group_reference
from tests.helpers import assert_close, autograd_nodes, compare_fwd_bwd


def _params(in_features, outs, dtype, device, *, bias, trainable):
    params = []
    for out_features in outs:
        weight = (torch.randn(out_features, in_features, dtype=dtype, device=device) / in_features**0.5)
        b = torch.randn(out_features, dtype=dtype, device=device) if bias else None
        params += [weight.requires_grad_(trainable), None if b is None else b.requires_grad_(trainable)]
    return params


def _grouped(x, *params):
    return linear_group(x, params[0::2], params[1::2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("trainable", [False, True])
def test_matches_separate_linears(poison_outputs, device, dtype, bias, trainable):
    # q/k/v-like: one wide projection and two narrow ones, odd sizes.
    x = torch.randn(3, 7, 45, dtype=dtype, device=device, requires_grad=True)
    params = _params(45, (45, 13, 13), dtype, device, bias=bias, trainable=trainable)
    compare_fwd_bwd(_grouped, linear_group_reference, (x, *params), name="linear_group")


@pytest.mark.parametrize("lead", [(), (5,), (2, 3, 4)])
def test_any_leading_dims_and_one_projection(poison_outputs, device, lead):
    x = torch.randn(*lead, 17, device=device, requires_grad=True)
    params = _params(17, (9,), torch.float32, device, bias=True, trainable=True)
    compare_fwd_bwd(_grouped, linear_group_reference, (x, *params), name="linear_group")


def test_input_gradient_is_one_tensor_without_adds(device):
    x = torch.randn(6, 20, device=device, requires_grad=True)
    q, k, v = _grouped(x, *_params(20, (20, 8, 8), torch.float32, device, bias=False, trainable=True))
    nodes = {type(node).__name__ for node in autograd_nodes(q + k.sum() + v.sum())}
    assert "_LinearGroupFunctionBackward" in nodes
    # The separate linears' graph, for contrast, has one node per projection.
    assert not any(name.startswith(("MmBackward", "AddmmBackward")) for name in nodes)


def test_an_unused_output_gets_no_parameter_gradients(poison_outputs, device):
    x = torch.randn(10, 25, device=device, requires_grad=True)
    params = _params(25, (16, 16, 16), torch.float32, device, bias=True, trainable=True)
    q, _, v = _grouped(x, *params)
    (q.sum() + (v * v).sum()).backward()
    x_ref = x.detach().clone().requires_grad_()
    refs = [p.detach().clone().requires_grad_() for p in params]
    q_ref, _, v_ref = linear_group_reference(x_ref, *refs)
    (q_ref.sum() + (v_ref * v_ref).sum()).backward()
    assert_close(x.grad, x_ref.grad, name="dx")
    for i in (0, 1, 4, 5):
        assert_close(params[i].grad, refs[i].grad, name=f"param {i}")
    assert params[2].grad is None and params[3].grad is None


def test_frozen_weights_cost_no_weight_gradient_gemm(device, monkeypatch):
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b, **k: calls.append((tuple(a.shape), tuple(b.shape))) or real_mm(a, b, **k))
    x = torch.randn(12, 40, device=device, requires_grad=True)
    q, k = _grouped(x, *_params(40, (40, 10), torch.float32, device, bias=False, trainable=False))
    (q.sum() + k.sum()).backward()
    assert calls == [((12, 40), (40, 40))]  # dx from q; k's GEMM accumulates into it (addmm_)


def test_autocast_casts_like_f_linear(device):
    x = torch.randn(6, 32, device=device, requires_grad=True)
    params = _params(32, (16, 8), torch.float32, device, bias=True, trainable=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        outs = _grouped(x, *params)
        refs = linear_group_reference(x, *params)
    for out, ref in zip(outs, refs):
        assert out.dtype == ref.dtype == torch.bfloat16
        assert_close(out.float(), ref.float(), torch.bfloat16, "output")
    sum(o.float().sum() for o in outs).backward()
    for t in (x, *params):
        assert t.grad is not None and t.grad.dtype == torch.float32


def test_float64_and_tigon_disable_run_the_reference(device, monkeypatch):
    calls = []
    monkeypatch.setattr(linear_group_module.LINEAR_GROUP, "reference",
                        lambda *a: calls.append(1) or linear_group_reference(*a))
    params = _params(16, (8,), torch.float64, device, bias=False, trainable=False)
    _grouped(torch.randn(4, 16, dtype=torch.float64, device=device), *params)
    assert calls
    calls.clear()
    monkeypatch.setenv("TIGON_DISABLE", "linear_group")
    _grouped(torch.randn(4, 16, device=device), *_params(16, (8,), torch.float32, device, bias=False, trainable=False))
    assert calls


def test_empty_input(device):
    (out,) = _grouped(torch.randn(0, 16, device=device), *_params(16, (8,), torch.float32, device, bias=False, trainable=False))
    assert out.shape == (0, 8)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: linear_group(torch.randn(3, 8), []), "at least one weight"),
        (lambda: linear_group(torch.randn(3, 8), [torch.randn(5, 7)]), r"weights\[0\] must have shape \(out, 8\)"),
        (lambda: linear_group(torch.randn(3, 8), [torch.randn(5, 8), torch.randn(5)]), r"weights\[1\] must have shape"),
        (lambda: linear_group(torch.randn(3, 8), [torch.randn(5, 8)], [None, None]), "one bias .or None. per weight: 1, got 2"),
        (lambda: linear_group(torch.randn(3, 8), [torch.randn(5, 8)], [torch.randn(4)]), r"biases\[0\] must have shape \(5,\)"),
        (lambda: linear_group(torch.randn(3, 8), [torch.randn(5, 8).half()]), r"weights\[0\] must have the dtype of x"),
        (lambda: linear_group(torch.ones(3, 8, dtype=torch.int64), [torch.randn(5, 8)]), "x must be a floating-point"),
        (lambda: linear_group(torch.randn(3, 8), [torch.randn(5, 8, device="meta")]), r"weights\[0\] is on meta"),
    ],
)
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.gpu
def test_bf16_attention_shapes_on_gpu():
    device = torch.device("cuda")
    x = torch.randn(4, 2048, 2048, dtype=torch.bfloat16, device=device, requires_grad=True)
    params = _params(2048, (2048, 512, 512), torch.bfloat16, device, bias=True, trainable=True)
    compare_fwd_bwd(_grouped, linear_group_reference, (x, *params), torch.bfloat16, name="linear_group")
