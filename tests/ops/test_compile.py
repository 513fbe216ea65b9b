"""Inside torch.compile the ops run tigon's kernels, as the library ops ``torch.ops.tigon.*``, with
no graph break; their fake implementations and autograd pass torch.library.opcheck."""

import copy

import pytest
import torch

import tigon
import tigon.functional as F
from tigon import ops
from tigon.ops import _dispatch, moe
from tests.helpers import assert_close, kernel_launches


def _t(*shape, grad=False, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, requires_grad=grad)


def _target(*shape, vocab=37):
    target = torch.randint(0, vocab, shape)
    target.view(-1)[0] = -100
    return target


def _moe_forward_args(gemm, rank=4):
    """moe_experts' library-op arguments: 7 tokens, top-2 of 5 experts, H = 16, I = 12, LoRA on
    the gate/up projection (triton) or the down one (the others), a gate/up bias."""
    lora = (_t(5, rank, 16, grad=True), _t(5, 24, rank, grad=True), None, None)
    if gemm != "triton":
        lora = (None, None, _t(5, rank, 12, grad=True), _t(5, 16, rank, grad=True))
    return (_t(7, 16, grad=True), torch.randint(0, 5, (7, 2)), torch.rand(7, 2, requires_grad=True),
            _t(5, 24, 16, grad=True), _t(5, 16, 12, grad=True).transpose(1, 2).contiguous().transpose(1, 2),
            _t(5, 24, grad=True), None, *lora,
            *moe._config_args(moe._Config(moe.GateOptions(alpha=1.5, limit=2.0, up_offset=1.0), 0.5, 2.0, gemm)))


def _moe_backward_args():
    forward = _moe_forward_args("hybrid")
    tensors, config = [a.detach() if isinstance(a, torch.Tensor) else a for a in forward[:11]], forward[11:]
    with torch.no_grad():
        _, *saved = _dispatch.LIBRARY_OPS["moe_experts"](*tensors, *config)
    saved = [None if t.numel() == 0 else t for t in saved]  # absent: no gate/up adapter
    return (_t(7, 16), *tensors, *saved, *config, [True, False, True, True, True, True, False, False, False, True, True])


