"""tigon.patch.moe.experts_forward against transformers' own experts modules (their expert loop and
their grouped_mm path), and the "tigon" experts implementation in whole tiny models, with and
without PEFT LoRA on the expert weights."""

import importlib

import pytest
import torch

import tigon.ops.moe as moe
from tigon.patch.moe import experts_forward, register_experts_implementation, unsupported_reason
from tests.helpers import assert_close
from tests.ops.composite.test_lora import one_cpu_thread  # noqa: F401 (autouse fixture)
from tests.patch.tiny import batch, tiny_model

N, K, E, H, I = 37, 2, 5, 48, 40
E_TINY = 4  # tests/patch/tiny.py's qwen3_moe

EXPERTS = {
    "qwen3_moe": "Qwen3MoeExperts",
    "mixtral": "MixtralExperts",
    "deepseek_v3": "DeepseekV3Experts",
    "gpt_oss": "GptOssExperts",
}


def _hf_experts(model_type, device, hidden=H, inter=I, experts=E, top_k=K):
    """The family's experts module from a tiny config, random weights (wide enough that gpt-oss's
    clamps bind), running transformers' expert loop. Each size goes to every name the families
    give it at once: qwen3_moe's num_experts is an alias of num_local_experts, so setting the two
    apart left the module with the later one's count of experts."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        model_type, hidden_size=hidden, intermediate_size=inter, moe_intermediate_size=inter, num_experts=experts,
        num_local_experts=experts, n_routed_experts=experts, num_experts_per_tok=top_k,
    )
    config._experts_implementation = "eager"
    module = getattr(importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}"),
                     EXPERTS[model_type])(config)
    assert module.gate_up_proj.shape[0] == experts, module
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return module.to(device)


def _inputs(device):
    x = (3 * torch.randn(N, H, device=device)).requires_grad_()
    weights, index = torch.topk(torch.randn(N, E, device=device).softmax(-1), K)
    return x, index, weights.requires_grad_()


def _grads(out, x, weights, module, grad):
    return torch.autograd.grad(out, [x, weights, *module.parameters()], grad)


def _assert_matches(module, hf_forward, device, gemm="auto"):
    x, index, weights = _inputs(device)
    want = hf_forward(module, x, index, weights)
    got = experts_forward(module, x, index, weights, gemm=gemm)
    assert_close(got, want, name="output")
    grad = torch.randn_like(want)
    names = ["hidden", "top_k_weights", *(n for n, _ in module.named_parameters())]
    for name, ours, theirs in zip(names, _grads(got, x, weights, module, grad), _grads(want, x, weights, module, grad)):
        assert_close(ours, theirs, name=name)
    return x


@pytest.mark.parametrize(("model_type", "gemm"), [
    ("qwen3_moe", "triton"), ("mixtral", "grouped_mm"), ("deepseek_v3", "hybrid"),
    ("gpt_oss", "triton"), ("gpt_oss", "grouped_mm"),
])
def test_matches_the_transformers_expert_loop(poison_outputs, device, model_type, gemm):
    module = _hf_experts(model_type, device)
    assert unsupported_reason(module) is None
    x = _assert_matches(module, lambda m, *a: m(*a), device, gemm)
    if model_type == "gpt_oss":  # the clamps bound somewhere (else they would be untested)
        gate_up = x.detach() @ module.gate_up_proj.detach()[0] + module.gate_up_proj_bias.detach()[0]
        assert (gate_up.abs() > module.limit).any()


def test_matches_transformers_grouped_mm(poison_outputs, device):
    from transformers.integrations.moe import grouped_mm_experts_forward

    _assert_matches(_hf_experts("qwen3_moe", device), grouped_mm_experts_forward, device)


def test_other_gates_and_layouts_are_refused_by_name(device):
    module = _hf_experts("qwen3_moe", device)
    module.has_post_expert_norm = True
    assert "has_post_expert_norm=True" in unsupported_reason(module)
    module.has_post_expert_norm = False
    module.act_fn = torch.nn.ReLU()
    assert "activation ReLU is not one tigon has" in unsupported_reason(module)
    with pytest.raises(ValueError, match="experts_forward cannot run this module: .*ReLU"):
        experts_forward(module, *_inputs(device))
    assert "not a transformers experts module" in unsupported_reason(torch.nn.Linear(2, 2))


def _train_step(model, impl, ids, labels):
    model.set_experts_implementation(impl)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def _assert_same_steps(model, ids, labels):
    name = register_experts_implementation()
    logits, loss, grads = _train_step(model, "eager", ids, labels)
    logits_t, loss_t, grads_t = _train_step(model, name, ids, labels)
    assert_close(logits_t, logits, name="logits")
    assert_close(loss_t, loss, name="loss")
    assert grads.keys() == grads_t.keys() and grads
    for key in grads:
        assert_close(grads_t[key], grads[key], name=key)
    return grads


def test_experts_implementation_in_a_model(device):
    # Mixtral's loss includes the router's aux loss (output_router_logits): unchanged, and its
    # gradient reaches the router through both it and the routing weights.
    model = tiny_model("mixtral", device=device)
    ids, _, labels = batch()
    grads = _assert_same_steps(model, ids.to(device), labels.to(device))
    assert any("experts.gate_up_proj" in key for key in grads)


def test_peft_lora_on_expert_weights_runs_on_the_factors(device, monkeypatch):
    from peft import LoraConfig, get_peft_model

    calls = []
    real = moe._triton_weights
    monkeypatch.setattr(moe, "_triton_weights", lambda *a, **k: calls.append(a[3].shape) or real(*a, **k))
    model = tiny_model("qwen3_moe", device=device)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=[], init_lora_weights=False,
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = get_peft_model(model, config)
    ids, _, labels = batch()
    grads = _assert_same_steps(model.base_model.model, ids.to(device), labels.to(device))
    assert grads and all("lora_" in key for key in grads)
    # One MoE layer: its four adapter gradients, no gradient GEMM for the frozen expert weights.
    experts = model.base_model.model.model.layers[0].mlp.experts.get_base_layer()
    frozen = {experts.gate_up_proj.shape, experts.down_proj.shape}
    assert len(calls) == 4 and all(shape[0] == E_TINY and shape not in frozen for shape in calls)


def _errors_against_float64(device, dtype, tokens, hidden, inter, experts, top_k):
    """Relative errors (output, then every gradient) of transformers' expert loop and of tigon's op,
    both in `dtype`, against a float64 run of the same Qwen3-MoE experts module."""
    import copy

    module = _hf_experts("qwen3_moe", device, hidden=hidden, inter=inter, experts=experts, top_k=top_k)
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(0.1)
    exact = copy.deepcopy(module).double()
    module = module.to(dtype)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    weights, index = torch.topk(torch.randn(tokens, experts, device=device).softmax(-1), top_k)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype).requires_grad_()
    x64, w64 = x.detach().double().requires_grad_(), weights.detach().double().requires_grad_()
    want = exact(x64, index, w64)
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, [x64, w64, *exact.parameters()], grad)

    def errors(out):
        grads = torch.autograd.grad(out, [x, weights, *module.parameters()], grad.to(out.dtype))
        return [((o.double() - r).norm() / r.norm()).item() for o, r in zip((out, *grads), (want, *want_grads))]

    return errors(experts_forward(module, x, index, weights)), errors(module(x, index, weights))


def test_error_no_larger_than_the_transformers_loop(device):
    # The GPU test's body at a small shape, with more experts and a larger top-k than _hf_experts'
    # defaults: a module built with fewer experts than the router's ids index out of range in
    # transformers' loop (one_hot: an error on the CPU, a device-side assert that poisons the
    # process on CUDA). fp16 errors here are ~6e-4 for both, so no absolute slack.
    ours, hf = _errors_against_float64(device, torch.float16, 37, 48, 40, 7, 3)
    assert all(o <= 1.1 * h for o, h in zip(ours, hf)), (ours, hf)


@pytest.mark.gpu
def test_bf16_error_no_larger_than_the_transformers_loop_on_gpu():
    # Qwen3-30B-A3B's experts in bf16: tigon's error against a float64 run of the same module is
    # at most the expert loop's own (which rounds and accumulates in bf16 per expert).
    ours, hf = _errors_against_float64(torch.device("cuda"), torch.bfloat16, 8192, 2048, 768, 128, 8)
    assert all(o <= 1.1 * h + 1e-3 for o, h in zip(ours, hf)), (ours, hf)


def test_router_loss_default_follows_the_installed_head():
    # Some transformers releases' multimodal MoE heads read `output_router_logits` only from their
    # keyword arguments: the config's True then adds no router loss, and the patched head must not
    # add one either. One that names the argument takes the config's default, router loss included.
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from tigon.patch.families import MOE_HEAD
    from tigon.patch.head import causal_lm_forward

    model = tiny_model("mixtral").train()
    ids, _, labels = batch()
    names_it = type(model).forward

    def reads_kwargs(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        return names_it(self, input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                        output_router_logits=kwargs.pop("output_router_logits", False), **kwargs)

    losses = []
    for original in (names_it, reads_kwargs):
        want = original(model, input_ids=ids, labels=labels).loss
        patched = causal_lm_forward(MOE_HEAD, True, original, load_balancing_loss_func)
        assert_close(patched(model, input_ids=ids, labels=labels).loss, want, name="loss")
        losses.append(want.item())
    assert losses[0] > losses[1]  # the router loss is in the first
