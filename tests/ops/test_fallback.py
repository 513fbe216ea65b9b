"""A kernel that raises, forward or backward, gives the reference's results, said once; TIGON_STRICT
re-raises. One case per op with kernels, all checked by the same two tests."""

import logging
import sys

import pytest
import torch

import tigon.functional as F
from tigon import ops
from tigon.ops import moe
from tigon.ops.dora import DORA_SCALE_BACKWARD, dora_scale_backward_reference
from tigon.ops.gemm_4bit import GEMM_4BIT
from tigon.ops.linear_log_probs import linear_log_probs_reference
from tests.helpers import assert_close, tigon_kernels


def _t(*shape, grad=True):
    return torch.randn(*shape, requires_grad=grad)


def _lora(out_features, in_features, rank=3):
    return ops.LoraProjection(_t(out_features, in_features), _t(rank, in_features), _t(out_features, rank), 0.5, _t(out_features))


def _lora_leaves(projections):
    return [t for p in projections for t in (p.weight, p.lora_a, p.lora_b, p.bias)]


def _flat_lora(fn):
    """`fn(x, gate, up, down)` as a function of x and the projections' tensors."""
    def call(x, *tensors):
        gate, up, down = (ops.LoraProjection(*tensors[i:i + 3], 0.5, tensors[i + 3]) for i in range(0, 12, 4))
        return fn(x, gate, up, down)
    return call


MROPE_TABLES = (torch.randn(3, 2, 5, 12), torch.randn(3, 2, 5, 12))
VISION_TABLES = (torch.randn(7, 16), torch.randn(7, 16))


def _target(*shape, vocab=37):
    target = torch.randint(0, vocab, shape)
    target.view(-1)[1] = -100
    return target


def _token_log_probs(h, w, t):
    """log_softmax(h @ w.T)[t], 0 where t is -100."""
    valid = t != -100
    picked = torch.log_softmax(h @ w.T, -1).gather(-1, torch.where(valid, t, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, picked, 0.0)


def _dpo(h, w, t, ref_h, beta=0.1):
    u = _token_log_probs(h, w, t).sum(-1) - _token_log_probs(ref_h, w.detach(), t).sum(-1)
    chosen, rejected = u.chunk(2)
    return -torch.nn.functional.logsigmoid(beta * (chosen - rejected)).mean()


def _grpo(h, w, t, old, advantages, eps=0.2):
    ratio = torch.exp(_token_log_probs(h, w, t) - old)
    a = advantages[:, None]
    return -torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a).mean(-1).mean()


def _forward_kl(hs, ws, ht, wt, t):
    log_p, log_q = torch.log_softmax(hs @ ws.T, -1), torch.log_softmax(ht @ wt.T, -1)
    valid = t != -100
    return torch.where(valid, (log_q.exp() * (log_q - log_p)).sum(-1), 0.0).sum() / valid.sum()


def _experts_args():
    return (_t(7, 16), torch.randint(0, 5, (7, 2)), torch.rand(7, 2, requires_grad=True), _t(5, 24, 16), _t(5, 16, 12),
            _t(5, 3, 16), _t(5, 24, 3))


# op -> (tigon's call, the reference's call, tensors to differentiate)
def _four_bit(packed, absmax):
    """A (6, 64) 4-bit weight of the packed codes and their absmaxes (one block of 64 per row)."""
    return ops.QuantizedWeight(packed, absmax, (6, 64), code=torch.linspace(-1, 1, 16))