# Every library op, with arguments (those of ops with autograd require grad, so opcheck tests it).
OPCHECK_CASES = {
    "rms_norm": lambda: (_t(3, 5, 24, grad=True), _t(3, 5, 24, grad=True), _t(24, grad=True), 1e-6, 1.0, "gemma"),
    "rms_norm_backward": lambda: (_t(4, 24), None, _t(4, 24), _t(24), torch.rand(4) + 0.5, 0.0, "llama", True),
    "layer_norm": lambda: (_t(4, 24, grad=True), _t(24, grad=True), None, 1e-5),
    "layer_norm_backward": lambda: (_t(4, 24), _t(4, 24), _t(24), _t(24), _t(4), torch.rand(4) + 0.5, True, False),
    "rope": lambda: (_t(2, 3, 5, 16, grad=True).transpose(1, 2).contiguous().transpose(1, 2), _t(2, 1, 5, 16, grad=True),
                     _t(5, 12), _t(5, 12), False),
    "rope_backward": lambda: (_t(2, 3, 5, 16), None, _t(1, 5, 16), _t(1, 5, 16), True, torch.float32),
    "mrope": lambda: (_t(2, 3, 5, 16, grad=True).transpose(1, 2).contiguous().transpose(1, 2), _t(2, 1, 5, 16, grad=True),
                      _t(3, 2, 5, 12), _t(3, 2, 5, 12), [2, 1, 3], True, torch.float32),
    "mrope_backward": lambda: (_t(2, 3, 5, 16), None, _t(3, 1, 5, 16), _t(3, 1, 5, 16), [4, 2, 2], False, torch.float32),
    "gelu": lambda: (_t(4, 37, grad=True), "quick_gelu"),
    "gelu_backward": lambda: (_t(4, 37), _t(4, 37), "gelu"),
    "gelu_mlp": lambda: (_t(2, 3, 16, grad=True), _t(24, 16, grad=True), _t(12, 24, grad=True), _t(24, grad=True), None,
                         "gelu_tanh"),
    "gelu_mlp_backward": lambda: (_t(5, 12), _t(5, 16), _t(5, 24), _t(24, 16), _t(12, 24), "quick_gelu",
                                  [True, True, False, True, True]),
    "glu": lambda: (_t(4, 37, grad=True), _t(4, 37, grad=True), "gelu_tanh", 0.7, 1.3),
    "glu_backward": lambda: (_t(4, 37), _t(4, 37), _t(4, 37), "silu", -1.5, 0.5),
    "glu_mlp": lambda: (_t(2, 3, 16, grad=True), _t(24, 16, grad=True), _t(24, 16, grad=True), _t(16, 24, grad=True),
                        _t(24, grad=True), None, _t(16, grad=True), "silu"),
    "glu_mlp_backward": lambda: (_t(5, 16), _t(5, 16), _t(5, 24), _t(5, 24), _t(24, 16), _t(24, 16), _t(16, 24), "gelu",
                                 [True, True, False, True, True, False, False]),
    "cross_entropy": lambda: (_t(3, 2, 37, grad=True), _target(3, 2), -100, 0.1, 1e-4, 30.0),
    "cross_entropy_backward": lambda: (_t(6, 37), _target(6), _t(6), torch.rand(6), -100, 0.0, 0.0, None),
    "linear_cross_entropy": lambda: (_t(7, 16, grad=True), _t(37, 16, grad=True), _t(37, grad=True), _target(7),
                                     torch.tensor(0.25), -100, 0.1, 0.0, None, 3, True, True, True),
    "linear_cross_entropy_rows": lambda: (_t(7, 16, grad=True), _t(37, 16, grad=True), None, _target(7),
                                          -100, 0.0, 1e-4, 20.0, 4),
    # 600 bytes: chunks of 4 rows of 37 fp32 logits
    "linear_log_probs": lambda: (_t(2, 5, 16, grad=True), _t(37, 16, grad=True), _t(37, grad=True), _target(2, 5),
                                 -100, 0.7, True, True, 600, False),
    "linear_log_probs_backward": lambda: (_t(2, 5, 16), _t(37, 16), _t(37), _target(2, 5), _t(2, 5) + 4, _t(2, 5),
                                          _t(2, 5), _t(2, 5), None, -100, 0.7, 600, True, True, True),
    "linear_preference_loss": lambda: (_t(4, 6, 16, grad=True), _t(37, 16, grad=True), None, _target(4, 6),
                                       _t(4, 6, 16), _t(37, 16), None, None, None, None, _target(4, 6),
                                       "dpo", 0.1, 0.1, 0.5, 0.5, 1.0, 1.0, 0.05, -100, True, 1800, True, True, False),
    "linear_policy_loss": lambda: (_t(3, 5, 16, grad=True), _t(37, 16, grad=True), _t(37, grad=True),
                                   torch.randint(0, 37, (3, 5)), torch.rand(15) > 0.2, torch.rand(15) / 15, _t(15),
                                   _t(15) - 4, _t(15) - 4, None, torch.rand(15) + 0.5, "grpo", "token", 0.04, 0.2,
                                   0.28, 0.9, False, 1.5, [1.0, 1.05], [2.0, 3.0, 3.0, 2.0], "token_truncate",
                                   [0.0, 3.0], 600, True, True, True),
    "linear_distill_loss": lambda: (_t(2, 5, 16, grad=True), _t(37, 16, grad=True), None, _t(2, 5, 12), _t(37, 12),
                                    _t(37), _target(2, 5), torch.tensor(1 / 9), "jsd", 0.3, 2.0, 0.25, -100, 1200,
                                    True, True, False),
    "moe_experts": lambda: _moe_forward_args("triton"),
    "moe_experts_backward": _moe_backward_args,
}


def test_every_library_op_has_an_opcheck_case():
    assert set(_dispatch.LIBRARY_OPS) == set(OPCHECK_CASES)


@pytest.mark.parametrize("name", list(OPCHECK_CASES))
def test_opcheck(name):
    torch.library.opcheck(_dispatch.LIBRARY_OPS[name], OPCHECK_CASES[name]())


def _weight(*shape):
    """A parameter scaled as nn.Linear's, so that a stack of layers keeps its activations ~1."""
    return (torch.randn(*shape) / shape[-1] ** 0.5).requires_grad_()


