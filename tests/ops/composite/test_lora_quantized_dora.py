"""The LoRA ops on quantised bases (QLoRA) and with DoRA magnitudes, against their references
(the reference dequantises the base and computes DoRA as PEFT does)."""

import pytest
import torch

from tigon.ops.composite.lora import LoraProjection, lora_linear, lora_linear_group, lora_linear_reference
from tigon.ops.composite.lora_mlp import lora_gated_mlp, lora_gated_mlp_reference
from tigon.ops.dequantize import release_workspaces
from tigon.patch.quantized import from_4bit, from_int8
from tests.helpers import compare_fwd_bwd
from tests.ops.composite.test_lora import _projection, one_cpu_thread  # noqa: F401 (autouse fixture)

bnb_functional = pytest.importorskip("bitsandbytes.functional")

KINDS = ["nf4", "fp4", "nf4-double", "int8"]


def _quantized(weight: torch.Tensor, kind: str):
    if kind == "int8":
        data, row_absmax, _ = bnb_functional.int8_vectorwise_quant(weight.detach().half())
        return from_int8(data, row_absmax)
    data, state = bnb_functional.quantize_4bit(
        weight.detach(), blocksize=64, quant_type=kind[:3], compress_statistics=kind.endswith("double")
    )
    return from_4bit(data, state)


def _variant(projection: LoraProjection, kind: str | None, dora: bool) -> LoraProjection:
    """`projection` with its base quantised as `kind` (None: kept) and a DoRA magnitude if asked."""
    if kind is not None:
        projection = projection._replace(weight=_quantized(projection.weight, kind))
    if dora:
        out_features = projection.lora_b.shape[0]
        magnitude = torch.rand(out_features, device=projection.lora_b.device) + 0.5
        projection = projection._replace(magnitude=magnitude.requires_grad_())
    return projection


def _flat_tensors(projections):
    """The differentiable fields, in order, for compare_fwd_bwd (a QuantizedWeight passes as is)."""
    return [value for p in projections for value in (p.weight, p.lora_a, p.lora_b, p.bias, p.magnitude)]


def _rebuild(values, projections):
    return [LoraProjection(w, a, b, p.scaling, bias, m)
            for p, (w, a, b, bias, m) in zip(projections, zip(*[iter(values)] * 5))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", KINDS + [None])
@pytest.mark.parametrize("dora", [False, True])
def test_linear(poison_outputs, device, dtype, kind, dora):
    if kind is None and not dora:
        pytest.skip("plain LoRA: tests/ops/composite/test_lora.py")
    x = torch.randn(3, 7, 64, dtype=dtype, device=device, requires_grad=True)
    projection = _variant(_projection(64, 45, 5, dtype, device, bias=True), kind, dora)

    def run(op):
        return lambda x, *values: op(x, *_rebuild(values, [projection])[0])

    compare_fwd_bwd(run(lora_linear), run(lora_linear_reference), (x, *_flat_tensors([projection])), dtype,
                    name=f"lora_linear {kind} dora={dora}")


def test_dora_with_trainable_base(poison_outputs, device):
    x = torch.randn(11, 40, device=device, requires_grad=True)
    projection = _variant(_projection(40, 24, 3, torch.float32, device, bias=True, trainable_base=True), None, True)

    def run(op):
        return lambda x, *values: op(x, *_rebuild(values, [projection])[0])

    compare_fwd_bwd(run(lora_linear), run(lora_linear_reference), (x, *_flat_tensors([projection])), name="dora")


def test_group_of_mixed_projections(poison_outputs, device):
    """q/k/v as one op: a quantised DoRA projection beside a quantised and a plain one."""
    x = torch.randn(2, 9, 128, device=device, requires_grad=True)
    projections = [
        _variant(_projection(128, 64, 8, torch.float32, device, bias=True), "nf4-double", True),
        _variant(_projection(128, 32, 4, torch.float32, device), "int8", False),
        _variant(_projection(128, 32, 2, torch.float32, device), None, True),
    ]

    def ours(x, *values):
        return lora_linear_group(x, _rebuild(values, projections))

    def reference(x, *values):
        return tuple(lora_linear_reference(x, *p) for p in _rebuild(values, projections))

    compare_fwd_bwd(ours, reference, (x, *_flat_tensors(projections)), name="group")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind,dora,recompute", [("nf4-double", False, False), ("fp4", True, False),
                                                 ("int8", True, False), (None, True, False),
                                                 ("nf4-double", False, True), ("int8", True, True)])