CASES = {
    "rms_norm": (lambda x, w: F.rms_norm(x, w, offset=1.0), lambda x, w: ops.rms_norm_reference(x, w, 1e-6, 1.0),
                 lambda: (_t(3, 5, 33), _t(33))),
    "add_rms_norm": (F.add_rms_norm, ops.add_rms_norm_reference, lambda: (_t(4, 33), _t(4, 33), _t(33))),
    "layer_norm": (F.layer_norm, ops.layer_norm_reference, lambda: (_t(5, 33), _t(33), _t(33))),
    "rope": (F.rope, ops.rope_reference,
             lambda: (_t(2, 3, 5, 16), _t(2, 1, 5, 16), torch.randn(2, 5, 12), torch.randn(2, 5, 12))),
    "mrope": (lambda q, k: F.mrope(q, k, *MROPE_TABLES, [2, 1, 3], interleaved=True),
              lambda q, k: ops.mrope_reference(q, k, *MROPE_TABLES, [2, 1, 3], True),
              lambda: (_t(2, 3, 5, 16), _t(2, 1, 5, 16))),
    "vision_rope": (lambda q, k: F.vision_rope(q, k, *VISION_TABLES), lambda q, k: ops.vision_rope_reference(q, k, *VISION_TABLES),
                    lambda: (_t(7, 2, 16), _t(7, 2, 16))),
    "gelu": (lambda x: F.gelu(x, "sigmoid"), lambda x: ops.gelu_reference(x, "sigmoid"), lambda: (_t(4, 37),)),
    "gelu_mlp": (F.gelu_mlp, ops.gelu_mlp_reference, lambda: (_t(2, 3, 16), _t(24, 16), _t(12, 24), _t(24))),
    "swiglu": (F.swiglu, ops.swiglu_reference, lambda: (_t(4, 37), _t(4, 37))),
    "geglu": (lambda g, u: F.geglu(g, u, "none"), lambda g, u: ops.geglu_reference(g, u, "none"),
              lambda: (_t(4, 37), _t(4, 37))),
    "glu_mlp": (F.glu_mlp, ops.glu_mlp_reference, lambda: (_t(2, 3, 16), _t(24, 16), _t(24, 16), _t(16, 24), _t(24))),
    "cross_entropy": (lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1),
                      lambda x, t: ops.cross_entropy_reference(x, t, label_smoothing=0.1),
                      lambda: (_t(3, 2, 37), _target(3, 2))),
    "linear_cross_entropy": (F.linear_cross_entropy, ops.linear_cross_entropy_reference,
                             lambda: (_t(7, 16), _t(37, 16), _target(7))),
    "linear_cross_entropy-none": (
        lambda h, w, t: F.linear_cross_entropy(h, w, t, reduction="none"),
        lambda h, w, t: ops.linear_cross_entropy_reference(h, w, t, reduction="none"),
        lambda: (_t(7, 16), _t(37, 16), _target(7)),
    ),
    "linear_log_probs": (
        lambda h, w, t, b: F.linear_log_probs(h, w, t, b, temperature=0.7, return_entropy=True),
        lambda h, w, t, b: linear_log_probs_reference(h, w, t, b, temperature=0.7, return_entropy=True),
        lambda: (_t(2, 5, 16), _t(37, 16), _target(2, 5), _t(37)),
    ),
    "linear_log_probs-frozen_head": (  # the hidden-only path, its gradient formed in forward
        lambda h, w, t: F.linear_log_probs(h, w, t, return_entropy=True),
        lambda h, w, t: linear_log_probs_reference(h, w, t, return_entropy=True),
        lambda: (_t(2, 5, 16), _t(37, 16, grad=False), _target(2, 5)),
    ),
    "linear_preference_loss": (lambda h, w, t, r: F.linear_preference_loss(h, w, t, method="dpo", ref_hidden=r)[0],
                               _dpo, lambda: (_t(4, 6, 16), _t(37, 16), _target(4, 6), _t(4, 6, 16, grad=False))),
    "linear_policy_loss": (lambda h, w, t, old, a: F.linear_policy_loss(h, w, t, old, a)[0], _grpo,
                           lambda: (_t(3, 5, 16), _t(37, 16), torch.randint(0, 37, (3, 5)), torch.randn(3, 5) - 4,
                                    torch.randn(3))),
    "linear_distill_loss": (lambda hs, ws, ht, wt, t: F.linear_distill_loss(hs, ws, ht, wt, t, loss="forward_kl")[0],
                            _forward_kl,
                            lambda: (_t(2, 5, 16), _t(37, 16), _t(2, 5, 12, grad=False), _t(37, 12, grad=False),
                                     _target(2, 5))),
    "moe_experts": (
        lambda x, i, w, w1, w2, a1, l1: F.moe_experts(x, i, w, w1, w2, gate_up_lora=(a1, l1, 0.5)),
        lambda x, i, w, w1, w2, a1, l1: moe.moe_experts_reference(
            x, i, w, w1, w2, None, None, a1, l1, None, None, moe._Config(moe.GateOptions(), 0.5, 1.0, "triton")),
        _experts_args,
    ),
    "lora_gated_mlp": (_flat_lora(F.lora_gated_mlp), _flat_lora(lambda x, *p: ops.lora_gated_mlp_reference(
                           x, "silu", *(v for projection in p for v in projection))),
                       lambda: (_t(2, 3, 16), *_lora_leaves([_lora(24, 16), _lora(24, 16), _lora(16, 24)]))),
    "add_rms_norm_glu_mlp": (
        lambda x, r, w, *p: F.add_rms_norm_glu_mlp(x, r, w, 1e-6, *p),
        lambda x, r, w, *p: ops.add_rms_norm_glu_mlp_reference(x, r, w, 1e-6, *p),
        lambda: (_t(5, 16), _t(5, 16), _t(16), _t(24, 16), _t(24, 16), _t(16, 24)),
    ),
    "dequantize": (
        lambda q, s: F.dequantize(ops.QuantizedWeight(q, s, tuple(q.shape)), torch.float32),
        lambda q, s: ops.dequantize_reference(ops.QuantizedWeight(q, s, tuple(q.shape)), torch.float32),
        lambda: (torch.randint(-127, 128, (6, 20), dtype=torch.int8), torch.rand(6) + 0.5),
    ),
    "gemm_4bit": (  # what the LoRA ops run for a 4-bit base's GEMMs, forward and input gradient
        lambda x, q, s: GEMM_4BIT(None, x, _four_bit(q, s), False, None),
        lambda x, q, s: x @ ops.dequantize_reference(_four_bit(q, s), torch.float32).t(),
        lambda: (_t(5, 64, grad=False), torch.randint(0, 256, (6 * 32,), dtype=torch.uint8), torch.rand(6) + 0.5),
    ),
    "dora_norm": (lambda w, a, b: F.dora_norm(w, a, b, 0.5), lambda w, a, b: ops.dora_norm_reference(w, a, b, 0.5),
                  lambda: (_t(9, 20, grad=False), _t(3, 20, grad=False), _t(9, 3, grad=False))),
    "dora_scale": (F.dora_scale, ops.dora_scale_reference,
                   lambda: (_t(3, 5, 24), torch.rand(24, requires_grad=True), torch.rand(24) + 0.5, _t(24))),
    "dora_scale_backward": (  # what the LoRA ops run in their backward
        lambda g, z, m, n: DORA_SCALE_BACKWARD(None, g, z, m, n, True),
        lambda g, z, m, n: dora_scale_backward_reference(g, z, m, n, True),
        lambda: (_t(9, 24, grad=False), _t(9, 24, grad=False), torch.rand(24), torch.rand(24) + 0.5),
    ),
    "info_nce": (lambda q, d: F.info_nce(q, d, temperature=0.1), lambda q, d: ops.info_nce_reference(q, d, 0.1),
                 lambda: (_t(5, 24), _t(9, 24))),
    "add_low_rank": (lambda o, a, b: F.add_low_rank_(o.clone(), a, b, 0.5),
                     lambda o, a, b: ops.add_low_rank_reference(o.clone(), a, b, 0.5),
                     lambda: (_t(9, 24, grad=False), _t(9, 4, grad=False), _t(24, 4, grad=False))),
    "fp8_quantize": (lambda x: [t.float() for t in F.quantize_rows(x)],
                     lambda x: [t.float() for t in ops.quantize_rows_reference(x)], lambda: (_t(9, 24, grad=False),)),
}
NO_GRADIENT = ("dequantize", "gemm_4bit", "dora_norm", "dora_scale_backward", "fp8_quantize", "add_low_rank")  # ops whose outputs have no gradient