def _params():
    p = {"w": _weight(16), "b": _weight(16), "gate": _weight(24, 16), "up": _weight(24, 16), "down": _weight(16, 24),
         "head": _weight(37, 16)}
    p["loras"] = [ops.LoraProjection(p[name], _weight(2, p[name].shape[1]), _weight(p[name].shape[0], 2), 0.5)
                  for name in ("gate", "up", "down")]
    return p


def _leaves(p):
    return [p[name] for name in ("w", "b", "gate", "up", "down", "head")] + [
        t for lora in p["loras"] for t in (lora.lora_a, lora.lora_b)
    ]


def _step(p, x, target, cos, sin):
    """A loss through every op (those without kernels trace their references inside torch.compile)."""
    h = F.rms_norm(x, p["w"])
    h, total = F.add_rms_norm(h, x, p["w"], offset=1.0, casting="gemma")
    h = F.layer_norm(h, p["w"], p["b"])
    q, k = F.rope(h.view(2, 5, 2, 8).transpose(1, 2), total.view(2, 5, 2, 8).transpose(1, 2), cos, sin)
    h = (q + k).transpose(1, 2).reshape(2, 5, 16)
    h = F.swiglu(h, total) + F.geglu(total, h)
    h = F.glu_mlp(h, p["gate"], p["up"], p["down"], activation="gelu_tanh")
    h, total = F.add_rms_norm_glu_mlp(h, total, p["w"], 1e-6, p["gate"], p["up"], p["down"])
    h = F.lora_gated_mlp(h + total, *p["loras"])
    gate, up = F.linear_group(h, [p["gate"], p["up"]])
    h = h + F.lora_linear(gate * up, *p["loras"][2])
    logits = torch.nn.functional.linear(h, p["head"])
    return F.linear_cross_entropy(h, p["head"], target) + F.cross_entropy(logits, target, z_loss_scale=1e-4)


LIBRARY_OPS_IN_STEP = {"rms_norm", "layer_norm", "rope", "glu", "glu_mlp", "linear_cross_entropy", "cross_entropy"}


def _recording_backend(graphs):
    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    return backend


def _tigon_ops(graphs):
    return {
        node.target.name().split("::")[1]
        for gm in graphs for node in gm.graph.nodes
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
        and node.target.namespace == "tigon"
    }


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_step_runs_the_kernels_without_graph_breaks(dynamic):
    params, x, target = _params(), _t(2, 5, 16, grad=True), _target(2, 5)
    cos, sin = _t(5, 8), _t(5, 8)
    eager_params, eager_x = copy.deepcopy(params), x.detach().clone().requires_grad_()
    want = _step(eager_params, eager_x, target, cos, sin)
    want.backward()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graphs = []
    compiled = torch.compile(_step, backend=_recording_backend(graphs), fullgraph=True, dynamic=dynamic)
    with kernel_launches() as launches:
        loss = compiled(params, x, target, cos, sin)
        loss.backward()
    assert not torch._dynamo.utils.counters["graph_break"]
    assert _tigon_ops(graphs) == LIBRARY_OPS_IN_STEP
    assert launches["_rms_norm_bwd_kernel"] and launches["_glu_bwd_kernel"] and launches["_ce_bwd_kernel"]
    assert_close(loss, want.detach(), name="loss")
    for i, (ours, theirs) in enumerate(zip([x, *_leaves(params)], [eager_x, *_leaves(eager_params)])):
        assert_close(ours.grad, theirs.grad, name=f"grad {i}")


def test_debug_mode_leaves_the_compiled_step_one_graph(monkeypatch):
    """TIGON_DEBUG's host-side checks (the targets' range read back) run outside torch.compile
    only: traced, they would break the step's graph (and under CUDA-graph replay each break is
    host time between replays), and so would reading the environment on torch 2.11."""
    monkeypatch.setenv("TIGON_DEBUG", "1")
    params, x, target = _params(), _t(2, 5, 16, grad=True), _target(2, 5)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(_step, backend="aot_eager", fullgraph=True)
    compiled(params, x, target, _t(5, 8), _t(5, 8)).backward()
    assert not torch._dynamo.utils.counters["graph_break"]


def _losses_of(out):
    """A fused op's output as (the tensors to differentiate, the detached metrics)."""
    if isinstance(out, tuple) and isinstance(out[1], dict):
        return [out[0]], dict(out[1])
    return ([out] if isinstance(out, torch.Tensor) else list(out)), {}