def test_gated_mlp(poison_outputs, device, dtype, kind, dora, recompute):
    """(recompute: a quantised base dequantised again for gate and up; a DoRA gate keeps its z.)"""
    x = torch.randn(2, 5, 64, dtype=dtype, device=device, requires_grad=True)
    projections = [
        _variant(_projection(64, 128, 4, dtype, device, bias=dora), kind, dora),
        _variant(_projection(64, 128, 6, dtype, device), kind, False),
        _variant(_projection(128, 64, 3, dtype, device, bias=dora), kind, dora),
    ]

    def ours(x, *values):
        return lora_gated_mlp(x, *_rebuild(values, projections), recompute=recompute)

    def reference(x, *values):
        return lora_gated_mlp_reference(x, "silu", *[v for p in _rebuild(values, projections) for v in p])

    compare_fwd_bwd(ours, reference, (x, *_flat_tensors(projections)), dtype,
                    name=f"mlp {kind} dora={dora} recompute={recompute}")


def _saved_shapes(fn):
    """The shapes of the tensors `fn` saves for backward, each storage once; and its output."""
    saved = {}

    def pack(t):
        saved[t.data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return [tuple(t.shape) for t in saved.values()], out


def test_quantized_base_saves_no_weight_and_nothing_of_output_size(device):
    n, in_features, out_features, rank = 50, 64, 96, 3
    x = torch.randn(n, in_features, device=device, requires_grad=True)
    projection = _variant(_projection(in_features, out_features, rank, torch.float32, device), "nf4", False)
    shapes, out = _saved_shapes(lambda: lora_linear(x, *projection))
    assert sorted(s for s in shapes if s[:1] == (n,)) == [(n, rank), (n, in_features)]
    assert (out_features, in_features) not in shapes and (n, out_features) not in shapes
    out.sum().backward()  # the base is dequantised again for dx
    assert x.grad is not None and projection.lora_a.grad is not None


def test_dora_saves_its_unscaled_output_and_norm(device):
    n, in_features, out_features, rank = 50, 64, 96, 3
    x = torch.randn(n, in_features, device=device, requires_grad=True)
    projection = _variant(_projection(in_features, out_features, rank, torch.float32, device), "int8", True)
    shapes, _ = _saved_shapes(lambda: lora_linear(x, *projection))
    assert sorted(s for s in shapes if s[:1] == (n,)) == [(n, rank), (n, in_features), (n, out_features)]
    assert (out_features,) in shapes and (out_features, in_features) not in shapes


def test_dora_mlp_keeps_z_in_place_of_gate_and_up(device):
    """A DoRA gate/up saves its unscaled output instead of its output: no extra intermediate."""
    x = torch.randn(20, 64, device=device, requires_grad=True)
    plain = [_projection(64, 128, 4, torch.float32, device), _projection(64, 128, 4, torch.float32, device),
             _projection(128, 64, 4, torch.float32, device)]
    dora = [_variant(p, None, True) for p in plain]
    plain_shapes, _ = _saved_shapes(lambda: lora_gated_mlp(x, *plain))
    dora_shapes, _ = _saved_shapes(lambda: lora_gated_mlp(x, *dora))
    assert dora_shapes.count((20, 128)) == plain_shapes.count((20, 128)) == 2
    assert dora_shapes.count((20, 64)) == plain_shapes.count((20, 64)) + 1  # the down projection's z


def test_bad_quantized_weight_and_magnitude(device):
    projection = _variant(_projection(64, 32, 4, torch.float32, device), "nf4", False)
    x = torch.randn(3, 64, device=device)
    with pytest.raises(ValueError, match="lora weight data must hold"):
        lora_linear(x, projection.weight._replace(shape=(33, 64)), *projection[1:])
    with pytest.raises(ValueError, match=r"lora magnitude must have shape \(32,\)"):
        lora_linear(x, *projection[:5], torch.ones(31, device=device))
    release_workspaces()