def test_every_op_with_kernels_has_a_case():
    cpu = torch.device("cpu")
    with_kernels = {op for op in ops.op_names() if ops.placement(op, cpu)[0] == "triton"}
    assert {case.split("-")[0] for case in CASES} == with_kernels


class _Failing:
    """Stands in for a kernel: launching it raises."""

    def __getitem__(self, grid):
        return self

    def __call__(self, *args, **kwargs):
        raise RuntimeError("simulated kernel failure")


def _break_every_kernel(monkeypatch):
    kernels = {id(kernel) for kernel in tigon_kernels().values()}
    for name, module in list(sys.modules.items()):
        if name.startswith("tigon.ops."):
            for attr, value in list(vars(module).items()):
                if id(value) in kernels:
                    monkeypatch.setattr(module, attr, _Failing())


def _run(fn, args):
    """fn's outputs on fresh copies of `args`, and those copies."""
    leaves = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    outs = fn(*leaves)
    outs = [o for o in ([outs] if isinstance(outs, torch.Tensor) else outs) if o is not None]
    return outs, leaves


def _backward(outs, leaves, grads):
    torch.autograd.backward(outs, grads)
    return [leaf.grad for leaf in leaves if leaf.requires_grad]


def _case(case):
    """(op name, tigon's call, the reference's call, fresh arguments) of a case."""
    fn, reference, make_args = CASES[case]
    return case.split("-")[0], fn, reference, make_args()


