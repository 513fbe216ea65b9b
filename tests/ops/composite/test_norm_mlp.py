import pytest
import torch

import tigon.functional as F
from tigon.ops.composite import norm_mlp
from tigon.ops.composite.norm_mlp import add_rms_norm_glu_mlp_reference
from tests.helpers import assert_close, compare_fwd_bwd, saved_activation_bytes

EPS = 1e-5


def _args(lead, hidden, intermediate, dtype, device, bias):
    def param(*shape, scale=None):
        return (torch.randn(*shape, dtype=dtype, device=device) * (scale or shape[-1] ** -0.5)).requires_grad_()

    x = torch.randn(*lead, hidden, dtype=dtype, device=device, requires_grad=True)
    residual = torch.randn(*lead, hidden, dtype=dtype, device=device, requires_grad=True)
    norm_weight = (1 + 0.2 * torch.randn(hidden, dtype=dtype, device=device)).requires_grad_()
    weights = [param(intermediate, hidden), param(intermediate, hidden), param(hidden, intermediate)]
    biases = [param(intermediate, scale=0.1), param(intermediate, scale=0.1), param(hidden, scale=0.1)] if bias else []
    return x, residual, norm_weight, weights, biases


def _ours(casting, offset, activation):
    def run(x, r, w, gw, uw, dw, *biases):
        return F.add_rms_norm_glu_mlp(x, r, w, EPS, gw, uw, dw, *biases, offset=offset, casting=casting, activation=activation)

    return run


def _theirs(casting, offset, activation):
    def run(x, r, w, gw, uw, dw, *biases):
        biases = biases or (None, None, None)
        return add_rms_norm_glu_mlp_reference(x, r, w, EPS, gw, uw, dw, *biases, offset, casting, activation)

    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0), ("none", 0.0)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(poison_outputs, device, dtype, casting, offset, bias):
    x, r, w, weights, biases = _args((3, 5), 24, 40, dtype, device, bias)
    compare_fwd_bwd(
        _ours(casting, offset, "silu"), _theirs(casting, offset, "silu"), (x, r, w, *weights, *biases),
        name=f"add_rms_norm_glu_mlp {casting}",
    )


@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu"])
def test_geglu_matches_reference(poison_outputs, device, activation):
    x, r, w, weights, _ = _args((7,), 16, 36, torch.float32, device, False)
    compare_fwd_bwd(_ours("gemma", 1.0, activation), _theirs("gemma", 1.0, activation), (x, r, w, *weights), name=activation)


def test_same_numbers_as_add_rms_norm_then_glu_mlp(device):
    """One op, the same kernels: outputs equal the two ops' bit for bit, gradients to rounding."""
    x, r, w, weights, _ = _args((2, 6), 32, 48, torch.float32, device, False)
    leaves = [t.detach().clone().requires_grad_() for t in (x, r, w, *weights)]
    out, total = F.add_rms_norm_glu_mlp(*leaves[:3], EPS, *leaves[3:])
    normed, want_total = F.add_rms_norm(x, r, w, EPS)
    want = F.glu_mlp(normed, *weights)
    assert torch.equal(out, want) and torch.equal(total, want_total)
    grads = torch.randn_like(out), torch.randn_like(total)
    torch.autograd.backward((out, total), grads)
    torch.autograd.backward((want, want_total), grads)
    for ours, theirs in zip(leaves, (x, r, w, *weights)):
        assert_close(ours.grad, theirs.grad, name="grad")


def test_frozen_parameters_get_no_gradient(device):
    x, r, w, (gw, uw, dw), _ = _args((4,), 16, 24, torch.float32, device, False)
    for t in (r, w, gw, dw):
        t.requires_grad_(False)
    compare_fwd_bwd(_ours("llama", 0.0, "silu"), _theirs("llama", 0.0, "silu"), (x, r, w, gw, uw, dw), name="frozen")
    assert r.grad is None and w.grad is None and gw.grad is None and dw.grad is None


