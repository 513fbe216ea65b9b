"""tigon.functional.moe_experts against a float64 per-expert loop (its reference, itself checked
against the formula written out here), on each GEMM back end, with poisoned outputs.

Transformers' own experts modules are compared in tests/patch/test_moe.py."""

import pytest
import torch

import tigon.functional as F
import tigon.ops.moe as moe
from tests.helpers import assert_close, compare_fwd_bwd
from tests.ops.composite.test_lora import one_cpu_thread  # noqa: F401 (autouse fixture)

N, K, E, H, I = 37, 2, 5, 48, 40
GEMMS = ["triton", "grouped_mm", "hybrid"]
# numpy, under the interpreter, warns on the NaN arithmetic of the NaN tests.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def _routing(n, experts, top_k, device, choices=None, weight_dtype=torch.float32):
    """Top-k of random router logits (distinct experts per token, drawn from `choices`), and
    their renormalised probabilities as trainable routing weights."""
    choices = torch.arange(experts) if choices is None else torch.tensor(choices)
    logits = torch.randn(n, len(choices))
    weights, picked = torch.topk(logits.softmax(-1), top_k)
    weights = weights / weights.sum(-1, keepdim=True)
    return choices[picked].to(device), weights.to(device, weight_dtype).requires_grad_()


def _experts(experts, hidden, inter, dtype, device, bias=False):
    def param(*shape, scale):
        return (torch.randn(*shape) * scale).to(device, dtype).requires_grad_()

    weights = [param(experts, 2 * inter, hidden, scale=hidden**-0.5), param(experts, hidden, inter, scale=inter**-0.5)]
    biases = [param(experts, 2 * inter, scale=0.5), param(experts, hidden, scale=0.5)] if bias else [None, None]
    return weights, biases


def _config(gemm="triton", gate_up_scaling=1.0, down_scaling=1.0, **gate):
    return moe._Config(moe.GateOptions(**gate), gate_up_scaling, down_scaling, gemm)


def _check(index, x, w, weights, biases=(None, None), loras=(None, None), dtype=None, gemm="triton", **gate):
    """moe_experts on each tensor against the float64 reference, outputs and every gradient."""
    (a1, l1, s1), (a2, l2, s2) = (lora if lora else (None, None, 1.0) for lora in loras)
    tensors = [x, w, *weights, *biases, a1, l1, a2, l2]
    present = [i for i, t in enumerate(tensors) if t is not None]

    def full(args):
        values = [None] * len(tensors)
        for i, a in zip(present, args):
            values[i] = a
        return values

    def ours(*args):
        x, w, w1, w2, b1, b2, a1, l1, a2, l2 = full(args)
        return F.moe_experts(
            x, index, w, w1, w2, gate_up_bias=b1, down_bias=b2, gemm=gemm,
            gate_up_lora=None if a1 is None else (a1, l1, s1), down_lora=None if a2 is None else (a2, l2, s2), **gate,
        )

    def reference(*args):
        x, w, w1, w2, b1, b2, a1, l1, a2, l2 = full(args)
        return moe.moe_experts_reference(x, index, w, w1, w2, b1, b2, a1, l1, a2, l2, _config(gemm, s1, s2, **gate))

    return compare_fwd_bwd(ours, reference, [tensors[i] for i in present], dtype, name=f"moe {gemm}")[0]