def _fused_case(name):
    """(fn, tensors) of a fused op with every option that changes what its library op computes."""
    h, w, b, target = _t(4, 6, 16, grad=True), _t(37, 16, grad=True), _t(37, grad=True), _target(4, 6)
    if name == "linear_log_probs":  # a frozen head: hidden's gradient is formed in forward
        w.requires_grad_(False)
        return (lambda h, w: F.linear_log_probs(h, w, target, temperature=0.8, return_entropy=True,
                                                max_chunk_bytes=600)), (h, w)
    if name == "linear_preference_loss":  # KTO's baseline estimated: the two-pass plan
        labels, ref = torch.tensor([True, False, True, True]), _t(4) - 20
        return (lambda h, w, b: F.linear_preference_loss(h, w, target, b, method="kto", labels=labels,
                                                         ref_log_probs=ref, nll_weight=0.5,
                                                         average_log_probs=True)), (h, w, b)
    if name == "linear_policy_loss":
        old, ref, mask, advantages = _t(4, 6) - 4, _t(4, 6) - 4, torch.rand(4, 6) > 0.2, _t(4)
        sampling = old + torch.rand(4, 6)  # the sampler's: a sequence-level weight, capped and clipped below
        return (lambda h, w, b: F.linear_policy_loss(
            h, w, target.clamp(min=0), old, advantages, ref_log_probs=ref, beta=0.04, loss_type="luspo", delta=1.3,
            mask=mask, bias=b, sampling_log_probs=sampling, importance_sampling_mode="sequence_truncate",
            importance_sampling_clip_min=0.5)), (h, w, b)
    if name == "linear_distill_loss":
        teacher_h, teacher_w = _t(4, 6, 12), _t(37, 12)
        return (lambda h, w, b: F.linear_distill_loss(h, w, teacher_h, teacher_w, target, loss="tvd", temperature=2.0,
                                                      hard_weight=0.3, student_bias=b)), (h, w, b)
    # moe_experts: top-2 of 5 experts, LoRA on the down projection in another dtype
    index = torch.randint(0, 5, (7, 2))
    tensors = (_t(7, 16, grad=True), torch.rand(7, 2, requires_grad=True), _t(5, 24, 16, grad=True),
               _t(5, 16, 12, grad=True), _t(5, 3, 12, grad=True, dtype=torch.float16),
               _t(5, 16, 3, grad=True, dtype=torch.float16))
    return (lambda x, w, w1, w2, a2, l2: F.moe_experts(x, index, w, w1, w2, down_lora=(a2, l2, 0.5), limit=2.0)), tensors


@pytest.mark.parametrize(
    "name", ["linear_log_probs", "linear_preference_loss", "linear_policy_loss", "linear_distill_loss", "moe_experts"]
)
def test_fused_ops_compile_to_their_library_ops(name):
    fn, tensors = _fused_case(name)
    eager = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    want, want_metrics = _losses_of(fn(*eager))
    grads = [torch.randn_like(o) for o in want]
    torch.autograd.backward(want, grads)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graphs = []
    compiled = torch.compile(fn, backend=_recording_backend(graphs), fullgraph=True)
    got, got_metrics = _losses_of(compiled(*tensors))
    torch.autograd.backward(got, grads)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert _tigon_ops(graphs) == {name}  # its library op, the same name
    for i, (ours, theirs) in enumerate(zip(got, want)):
        assert_close(ours, theirs.detach(), name=f"{name} output {i}")
    assert got_metrics.keys() == want_metrics.keys()
    for key, value in want_metrics.items():
        assert_close(got_metrics[key], value, name=f"{name} {key}")
    for i, (ours, theirs) in enumerate(zip(tensors, eager)):
        if theirs.requires_grad:
            assert_close(ours.grad, theirs.grad, name=f"{name} grad {i}")