def _failures(caplog, op):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"tigon: {op} ")]


@pytest.mark.parametrize("case", [case for case in CASES if case not in NO_GRADIENT])
def test_backward_kernel_failure(case, monkeypatch, caplog):
    op, fn, reference, args = _case(case)
    want_outs, want_leaves = _run(reference, args)
    grads = [torch.randn_like(o) for o in want_outs]
    want = _backward(want_outs, want_leaves, grads)
    strict, lenient = _run(fn, args), _run(fn, args)  # forwards by the kernels
    _break_every_kernel(monkeypatch)
    with pytest.raises(RuntimeError, match="simulated kernel failure"):  # TIGON_STRICT=1
        _backward(*strict, grads)
    monkeypatch.delenv("TIGON_STRICT")
    with caplog.at_level(logging.WARNING, logger="tigon"):
        got = _backward(*lenient, grads)
    for i, (ours, theirs) in enumerate(zip(got, want)):
        assert_close(ours, theirs, name=f"{case} grad {i}")
    assert len(_failures(caplog, op)) == 1 and "backward kernel failed" in _failures(caplog, op)[0]
    assert "its backward kernel failed" in ops.why_not_triton(op, torch.device("cpu"))


@pytest.mark.parametrize("case", list(CASES))
def test_forward_kernel_failure(case, monkeypatch, caplog):
    op, fn, reference, args = _case(case)
    want, _ = _run(reference, args)
    _break_every_kernel(monkeypatch)
    with pytest.raises(RuntimeError, match="simulated kernel failure"):  # TIGON_STRICT=1
        _run(fn, args)
    monkeypatch.delenv("TIGON_STRICT")
    with caplog.at_level(logging.WARNING, logger="tigon"):
        got, _ = _run(fn, args)
        _run(fn, args)
    for i, (ours, theirs) in enumerate(zip(got, want)):
        assert_close(ours, theirs, name=f"{case} output {i}")
    assert len(_failures(caplog, op)) == 1 and "kernel failed" in _failures(caplog, op)[0]
    assert "its kernel failed" in ops.why_not_triton(op, torch.device("cpu"))