def _plain_experts(x, index, w, w1, w2, act=torch.nn.functional.silu):
    """The experts written out once more, token by token (the reference's own oracle)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(index.shape[1]):
            e = int(index[t, k])
            gate, up = (w1[e] @ x[t]).chunk(2)
            out[t] += w[t, k] * (w2[e] @ (act(gate) * up))
    return out


def test_reference_is_the_plain_formula():
    index, w = _routing(9, E, K, "cpu")
    (w1, w2), _ = _experts(E, 12, 10, torch.float64, "cpu")
    x = torch.randn(9, 12, dtype=torch.float64)
    w = w.double()
    got = moe.moe_experts_reference(x, index, w, w1, w2, None, None, None, None, None, None, _config())
    assert torch.allclose(got, _plain_experts(x, index, w, w1, w2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gemm", GEMMS)
def test_matches_reference(poison_outputs, device, dtype, gemm):
    index, w = _routing(N, E, K, device)
    weights, _ = _experts(E, H, I, dtype, device)
    x = torch.randn(N, H, dtype=dtype, device=device, requires_grad=True)
    _check(index, x, w, weights, gemm=gemm)


def test_odd_widths_run_on_triton(poison_outputs, device):
    index, w = _routing(29, 7, 3, device)
    weights, _ = _experts(7, 37, 29, torch.float32, device)
    x = torch.randn(29, 37, device=device, requires_grad=True)
    _check(index, x, w, weights, gemm="auto")
    with pytest.raises(ValueError, match="gemm='grouped_mm' cannot run these inputs: .*multiples of 4"):
        F.moe_experts(x, index, w, *weights, gemm="grouped_mm")


@pytest.mark.parametrize(("gemm", "gate"), [
    ("triton", dict(activation="gelu_tanh", limit=1.5)),
    ("grouped_mm", dict(activation="gelu", up_offset=1.0, interleaved=True)),
    ("hybrid", dict(alpha=1.702, limit=2.0, up_offset=1.0, interleaved=True)),
], ids=["gelu_tanh-clamp", "gelu-offset-interleaved", "gpt_oss-gate"])
def test_gate_options_and_biases(poison_outputs, device, gemm, gate):
    index, w = _routing(N, E, K, device)
    index = index.int() if gemm == "triton" else index  # int32 ids too (the down bias's dw gathers by them)
    weights, biases = _experts(E, H, I, torch.float32, device, bias=True)
    x = (3 * torch.randn(N, H, device=device)).requires_grad_()  # wide enough that the clamps bind
    _check(index, x, w, weights, biases, gemm=gemm, **gate)


@pytest.mark.parametrize("gemm", ["triton", "grouped_mm"])
def test_transposed_weight_storage(poison_outputs, device, gemm):
    # gpt-oss stores (E, H, 2I) and (E, I, H); the op takes their transposed views, and the
    # weight gradients come back in the storage's layout (no transposing copy).
    index, w = _routing(N, E, K, device)
    (w1, w2), _ = _experts(E, H, I, torch.float32, device)
    stored = [w1.detach().transpose(1, 2).contiguous().requires_grad_(), w2.detach().transpose(1, 2).contiguous().requires_grad_()]
    x = torch.randn(N, H, device=device, requires_grad=True)
    out = F.moe_experts(x, index, w, stored[0].transpose(1, 2), stored[1].transpose(1, 2), gemm=gemm)
    ref = moe.moe_experts_reference(x, index, w, w1, w2, None, None, None, None, None, None, _config())
    assert_close(out, ref, name="output")
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for s, w_ in zip(stored, (w1, w2)):
        assert_close(s.grad, w_.grad.transpose(1, 2), name="stored grad")


@pytest.mark.parametrize(("case", "gemm"), [
    ("empty experts", "triton"), ("empty experts", "grouped_mm"), ("one expert", "hybrid"),
    ("top-1", "triton"), ("dropped slots", "grouped_mm"),
])
def test_routing_edge_cases(poison_outputs, device, case, gemm):
    top_k = 1 if case == "top-1" else K
    choices = [0, 2, 4] if case == "empty experts" else None
    index, w = _routing(N, E, top_k, device, choices)
    if case == "one expert":
        index[:, 0] = 3
        index[:, 1] = torch.where(index[:, 1] == 3, 1, index[:, 1])
    if case == "dropped slots":  # transformers' loop skips id E, the expert-parallel sentinel
        index[::3, 1] = E
    if case == "top-1":
        index = index.int()
    weights, _ = _experts(E, H, I, torch.float32, device)
    x = torch.randn(N, H, device=device, requires_grad=True)
    _check(index, x, w, weights, gemm=gemm)
    if case == "empty experts":
        out = F.moe_experts(x, index, w, *weights, gemm=gemm)
        grads = torch.autograd.grad(out.sum(), weights)
        assert all((g[[1, 3]] == 0).all() for g in grads)
    if case == "dropped slots":
        out = F.moe_experts(x, index, w, *weights, gemm=gemm)
        (grad_w,) = torch.autograd.grad(out.sum(), [w])
        assert (grad_w[::3, 1] == 0).all()


@pytest.mark.parametrize(("gemm", "gate"), [("triton", {}), ("grouped_mm", dict(alpha=1.702, limit=7.0, up_offset=1.0))],
                         ids=["silu", "clamped"])
def test_nan_in_gives_nan_out(device, gemm, gate):
    index, w = _routing(N, E, K, device)
    weights, _ = _experts(E, H, I, torch.float32, device)
    x = torch.randn(N, H, device=device)
    x[5, 7] = float("nan")
    with torch.no_grad():
        weights[0][2, 3, 4] = float("nan")  # every token routed to expert 2
    out = F.moe_experts(x, index, w, *weights, gemm=gemm, **gate)
    ref = moe.moe_experts_reference(x, index, w, *weights, None, None, None, None, None, None, _config(**gate))
    nan_rows = (index == 2).any(1)
    nan_rows[5] = True
    assert torch.isnan(out[nan_rows]).all()
    assert torch.isfinite(out[~nan_rows]).all()
    assert_close(out[~nan_rows], ref[~nan_rows], name="finite rows")


def _count_weight_gemms(monkeypatch):
    calls = []
    real = moe._triton_weights
    monkeypatch.setattr(moe, "_triton_weights", lambda *a, **k: calls.append(a[3].shape) or real(*a, **k))
    return calls


def test_frozen_weights_skip_their_gradient_gemms(poison_outputs, device, monkeypatch):
    calls = _count_weight_gemms(monkeypatch)
    index, w = _routing(N, E, K, device)
    weights, _ = _experts(E, H, I, torch.float32, device)
    for t in weights:
        t.requires_grad_(False)
    x = torch.randn(N, H, device=device, requires_grad=True)
    _check(index, x, w, weights)
    assert calls == []
    weights[1].requires_grad_(True)
    F.moe_experts(x, index, w, *weights).sum().backward()
    assert calls == [weights[1].shape]


@pytest.mark.parametrize(("gemm", "dtype"), [("triton", torch.float16), ("grouped_mm", torch.float32)])
def test_lora_adapters(poison_outputs, device, monkeypatch, gemm, dtype):
    calls = _count_weight_gemms(monkeypatch)
    index, w = _routing(N, E, K, device)
    weights, _ = _experts(E, H, I, dtype, device)
    for t in weights:
        t.requires_grad_(False)
    rank = 8

    def adapter(out_features, in_features):
        # Adapters in float32 on a half model, as PEFT may keep them.
        a = (torch.randn(E, rank, in_features) * in_features**-0.5).to(device).requires_grad_()
        b = (torch.randn(E, out_features, rank) * rank**-0.5).to(device).requires_grad_()
        return a, b

    loras = [(*adapter(2 * I, H), 2.0), (*adapter(H, I), 0.5)]
    x = torch.randn(N, H, dtype=dtype, device=device, requires_grad=True)
    _check(index, x, w, weights, loras=loras, dtype=dtype, gemm=gemm)
    if gemm == "triton":  # four adapter gradients, no base-weight gradient
        assert sorted(calls) == sorted(t.shape for lora in loras for t in lora[:2])
    out = F.moe_experts(x, index, w, *weights, gate_up_lora=loras[0], down_lora=loras[1], gemm=gemm)
    out.float().sum().backward()
    assert all(t.grad.dtype == torch.float32 for lora in loras for t in lora[:2])


def test_second_backward_through_retained_graph_fails_loudly(device):
    index, w = _routing(N, E, K, device)
    weights, _ = _experts(E, H, I, torch.float32, device)
    out = F.moe_experts(torch.randn(N, H, device=device, requires_grad=True), index, w, *weights)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("gemm", ["triton", "grouped_mm"])
def test_saves_the_input_the_pre_activations_and_index_vectors(device, gemm):
    index, w = _routing(N, E, K, device)
    weights, _ = _experts(E, H, I, torch.float32, device)
    x = torch.randn(N, H, device=device, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        F.moe_experts(x, index, w, *weights, gemm=gemm)
    params = {t.data_ptr() for t in weights}
    floats = sorted(tuple(t.shape) for t in saved if t.is_floating_point() and t.data_ptr() not in params)
    assert floats == [(N, H), (N * K,), (N * K, 2 * I)]  # x, the routing weights, gate|up
    assert all(t.numel() <= 2 * N * K for t in saved if not t.is_floating_point())
    assert any(t.dtype == torch.int64 and t.shape == (E + 1,) for t in saved)  # int64 offsets


def test_reference_paths(device, monkeypatch):
    index, w = _routing(N, E, K, device)
    weights, _ = _experts(E, H, I, torch.float64, device)
    x = torch.randn(N, H, dtype=torch.float64, device=device)
    ref = moe.moe_experts_reference(x, index, w, *weights, None, None, None, None, None, None, _config())
    assert torch.equal(F.moe_experts(x, index, w, *weights), ref)  # float64 runs the reference
    monkeypatch.setenv("TIGON_DISABLE", "moe_experts")
    x32, w32 = x.float(), [t.detach().float() for t in weights]
    assert_close(F.moe_experts(x32, index, w, *w32), ref.float(), name="TIGON_DISABLE")
    assert F.moe_experts(x32[:0], index[:0], w[:0], *w32).shape == (0, H)


def test_autocast(device):
    index, w = _routing(N, E, K, device)
    weights, _ = _experts(E, H, I, torch.float32, device)
    x = torch.randn(N, H, device=device, requires_grad=True)
    with torch.autocast(device.type, dtype=torch.float16):
        out = F.moe_experts(x, index, w, *weights, gemm="grouped_mm")
    ref = moe.moe_experts_reference(x, index, w, *weights, None, None, None, None, None, None, _config())
    assert out.dtype == torch.float16
    assert ((out.float() - ref).norm() / ref.norm()).item() < 5e-3
    out.float().sum().backward()
    assert x.grad.dtype == weights[0].grad.dtype == torch.float32


def test_argument_errors(device):
    index, w = _routing(N, E, K, device)
    (w1, w2), (b1, _) = _experts(E, H, I, torch.float32, device, bias=True)
    x = torch.randn(N, H, device=device)
    cases = [
        (lambda: F.moe_experts(x[0], index, w, w1, w2), "hidden must be 2-D"),
        (lambda: F.moe_experts(x, index.float(), w, w1, w2), "top_k_index must be an int64 or int32"),
        (lambda: F.moe_experts(x, index[:3], w, w1, w2), r"top_k_index must have shape \(37, K\)"),
        (lambda: F.moe_experts(x, index, w[:, :1], w1, w2), "top_k_weights must have top_k_index's shape"),
        (lambda: F.moe_experts(x, index, w, w1[:, :-1], w2), r"gate_up_weight must have shape \(experts, 2 \* intermediate, 48\)"),
        (lambda: F.moe_experts(x, index, w, w1, w2[:, :, :-1]), r"down_weight must have shape \(5, 48, 40\)"),
        (lambda: F.moe_experts(x, index, w, w1, w2, gate_up_bias=b1[:, :-1]), r"gate_up_bias must have shape \(5, 80\)"),
        (lambda: F.moe_experts(x, index, w, w1.half(), w2), "gate_up_weight must have the dtype of hidden"),
        (lambda: F.moe_experts(x, index, w, w1, w2, activation="relu"), "activation must be one of"),
        (lambda: F.moe_experts(x, index, w, w1, w2, activation="gelu", alpha=1.7), "alpha applies to activation='silu'"),
        (lambda: F.moe_experts(x, index, w, w1, w2, limit=0.0), "limit must be None or a positive"),
        (lambda: F.moe_experts(x, index, w, w1, w2, gemm="cublas"), "gemm must be one of"),
        (lambda: F.moe_experts(x, index, w, w1, w2, gate_up_lora=(w1, w2)), r"gate_up_lora must be a tuple \(lora_a, lora_b, scaling\)"),
        (lambda: F.moe_experts(x, index, w, w1, w2, down_lora=(torch.ones(E, 4, H), torch.ones(E, H, 4), 1.0)),
         r"down_lora\[0\] \(lora_a\) must have shape \(5, r, 40\)"),
        (lambda: F.moe_experts(x, index, w, w1, w2, down_lora=(torch.ones(E, 4, I), torch.ones(E, H, 3), 1.0)),
         r"down_lora\[1\] \(lora_b\) must have shape \(5, 48, 4\)"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


# ---------------------------------------------------------------------------------------------
# GPU: bf16 on the compiled kernels (the CPU runs above are the interpreter's)


def _gpu_case(n, experts, top_k, hidden, inter, dtype=torch.bfloat16):
    device = torch.device("cuda")
    torch.manual_seed(0)
    index, w = _routing(n, experts, top_k, device)
    weights, _ = _experts(experts, hidden, inter, dtype, device)
    x = torch.randn(n, hidden, dtype=dtype, device=device, requires_grad=True)
    return index, w, weights, x


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", GEMMS)
def test_bf16_on_gpu(gemm):
    index, w, weights, x = _gpu_case(4096, 32, 4, 1024, 384)
    _check(index, x, w, weights, dtype=torch.bfloat16, gemm=gemm)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_gemms_in_fp32_and_fp16_on_gpu(dtype):
    # fp32 GEMMs in full precision (not TF32), with their own tile depth; LoRA on both projections.
    index, w, weights, x = _gpu_case(1031, 12, 3, 264, 200, dtype)
    loras = [(torch.randn(12, 8, 264, device="cuda", requires_grad=True), torch.randn(12, 400, 8, device="cuda", requires_grad=True), 0.1),
             (torch.randn(12, 8, 200, device="cuda", requires_grad=True), torch.randn(12, 264, 8, device="cuda", requires_grad=True), 0.1)]
    _check(index, x, w, weights, loras=loras, dtype=dtype, gemm="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", GEMMS)
def test_qwen3_30b_a3b_shape_bf16_on_gpu(gemm):
    # The benchmark's shape: 4 x 2048 tokens, hidden 2048, expert intermediate 768, 128 experts, top-8.
    index, w, weights, x = _gpu_case(8192, 128, 8, 2048, 768)
    w = w.detach().bfloat16().requires_grad_()  # Qwen3-MoE's router hands back weights in bf16
    _check(index, x, w, weights, dtype=torch.bfloat16, gemm=gemm)


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", GEMMS)
def test_no_host_sync_and_zero_grads_for_idle_experts_on_gpu(gemm):
    index, w, weights, x = _gpu_case(2048, 16, 4, 512, 256)
    index = torch.where(index == 5, 6, index)  # expert 5 idle (duplicates allowed here)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = F.moe_experts(x, index, w, *weights, gemm=gemm)
        out.backward(torch.randn_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all((t.grad[5] == 0).all() for t in weights)


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", ["triton", "grouped_mm"])
def test_int64_offsets_on_gpu(gemm):
    # S · H past 2**31: the last rows' offsets into the gathered, sorted and combined tensors.
    n, top_k, hidden, inter = 2**31 // (8 * 2048) + 64, 8, 2048, 256
    index, w, weights, x = _gpu_case(n, 8, top_k, hidden, inter)
    with torch.no_grad():
        out = F.moe_experts(x, index, w, *weights, gemm=gemm)
    tail = slice(n - 64, n)
    ref = moe.moe_experts_reference(x[tail], index[tail], w[tail], *weights, None, None, None, None, None, None, _config())
    assert_close(out[tail], ref, torch.bfloat16, name="tail tokens")