def test_misaligned_expert_weights_reach_torchs_gemm_aligned_under_compile(monkeypatch):
    # Tracing cannot read an address (dynamo traces neither data_ptr nor storage_offset), so the
    # compiled op chooses torch's grouped GEMM blind to it: the library ops copy a weight that
    # starts 4 bytes into its storage before that GEMM, which needs 16-byte aligned operands.
    aligned = []

    def checked(a, b, **kwargs):
        aligned.append(a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0)
        return real(a, b, **kwargs)

    real = moe._grouped_mm
    monkeypatch.setattr(moe, "_grouped_mm", checked)
    index = torch.randint(0, 5, (7, 2))
    x, w = _t(7, 16, grad=True), torch.rand(7, 2, requires_grad=True)
    w1, w2 = (torch.randn(5 * rows * cols + 1)[1:].view(5, rows, cols).requires_grad_()
              for rows, cols in ((24, 16), (16, 12)))
    assert w1.data_ptr() % 16 and w2.data_ptr() % 16
    with pytest.raises(ValueError, match="address or strides are not multiples of 16 bytes"):
        F.moe_experts(x, index, w, w1, w2, gemm="grouped_mm")  # eager: refused, "auto" picks Triton
    eager = [t.detach().clone().requires_grad_() for t in (x, w, w1, w2)]
    want = F.moe_experts(*eager[:1], index, *eager[1:], gemm="grouped_mm")
    grad = torch.randn_like(want)
    want.backward(grad)

    torch._dynamo.reset()
    got = torch.compile(lambda *a: F.moe_experts(a[0], index, *a[1:], gemm="grouped_mm"), fullgraph=True,
                        backend="aot_eager")(x, w, w1, w2)
    got.backward(grad)
    assert aligned and all(aligned)
    assert_close(got, want.detach(), name="output")
    for i, (ours, theirs) in enumerate(zip((x, w, w1, w2), eager)):
        assert_close(ours.grad, theirs.grad, name=f"grad {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", ["triton", "grouped_mm", "hybrid"])
def test_compiled_moe_experts_on_each_gemm_back_end(gemm):
    n, hidden, inter, experts = 300, 256, 128, 8
    index = torch.topk(torch.randn(n, experts, device="cuda"), 2).indices
    tensors = [
        torch.randn(n, hidden, device="cuda").bfloat16().requires_grad_(),
        torch.rand(n, 2, device="cuda").requires_grad_(),
        (torch.randn(experts, 2 * inter, hidden, device="cuda") / hidden**0.5).bfloat16().requires_grad_(),
        (torch.randn(experts, hidden, inter, device="cuda") / inter**0.5).bfloat16().requires_grad_(),
    ]

    def fn(x, w, w1, w2):
        return F.moe_experts(x, index, w, w1, w2, gemm=gemm)

    eager = [t.detach().clone().requires_grad_() for t in tensors]
    want = fn(*eager)
    grad = torch.randn_like(want)
    want.backward(grad)
    torch._dynamo.reset()
    graphs = []
    got = torch.compile(fn, backend=_recording_backend(graphs), fullgraph=True)(*tensors)
    got.backward(grad)
    assert _tigon_ops(graphs) == {"moe_experts"}
    assert_close(got, want.detach(), name=f"{gemm} output")
    for i, (ours, theirs) in enumerate(zip(tensors, eager)):
        assert_close(ours.grad, theirs.grad, name=f"{gemm} grad {i}")


def test_a_second_width_under_compile_keeps_the_kernels():
    # Qwen3's per-head q/k norms reach one compiled frame with a second width: dynamo recompiles it
    # with the width symbolic, which the library ops take (their kernels see the real sizes).
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(lambda x, w: F.rms_norm(x, w) * 2, backend=_recording_backend(graphs), fullgraph=True)
    with kernel_launches() as launches:
        for width in (24, 8, 40):
            x, w = _t(3, width), _t(width)
            assert_close(compiled(x, w), 2 * ops.rms_norm_reference(x, w), name=f"width {width}")
    assert launches["_rms_norm_fwd_kernel"] == 3
    assert len(graphs) == 2  # the second width made the width symbolic; the third reused that graph