def test_saves_the_sum_rstd_gate_and_up_only(device):
    tokens, hidden, intermediate = 6, 16, 40

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            _, _, w, weights, _ = _args((1,), hidden, intermediate, torch.float32, device, False)
            self.w, self.gw, self.uw, self.dw = (torch.nn.Parameter(t.detach()) for t in (w, *weights))

        def forward(self, x, r):
            return F.add_rms_norm_glu_mlp(x, r, self.w, EPS, self.gw, self.uw, self.dw)

    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    r = torch.randn(tokens, hidden, device=device, requires_grad=True)
    kept, _ = saved_activation_bytes(Block(), x, r)
    assert kept == 4 * (tokens * hidden + tokens + 2 * tokens * intermediate)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_recompute_keeps_no_gate_or_up_and_gives_the_same_numbers(device, dtype):
    """recompute=True: only the sum and rstd are kept; outputs and gradients equal the default's
    bit for bit (gate and up formed again from the renormalised sum)."""
    tokens, hidden, intermediate = 6, 16, 40
    x, r, w, weights, biases = _args((2, tokens), hidden, intermediate, dtype, device, True)
    grads = torch.randn(2, tokens, hidden, dtype=dtype, device=device), torch.randn(2, tokens, hidden, dtype=dtype,
                                                                                    device=device)
    results = []
    for recompute in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (x, r, w, *weights, *biases)]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out, total = F.add_rms_norm_glu_mlp(*leaves[:3], EPS, *leaves[3:], recompute=recompute)
        torch.autograd.backward((out, total), grads)
        kept = [t for t in saved if t.numel() == 2 * tokens * intermediate]
        assert len(kept) == (0 if recompute else 2)
        results.append([out, total, *(leaf.grad for leaf in leaves)])
    for default, recomputed in zip(*results, strict=True):
        assert torch.equal(default, recomputed)


def test_float64_and_tigon_disable_run_the_reference(device, monkeypatch):
    calls = []
    monkeypatch.setattr(norm_mlp._AddNormGLUMLPFunction, "apply", lambda *a: calls.append(1))
    x, r, w, weights, _ = _args((3,), 8, 12, torch.float64, device, False)
    out, total = F.add_rms_norm_glu_mlp(x, r, w, EPS, *weights)
    want, want_total = add_rms_norm_glu_mlp_reference(x, r, w, EPS, *weights)
    assert torch.equal(out, want) and torch.equal(total, want_total)
    x, r, w, weights, _ = _args((3,), 8, 12, torch.float32, device, False)
    for name in ("glu_mlp", "add_rms_norm", "add_rms_norm_glu_mlp"):
        monkeypatch.setenv("TIGON_DISABLE", name)
        F.add_rms_norm_glu_mlp(x, r, w, EPS, *weights)
    assert not calls
    monkeypatch.delenv("TIGON_DISABLE")
    F.add_rms_norm_glu_mlp(x, r, w, EPS, *weights)
    assert calls == [1]


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(residual=torch.randn(3, 9)), "residual must have the shape of x"),
        (dict(gate_weight=torch.randn(12, 7)), "gate_weight must have shape"),
        (dict(down_weight=torch.randn(8, 11)), "down_weight must have shape"),
        (dict(activation="relu"), "activation must be one of"),
        (dict(casting="mistral"), "casting must be one of"),
    ],
)
def test_bad_arguments_raise_value_error(change, match):
    kwargs = dict(
        x=torch.randn(3, 8), residual=torch.randn(3, 8), norm_weight=torch.ones(8), eps=EPS,
        gate_weight=torch.randn(12, 8), up_weight=torch.randn(12, 8), down_weight=torch.randn(8, 12),
    )
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        F.add_rms_norm_glu_mlp(**kwargs)


@pytest.mark.gpu
def test_bf16_and_autocast_on_gpu():
    x, r, w, weights, _ = _args((2, 512), 2048, 5632, torch.bfloat16, torch.device("cuda"), False)
    compare_fwd_bwd(_ours("llama", 0.0, "silu"), _theirs("llama", 0.0, "silu"), (x, r, w, *weights), torch.bfloat16, name="bf16")
    x, r, w, weights, biases = _args((4, 256), 512, 1376, torch.float32, torch.device("cuda"), True)
    args = (x, r, w, *weights, *biases)
    ours = [a.detach().clone().requires_grad_() for a in args]
    theirs = [a.detach().clone().requires_grad_() for a in args]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, total = _ours("llama", 0.0, "silu")(*ours)
        ref, ref_total = _theirs("llama", 0.0, "silu")(*theirs)
    assert out.dtype == ref.dtype == torch.bfloat16 and total.dtype == torch.float32
    assert_close(out, ref, torch.bfloat16, name="autocast output")
    grad = torch.randn_like(out)
    torch.autograd.backward((out, total), (grad, torch.ones_like(total)))
    torch.autograd.backward((ref, ref_total), (grad, torch.ones_like(ref_total)))
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.grad.dtype == torch.float32
        assert_close(a.grad, b.grad, torch.bfloat16, name=f"autocast grad {i}")