def test_glu_multipliers_and_a_weightless_norm_under_compile():
    """Falcon-H1's scaled SwiGLU and an RMSNorm without a weight trace into the library ops (no
    graph break) and give the references' values and gradients."""
    torch._dynamo.reset()
    graphs = []

    def step(x, up):
        return F.swiglu(F.rms_norm(x, None), up, gate_multiplier=0.7, out_multiplier=1.3)

    def reference(x, up):
        return ops.swiglu_reference(ops.rms_norm_reference(x, None), up, 0.7, 1.3)

    compiled = torch.compile(step, backend=_recording_backend(graphs), fullgraph=True)
    x, up = _t(3, 37, grad=True), _t(3, 37, grad=True)
    x_ref, up_ref = (t.detach().clone().requires_grad_() for t in (x, up))
    with kernel_launches() as launches:
        compiled(x, up).sum().backward()
    reference(x_ref, up_ref).sum().backward()
    assert launches["_glu_bwd_kernel"] and launches["_rms_norm_bwd_kernel"]
    assert {"glu", "rms_norm"} <= _tigon_ops(graphs)
    assert_close(x.grad, x_ref.grad, name="x grad")
    assert_close(up.grad, up_ref.grad, name="up grad")


def test_reasons_to_run_the_reference_are_decided_when_tracing(monkeypatch):
    monkeypatch.setenv("TIGON_DISABLE", "rms_norm")
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(lambda x, w: F.rms_norm(x, w) + F.swiglu(x, x), backend=_recording_backend(graphs), fullgraph=True)
    x, w = _t(3, 24), _t(24)
    assert_close(compiled(x, w), ops.rms_norm_reference(x, w) + ops.swiglu_reference(x, x), name="disabled")
    assert _tigon_ops(graphs) == {"glu"}


@pytest.mark.gpu
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_compiled_training_step_of_a_patched_llama_runs_tigons_kernels(lora):
    """One graph (the device's torch broke it where this machine's does not: an id() of a tensor
    in a hand-off), tigon's kernels inside, eager's loss and gradients."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).cuda().train()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                 "gate_proj", "up_proj", "down_proj"]))
    compiled_model = copy.deepcopy(model)
    tigon.patch(model)
    tigon.patch(compiled_model)
    ids = torch.randint(0, config.vocab_size, (2, 96), device="cuda")

    def step(m):
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach()

    want = step(model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(compiled_model)
    step(compiled)  # compiles
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    compiled_model.zero_grad()
    with kernel_launches() as launches:
        got = step(compiled)
    assert sum(launches.values()) > 0, launches
    assert launches["_rms_norm_fwd_kernel"] and launches["_rope_kernel"] and launches["_ce_fwd_kernel"], launches
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for (name, ours), theirs in zip(compiled_model.named_parameters(), model.parameters()):
        if theirs.requires_grad:
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.parametrize("dynamic", [False, True])
def test_vision_ops_compile_to_their_library_ops(dynamic):
    """M-RoPE, the vision rotary, GELU and the GELU MLP trace into their library ops with no
    graph break, run their kernels, and give eager's values and gradients."""
    tensors = (_t(2, 5, 3, 16).transpose(1, 2).requires_grad_(), _t(2, 1, 5, 16, grad=True), _t(7, 2, 16, grad=True),
               _t(7, 2, 16, grad=True), _t(3, 7, 16, grad=True), _weight(24, 16), _weight(16, 24), _weight(24))
    tables, vision = (_t(3, 1, 5, 16), _t(3, 1, 5, 16)), (_t(7, 16), _t(7, 16))

    def step(q, k, vq, vk, x, w1, w2, b1):
        q, k = F.mrope(q, k, *tables, [2, 3, 3], interleaved=True)
        vq, vk = F.vision_rope(vq, vk, *vision)
        h = F.gelu_mlp(x, w1, w2, b1, approximate="sigmoid") + F.gelu(x, "tanh")
        return (q.sum(1) * k.sum(1)).sum() + (vq * vk).sum() + h.square().sum()

    eager = [t.detach().clone().requires_grad_() for t in tensors]
    want = step(*eager)
    want.backward()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graphs = []
    compiled = torch.compile(step, backend=_recording_backend(graphs), fullgraph=True, dynamic=dynamic)
    with kernel_launches() as launches:
        got = compiled(*tensors)
        got.backward()
    assert not torch._dynamo.utils.counters["graph_break"]
    assert _tigon_ops(graphs) == {"mrope", "gelu", "gelu_mlp"}  # vision_rope runs mrope's library op
    assert launches["_mrope_kernel"] == 4 and launches["_gelu_bwd_kernel"] == 2, launches
    assert_close(got, want.detach(), name="loss")
    for i, (ours, theirs) in enumerate(zip(tensors, eager)):
        assert_close(ours.grad, theirs.grad, name=f"grad {i}")
