"""tigon.patch on tiny random models of every family: same logits, loss and gradients as HF."""

from __future__ import annotations

import copy
import functools
import importlib
import inspect

import pytest
import torch

import tigon
from tests.helpers import assert_close, saved_activation_bytes
from tigon.patch.apply import layer_plans
from tigon.patch.handoff import Relay
from tests.patch.tiny import batch, family_params, tiny_model
from tigon.patch import FAMILIES
from tigon.patch.families import Family, Norm, modeling_module


@pytest.fixture(autouse=True)
def clean_patches(monkeypatch):
    """Undo every patch after each test, before monkeypatch restores what tests replaced."""
    yield
    tigon.unpatch()


def modeling(family: Family):
    return importlib.import_module(modeling_module(family))


def run(model, seed=0, **kwargs):
    """Loss, logits and every parameter's gradient after one forward/backward in training mode."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks on both sides
    device = next(model.parameters()).device
    ids, mask, labels = (t.to(device) for t in batch(seed))
    out = model(input_ids=ids, attention_mask=mask, labels=labels, **kwargs)
    out.loss.backward()
    module = getattr(model, "_orig_mod", model)  # torch.compile's wrapper prefixes the names
    grads = {n: p.grad for n, p in module.named_parameters() if p.requires_grad}
    return out.loss.detach(), (None if out.logits is None else out.logits.detach()), grads


def assert_same_run(got, want):
    loss, logits, grads = got
    want_loss, want_logits, want_grads = want
    assert_close(loss, want_loss, name="loss")
    if logits is not None:
        assert_close(logits, want_logits, name="logits")
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert grad is not None, f"no gradient for {name}"
        assert_close(grad, want_grads[name], name=f"grad {name}")


def norm_class(family: Family, norm: Norm) -> type:
    return torch.nn.LayerNorm if norm.in_torch else getattr(modeling(family), norm.cls)


def forbid_hf_code(monkeypatch, family: Family):
    """Make the HF code that tigon replaces raise, so a replacement that quietly falls back to it
    fails the test instead of passing as HF's own numbers."""
    module = modeling(family)

    def forbidden(*args, **kwargs):
        raise AssertionError("tigon's replacement fell back to HF's code")

    names = [family.causal_lm] + ([family.mlp.cls] if family.mlp and family.mlp.gated else [])
    names += [family.layer.cls] if family.layer.fuse else []
    for name in names:
        monkeypatch.setattr(getattr(module, name), "forward", forbidden)
    for norm in family.norms:
        monkeypatch.setattr(norm_class(family, norm), "forward", forbidden)
    for rope in family.ropes:
        monkeypatch.setattr(module, rope.function, forbidden)


# The fused experts op runs in the families test for one family of each experts layout (the
# interpreter adds seconds per family): concatenated gate/up (qwen3_moe), shared experts and group
# routing (deepseek_v3), transposed and interleaved with biases and a clamped gate (gpt_oss); the
# others check that the op takes their experts (test_every_moe_familys_experts_go_to_the_fused_op).
MOE_CASES = ("qwen3_moe", "deepseek_v3", "gpt_oss")


@pytest.mark.parametrize("model_type", family_params())
def test_instance_patch_matches_hf(model_type, monkeypatch, device):
    """Patching a model already on its device (the GPU in GPU runs)."""
    family = FAMILIES[model_type]
    model = tiny_model(model_type, device=device)
    patched = copy.deepcopy(model)
    want = run(model)
    forbid_hf_code(monkeypatch, family)
    groups = count_groups(monkeypatch)
    experts_calls = count_calls(monkeypatch, "moe_experts")
    fused_experts = family.experts is not None and (model_type in MOE_CASES or device.type == "cuda")
    result = tigon.patch(patched, moe_experts=fused_experts)
    expected = {family.norm.switch, "linear_cross_entropy"} | ({"rope"} if family.ropes else set())
    expected |= {"moe_experts"} if fused_experts else set()
    expected |= {family.mlp.switch} if family.mlp and family.mlp.gated else set()
    expected |= {"add_rms_norm"} if family.layer.fuse else set()
    expected |= {"qkv_group"} if family.attention else set()
    assert expected <= set(result.applied)
    assert result.layers == 2
    got = run(patched)
    assert got[1] is None, "training with labels must not materialise the logits"
    if family.layer.fuse:  # each layer's closing add runs with the norm after it
        layers = [m for m in patched.modules() if type(m).__name__ == family.layer.cls]
        plans = layer_plans(patched)
        assert len(plans) == len(layers) and all(plan.next_norm is not None for plan in plans)
    # (Hybrid models hold their attention in some layers only.)
    attentions = sum(type(m).__name__ == family.attention.cls for m in patched.modules()) if family.attention else 0
    assert len(groups) == attentions
    experts = sum(type(m).__name__ == family.experts for m in patched.modules()) if fused_experts else 0
    assert len(experts_calls) == experts
    assert_same_run(got, want)


def count_calls(monkeypatch, op: str) -> list:
    """A list that grows by one at each call of ``tigon.functional.<op>``."""
    from tigon import functional

    calls = []
    original = getattr(functional, op)
    monkeypatch.setattr(functional, op, lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


def count_groups(monkeypatch) -> list:
    """A list that grows by one each time a patched attention runs its q/k/v as one group."""
    return count_calls(monkeypatch, "linear_group")


def snapshot(module):
    """Every module-level object and every class's own forward in a modeling module."""
    state = dict(vars(module))
    for name, obj in vars(module).items():
        if isinstance(obj, type) and obj.__module__ == module.__name__:
            state[f"{name}.forward"] = vars(obj).get("forward")
    return state


def changed(before, after):
    return sorted(k for k in before.keys() | after.keys() if before.get(k) is not after.get(k))


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_class_patch_matches_hf_and_unpatch_restores(model_type):
    module = modeling(FAMILIES[model_type])
    before = snapshot(module)
    want = run(tiny_model(model_type))
    result = tigon.patch(model_type)
    assert str(result).startswith("tigon: applied rms_norm")
    assert changed(before, snapshot(module))
    assert_same_run(run(tiny_model(model_type)), want)
    tigon.unpatch(model_type)
    assert changed(before, snapshot(module)) == []


def build_norm(cls: type, norm: Norm, width: int) -> torch.nn.Module:
    """A norm module of `cls`, `width` wide, with random parameters."""
    module = cls(*((width,) if norm.weight or norm.kind == "layer" else ()),
                 **({} if isinstance(norm.eps, float) else {"eps": 1e-5}))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    return module


# The interpreter rounds bf16 differently from the GPU, so bf16 runs on the GPU only.
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("model_type", family_params(
    t for t, f in FAMILIES.items() if any(not norm.in_torch for norm in f.norms)
))
def test_norm_rounding_matches_hf_in_low_precision(model_type, dtype, device):
    """fp32 models cannot tell the families' rounding orders apart; 16-bit inputs can: with the
    right one almost every element is bit-identical to HF's module, with a wrong one many are not."""
    family = FAMILIES[model_type]
    gen = torch.Generator().manual_seed(1)
    for norm in (norm for norm in family.norms if not norm.in_torch):
        cls = getattr(modeling(family), norm.cls)
        # (A subclass of torch's LayerNorm takes no weight of another dtype than its input.)
        for weight_dtype in (dtype,) if norm.casting == "torch" else (dtype, torch.float32):
            module = build_norm(cls, norm, 96).to(device, weight_dtype)
            x = (torch.randn(64, 96, generator=gen) * 3).to(device, dtype)
            want = module(x)
            tigon.patch(model_type, add_rms_norm=False)
            got = module(x)
            tigon.unpatch(model_type)
            assert got.dtype == want.dtype
            mismatched = (got != want).float().mean().item()
            assert mismatched < 0.02, f"{mismatched:.1%} of elements differ from HF's {cls.__name__}"


def test_instance_unpatch_restores_hf_forwards():
    model = tiny_model("llama")
    norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    tigon.patch(model)
    assert all("forward" in vars(m) for m in norms)
    tigon.unpatch(model)
    assert not any("forward" in vars(m) for m in norms)


@pytest.mark.parametrize("model_type", family_params(t for t, f in FAMILIES.items() if f.experts))
def test_every_moe_familys_experts_go_to_the_fused_op(model_type):
    """Each family the table gives experts holds experts modules of that class, which the fused op
    computes (no fallback to transformers' loop), and patching sets the op as their implementation."""
    from tigon.patch.moe import unsupported_reason

    model = tiny_model(model_type)
    experts = [m for m in model.modules() if type(m).__name__ == FAMILIES[model_type].experts]
    assert experts and all(unsupported_reason(m) is None for m in experts)
    assert "moe_experts" in tigon.patch(model).applied
    assert all(m.config._experts_implementation == "tigon" for m in experts)


def test_moe_experts_switch_sets_the_instances_experts_implementation_and_unpatch_restores_it():
    model = tiny_model("qwen3_moe")
    before = model.config._experts_implementation
    assert before != "tigon"
    assert "moe_experts" in tigon.patch(model).applied
    assert model.config._experts_implementation == "tigon"
    tigon.patch(model)  # undoes the first patch, then sets it again
    tigon.unpatch(model)
    assert model.config._experts_implementation == before
    assert "moe_experts" not in tigon.patch(model, moe_experts=False).applied
    assert model.config._experts_implementation == before
    # A class patch has no instance whose setting it could change.
    assert "moe_experts" not in tigon.patch("qwen3_moe").applied
    assert model.config._experts_implementation == before


def test_patch_twice_replaces_the_first_patch():
    model = tiny_model("llama")
    tigon.patch(model)
    assert tigon.patch(model, rms_norm=False).applied.count("rms_norm") == 0
    assert not any("forward" in vars(m) for m in model.modules() if type(m).__name__ == "LlamaRMSNorm")


def test_unknown_model_type_lists_supported_and_patches_nothing():
    with pytest.raises(ValueError, match="supported: .*gemma2.*llama.*qwen3_moe"):
        tigon.patch("gpt2")
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(ValueError, match="'gpt2'"):
        tigon.patch(model)
    assert not any("forward" in vars(m) for m in model.modules())


def test_bad_arguments():
    with pytest.raises(ValueError, match="linear_cross_entropy and cross_entropy"):
        tigon.patch("llama", cross_entropy=True, linear_cross_entropy=True)
    with pytest.raises(ValueError, match="target must be"):
        tigon.patch(42)


# The reference always runs before tigon.patch: RoPE is swapped module-wide, so an unpatched model
# of the same family run afterwards would use tigon's RoPE too.

LOSS_CASES = ["llama", "gemma2", "granite", "qwen3_moe"]  # plain, softcap, logit scaling, MoE router loss


@pytest.mark.parametrize("model_type", LOSS_CASES)
def test_cross_entropy_switch_matches_hf(model_type, device):
    model = tiny_model(model_type, device=device)
    want = run(model)
    # (The fused experts op is tested on its own: MOE_CASES.)
    assert "cross_entropy" in tigon.patch(model, linear_cross_entropy=False, cross_entropy=True, moe_experts=False).applied
    got = run(model)
    assert got[1] is not None
    assert_same_run(got, want)


def loss_options_runs(model, device):
    """One run per HF loss option: gradient accumulation's num_items_in_batch (tensor and int),
    precomputed shift_labels, logits_to_keep with matching shift_labels."""
    ids, mask, labels = (t.to(device) for t in batch(3))
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    cases = [
        dict(labels=labels, num_items_in_batch=torch.tensor(37)),
        dict(labels=labels, num_items_in_batch=41),
        dict(labels=labels, shift_labels=shift),
        dict(labels=labels[:, -5:], shift_labels=shift[:, -5:].contiguous(), logits_to_keep=5),
    ]
    runs = []
    model.train()
    for kwargs in cases:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, attention_mask=mask, **kwargs)
        out.loss.backward()
        grads = {name: param.grad for name, param in model.named_parameters()}
        runs.append((out.loss.detach(), None if out.logits is None else out.logits.detach(), grads))
    return runs


@pytest.mark.parametrize("model_type", ["gemma2", "qwen3_moe"])
def test_linear_cross_entropy_loss_options_match_hf(model_type, device):
    model = tiny_model(model_type, device=device)
    wants = loss_options_runs(model, device)
    tigon.patch(model, moe_experts=False)  # (the fused experts op: MOE_CASES)
    for got, want in zip(loss_options_runs(model, device), wants):
        assert got[1] is None
        assert_same_run(got, want)


def test_logits_as_hf_without_labels_or_training():
    model = tiny_model("gemma2")
    ids, mask, labels = batch(4)
    cases = (dict(labels=labels), dict(), dict(logits_to_keep=1))
    model.eval()
    with torch.no_grad():
        wants = [model(input_ids=ids, attention_mask=mask, **kwargs) for kwargs in cases]
        tigon.patch(model)
        for kwargs, want in zip(cases, wants):
            got = model(input_ids=ids, attention_mask=mask, **kwargs)
            assert_close(got.logits, want.logits, name="logits")
            assert (got.loss is None) == (want.loss is None)
            if want.loss is not None:
                assert_close(got.loss, want.loss, name="loss")
    model.train()
    as_tuple = model(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    assert isinstance(as_tuple, tuple) and as_tuple[0].dim() == 0


def test_generate_as_hf():
    model = tiny_model("qwen3")
    prompt = batch(5)[0][:1, :6]
    model.eval()
    want = model.generate(prompt, max_new_tokens=3, do_sample=False)
    tigon.patch(model)
    assert "labels" in inspect.signature(model.forward).parameters
    torch.testing.assert_close(model.generate(prompt, max_new_tokens=3, do_sample=False), want)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_fused_layer_mlp_keeps_the_residual_sum_not_the_normed_input(model_type, monkeypatch):
    """The MLP after the fused add + RMSNorm saves the sum the norm keeps anyway, not its normed
    output: one tokens x hidden tensor less per layer, and the same loss and gradients. So it does
    as one op with the add + RMSNorm, and as a module of its own (an MLP with a hook)."""
    model = tiny_model(model_type)
    ids, mask, labels = batch(seed=3)
    tigon.patch(model)

    def saved_bytes_loss_and_grads():
        model.zero_grad(set_to_none=True)
        kept, out = saved_activation_bytes(model, input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        return kept, out.loss, {n: p.grad.clone() for n, p in model.named_parameters()}

    hooks = []
    try:
        joined = saved_bytes_loss_and_grads()
        ran = []
        hooks = [layer.mlp.register_forward_hook(lambda m, i, o: ran.append(1)) for layer in model.model.layers]
        alone = saved_bytes_loss_and_grads()
        assert len(ran) == model.config.num_hidden_layers  # an MLP with a hook runs as its module
        monkeypatch.setattr(Relay, "normed_input_of", lambda self, x: None)
        unfused = saved_bytes_loss_and_grads()
    finally:
        for hook in hooks:
            hook.remove()
        tigon.unpatch(model)
    config = model.config
    assert joined[0] == alone[0]
    assert unfused[0] - alone[0] == config.num_hidden_layers * ids.numel() * config.hidden_size * 4
    for kept, loss, grads in (joined, alone):
        assert torch.equal(loss, unfused[1])
        for name, grad in unfused[2].items():
            assert torch.equal(grads[name], grad), name


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "phi3", "granite"])
def test_residual_add_fuses_with_the_next_layers_norm(model_type, monkeypatch):
    """Instance patching links each decoder layer to the norm after it: every residual add then
    runs with the following norm in one kernel (the last one with the final norm), the add inside
    each layer runs with its norm and the MLP as one op, the only RMSNorms run alone are the first
    layer's input norm (and Gemma 2's sublayer-output norms), and loss, logits and gradients are
    those of the unpatched model."""
    from tigon import functional
    model = tiny_model(model_type)
    want = run(model)
    calls = {"add_rms_norm": 0, "add_rms_norm_glu_mlp": 0, "rms_norm": 0}
    for name in calls:
        original = getattr(functional, name)
        monkeypatch.setattr(
            functional, name, lambda *a, _f=original, _n=name, **k: calls.__setitem__(_n, calls[_n] + 1) or _f(*a, **k)
        )
    tigon.patch(model)
    layers = model.config.num_hidden_layers
    norms = [layer.input_layernorm for layer in model.model.layers[1:]] + [model.model.norm]
    assert [plan.next_norm for plan in layer_plans(model)] == norms
    got = run(model)
    alone = 1 + (2 * layers if model_type == "gemma2" else 0)
    assert calls == {"add_rms_norm": layers, "add_rms_norm_glu_mlp": layers, "rms_norm": alone}
    assert_same_run(got, want)

    # A hook on a norm keeps its module call: that norm runs alone, and the hook sees its output.
    seen = []
    model.model.layers[1].input_layernorm.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    calls.update(add_rms_norm=0, add_rms_norm_glu_mlp=0, rms_norm=0)
    assert_same_run(run(model), want)
    assert len(seen) == 1 and calls["add_rms_norm"] == layers - 1

    # Under gradient checkpointing a layer's recomputation must save what its first pass saved:
    # only the adds inside the layers fuse.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls.update(add_rms_norm=0, add_rms_norm_glu_mlp=0, rms_norm=0)
    assert_same_run(run(model), want)
    # First pass and recomputation, one add each.
    assert calls["add_rms_norm_glu_mlp"] == 2 * layers and calls["add_rms_norm"] == 0

    tigon.unpatch(model)
    assert not layer_plans(model)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_hooks_on_the_norm_a_fused_layer_reads_still_run(model_type):
    """The fused add reads the post-attention (Gemma 2: pre-feedforward) norm's weight without
    calling the module: a hook on that norm sends its layer to the original forward, where the
    module call runs the hook; the numbers stay HF's."""
    model = tiny_model(model_type)
    want = run(model)
    tigon.patch(model)
    norm = getattr(model.model.layers[1], "pre_feedforward_layernorm" if model_type == "gemma2" else "post_attention_layernorm")
    seen, grads_seen = [], []
    handles = [
        norm.register_forward_hook(lambda m, i, o: seen.append(o.shape)),
        norm.register_full_backward_hook(lambda m, gi, go: grads_seen.append(go[0].shape)),
    ]
    try:
        got = run(model)
    finally:
        for handle in handles:
            handle.remove()
        tigon.unpatch(model)
    assert len(seen) == 1 and len(grads_seen) == 1
    assert_same_run(got, want)


def test_fused_loss_runs_with_the_patched_models_chunk_budget(monkeypatch):
    from tigon.ops import linear_cross_entropy as lce
    from tigon.patch import head

    model = tiny_model("llama")
    tigon.patch(model)
    budgets = []
    original = lce.chunk_rows

    def spy(max_chunk_bytes, vocab, dtype):
        budgets.append(max_chunk_bytes)
        return original(max_chunk_bytes, vocab, dtype)

    monkeypatch.setattr(lce, "chunk_rows", spy)
    run(model)
    assert budgets == [head.CAUSAL_LM_LOSS_CHUNK_BYTES]
    assert head.CAUSAL_LM_LOSS_CHUNK_BYTES > lce.DEFAULT_MAX_CHUNK_BYTES


def test_qkv_group_leaves_projections_with_hooks_or_without_grad_alone(monkeypatch):
    """The q/k/v group reads the three weights directly, so a hook on one projection (which the
    group would skip) keeps all three on their own calls; so does a forward without grad, where
    there is no backward to save adds in. Nothing is left on the projections after a call."""
    model = tiny_model("llama")
    want = run(model)
    groups = count_groups(monkeypatch)
    tigon.patch(model)
    attention = model.model.layers[0].self_attn
    seen = []
    handle = attention.k_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert_same_run(run(model), want)
    assert len(seen) == 1 and len(groups) == 1  # layer 0 ungrouped, layer 1 grouped
    handle.remove()
    with torch.no_grad():
        model(input_ids=batch()[0])
    assert len(groups) == 1
    projections = [getattr(layer.self_attn, n) for layer in model.model.layers for n in ("q_proj", "k_proj", "v_proj")]
    assert all("forward" not in vars(p) for p in projections)
    assert_same_run(run(model), want)
    assert len(groups) == 3

    # A module backward hook too: under the group its input would not be what the output came from.
    grads_seen = []
    handle = model.model.layers[1].self_attn.v_proj.register_full_backward_hook(lambda m, gi, go: grads_seen.append(1))
    assert_same_run(run(model), want)
    assert len(grads_seen) == 1 and len(groups) == 4  # layer 0 grouped, layer 1 not
    handle.remove()
    assert tigon.patch(model, qkv_group=False).applied.count("qkv_group") == 0
    assert_same_run(run(model), want)
    assert len(groups) == 4


# Made positions reach HF's mask code the same way in every family: one of each kind of decoder
# (dense, sliding window, MoE, hybrid linear attention, LayerNorm, scaled), at ~7 s a family.
POSITION_CASES = ["llama", "gemma2", "gemma3_text", "granite", "olmo2", "phi", "phi3", "qwen3_moe", "qwen3_next"]


@pytest.mark.parametrize("model_type", family_params(POSITION_CASES))
def test_positions_it_makes_need_no_look_for_packed_sequences(model_type, monkeypatch):
    """With no attention mask and no position ids, HF's mask code looks for packed sequences in the
    positions it made (on a GPU, a device-to-host sync that stalls every step). The patched model
    makes the same positions and tells it there are none without looking, with HF's loss and
    gradients. Position ids a caller passes (packed sequences here) are still examined."""
    from transformers import masking_utils

    looked = []
    real = masking_utils.find_packed_sequence_indices
    spy = lambda p: looked.append(1) or real(p)  # noqa: E731
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", spy)
    ids, _, labels = batch()
    packed = torch.tensor([list(range(6)) + list(range(7))] * ids.shape[0])

    def step(model, embeds=False, **kwargs):
        model.train()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        tokens = {"inputs_embeds": model.get_input_embeddings()(ids)} if embeds else {"input_ids": ids}
        # No cache, as training is run (a cache's sizes would stand in for the positions).
        out = model(**tokens, labels=labels, use_cache=False, **kwargs)
        out.loss.backward()
        return out.loss.detach(), None, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    model = tiny_model(model_type)
    want, want_embeds = step(model), step(model, embeds=True)
    assert looked
    want_packed = step(model, position_ids=packed)
    looked.clear()
    tigon.patch(model, moe_experts=False)  # (the fused experts op: MOE_CASES)
    assert_same_run(step(model), want)
    assert_same_run(step(model, embeds=True), want_embeds)
    assert not looked
    assert_same_run(step(model, position_ids=packed), want_packed)
    assert looked
    assert masking_utils.find_packed_sequence_indices is not spy
    tigon.unpatch(model)
    assert masking_utils.find_packed_sequence_indices is spy


def test_a_captured_causal_mask_without_padding_is_left_to_sdpa(monkeypatch):
    """Inside a CUDA-graph capture (``--cuda-graphs``), a causal mask with no padding over as many
    keys as queries is SDPA's ``is_causal``, as outside one: transformers, counting the capture as
    tracing, would build the full mask. Padding, a local window, a query shorter than the keys,
    and any call outside a capture get transformers' own answer; unpatching restores it."""
    from transformers import masking_utils

    from tigon.patch.head import captured_causal_mask_skip

    asked = []
    real = masking_utils._ignore_causal_mask_sdpa

    @functools.wraps(real)
    def spy(*args, **kwargs):
        asked.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", spy)
    names = list(inspect.signature(real).parameters)
    values = {"padding_mask": None, "q_length": 16, "query_length": 16, "kv_length": 16, "q_offset": 0,
              "kv_offset": 0, "local_attention_size": None}

    def call(fn, **changes):
        return fn(**{n: changes.get(n, values[n]) for n in names})

    model = tiny_model("llama")
    tigon.patch(model)
    skip = masking_utils._ignore_causal_mask_sdpa
    assert skip is captured_causal_mask_skip(spy)
    assert call(skip) == call(real) and len(asked) == 1  # not capturing: transformers answers
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    asked.clear()
    assert call(skip) is True and not asked
    padded = torch.ones(2, 16, dtype=torch.bool)
    window = "local_attention_size" if "local_attention_size" in names else None
    cases = [dict(padding_mask=padded), dict(q_length=1, query_length=1)] + ([{window: 8}] if window else [])
    for changes in cases:
        assert call(skip, **changes) == call(real, **changes)
    assert len(asked) == len(cases)
    tigon.unpatch(model)
    assert masking_utils._ignore_causal_mask_sdpa is spy


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma2"])
def test_training_step_never_waits_for_the_gpu(model_type):
    """A patched model's forward and backward launch everything without a device-to-host sync
    (which would stall the host until the GPU caught up, leaving the GPU idle while the host then
    launches the next kernels): torch raises on any sync in this mode."""
    model = tiny_model(model_type, device="cuda", dtype=torch.bfloat16)
    model.set_attn_implementation("sdpa")  # the eager mask copies a scalar from the host
    tigon.patch(model)
    model.train()
    ids = batch()[0].cuda()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_gelu_new_mlp_fuses_as_tanh_gelu_with_and_without_lora(monkeypatch):
    """One activation table for every path: an MLP whose activation is `gelu_new` (the tanh
    form) runs the tanh-GELU kernels in full fine-tuning and under LoRA alike, with HF's numbers."""
    from peft import LoraConfig, get_peft_model

    from tigon import functional

    calls = []
    for name in ("add_rms_norm_glu_mlp", "glu_mlp", "lora_gated_mlp"):
        real = getattr(functional, name)
        monkeypatch.setattr(
            functional, name, lambda *a, _n=name, _r=real, **k: calls.append((_n, k["activation"])) or _r(*a, **k)
        )
    model = tiny_model("gemma", hidden_activation="gelu_new")
    want = run(model)
    tigon.patch(model)
    assert_same_run(run(model), want)
    assert calls == [("add_rms_norm_glu_mlp", "gelu_tanh")] * 2
    tigon.unpatch(model)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False)
    lora = get_peft_model(model, config)
    want = run(lora)
    calls.clear()
    tigon.patch(lora)
    assert_same_run(run(lora), want)
    assert calls == [("lora_gated_mlp", "gelu_tanh")] * 2


@pytest.mark.parametrize("model_type", family_params(["falcon_h1"]))
def test_falcon_h1_mlp_multipliers_run_in_the_glu_op(model_type, monkeypatch):
    """Falcon-H1's gate and down multipliers reach the SwiGLU op, the down one folded into its
    output scale (the bias-free down_proj is linear), with HF's loss, logits and gradients; a hook
    on one layer's down_proj keeps that layer's down multiplier after it, so the hook sees HF's
    input to it. LoRA down projections fold too (their numbers: tests/patch/test_training.py)."""
    from peft import LoraConfig, get_peft_model

    from tigon import functional

    calls = []
    real = functional.swiglu
    monkeypatch.setattr(functional, "swiglu", lambda g, u, **k: calls.append(tuple(k.values())) or real(g, u, **k))
    seen = []

    def keep_input(module, args, out):
        seen.append(args[0].detach())

    model = tiny_model(model_type)
    next(m for m in model.modules() if type(m).__name__ == "FalconH1MLP").down_proj.register_forward_hook(keep_input)
    want = run(model)
    tigon.patch(model)
    assert_same_run(run(model), want)
    assert calls == [(0.7, 1.0), (0.7, 1.3)]
    assert_close(seen[1], seen[0], name="hooked down_proj input")
    tigon.unpatch(model)

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False)
    lora = get_peft_model(tiny_model(model_type), config)
    calls.clear()
    tigon.patch(lora)
    run(lora)
    assert calls == [(0.7, 1.3)] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("model_type", family_params(["phi", "olmo", "cohere", "nemotron"]))
def test_layer_norm_forward_matches_hf_with_and_without_autocast(model_type, dtype, device):
    """The LayerNorm forwards give the module's dtype and values, plain and under autocast: torch's
    (phi: CUDA's autocast runs it in float32, the CPU's keeps the input's dtype), a family's own in
    float32 (OLMo's without weight or bias, Cohere's without bias), a subclass of torch's scaled
    by 1 + weight (Nemotron's)."""
    from tigon.patch import forwards

    norm = FAMILIES[model_type].norm
    cls = torch.nn.LayerNorm if norm.in_torch else getattr(modeling(FAMILIES[model_type]), norm.cls)
    module = build_norm(cls, norm, 37).to(device)
    forward = forwards.layer_norm_forward(norm, cls.forward)
    x = (torch.randn(3, 11, 37, generator=torch.Generator().manual_seed(4)) * 2).to(device, dtype)
    for autocast in (False, True):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            want, got = module(x), forward(module, x)
        assert got.dtype == want.dtype
        assert_close(got, want, want.dtype, name=f"autocast={autocast}")
    assert_close(forward(module.half(), x.half()), module(x.half()), torch.float16, name="fp16 weights")


def test_readme_lists_every_family_as_the_table_says():
    """README.md's family table is the one tests/patch/families_doc.py renders from FAMILIES
    (regenerate it with ``python -m tests.patch.families_doc``)."""
    from pathlib import Path

    from tests.patch import families_doc

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert families_doc.BEGIN in readme and families_doc.END in readme
    listed = readme.split(families_doc.BEGIN, 1)[1].split(families_doc.END, 1)[0].strip()
    assert listed == families_doc.table(), "README's family table is stale: python -m tests.patch.families_doc"


def test_a_family_the_installed_transformers_lacks_is_refused_in_one_line(monkeypatch):
    import dataclasses

    from tigon.patch import families

    monkeypatch.setitem(FAMILIES, "nosuch", dataclasses.replace(FAMILIES["llama"], module="nosuch"))
    assert not families.available("nosuch") and families.available("llama")
    with pytest.raises(ValueError, match=r"'nosuch' needs transformers\.models\.nosuch\.modeling_nosuch, which "
                                         r"transformers \S+ does not have; nothing was patched"):
        tigon.patch("nosuch")


def test_an_unpatched_model_can_be_freed():
    import gc
    import weakref

    model = tiny_model("llama")
    tigon.patch(model)
    tigon.unpatch(model)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None, "tigon still holds an unpatched model"


@pytest.mark.parametrize("model_type", family_params())
def test_rope_keep_dtype_is_what_hfs_function_does(model_type):
    """A family's rotary function either keeps q's and k's dtype when handed float32 cos/sin (OLMo
    casts back) or promotes: the table's `keep_dtype` must say which, or a bf16 model's attention
    gets float32 queries from the patched path. Checked on HF's own function, not on a model."""
    module = importlib.import_module(modeling_module(FAMILIES[model_type]))
    for rope in FAMILIES[model_type].ropes:
        if rope.form != "cos_sin" or rope.halves or not hasattr(module, rope.function):
            continue
        q, k = (torch.randn(1, 2, 3, 8, dtype=torch.bfloat16) for _ in range(2))
        cos, sin = (torch.randn(1, 3, 8 // 2 if rope.cos == "once" else 8) for _ in range(2))
        q_out, _ = getattr(module, rope.function)(q, k, cos, sin)
        assert (q_out.dtype == torch.bfloat16) == rope.keep_dtype, f"{rope.function}: keep_dtype={rope.keep_dtype}"


@pytest.mark.parametrize("wrap", ["plain", "lora", "own forward", "moe"])
def test_a_model_dropped_while_patched_is_freed(wrap):
    """A notebook that patches a model, trains it and loads the next one must get the first one's
    memory back without calling unpatch: nothing of tigon's may hold a patched model."""
    import gc
    import types
    import weakref

    model = tiny_model("qwen3_moe" if wrap == "moe" else "llama")
    if wrap == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj", "gate_proj"]))
    if wrap == "own forward":  # a forward bound on the instance before the patch (as trainers do)
        model.forward = types.MethodType(type(model).forward, model)
    applied = tigon.patch(model)
    assert wrap != "moe" or "moe_experts" in str(applied)
    model(input_ids=batch()[0])
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None, "tigon still holds a model dropped while patched"


def test_unpatch_restores_a_forward_bound_on_the_instance():
    import types

    model = tiny_model("llama")
    own = types.MethodType(type(model).forward, model)
    model.forward = own
    tigon.patch(model)
    assert model.forward != own
    tigon.unpatch(model)
    assert vars(model)["forward"] == own and vars(model)["forward"].__self__ is model


def test_instance_patch_survives_transformers_hub_kernels(tmp_path):
    """transformers >= 5.25 loads with its hub kernels on (the `kernels` package) and re-kernelizes
    at each train()/eval() switch, which drops every forward set on a module instance: tigon.patch
    switches them off while the model is patched, and back on when it is unpatched."""
    pytest.importorskip("kernels")
    from transformers import AutoModelForCausalLM

    tiny_model("llama", num_hidden_layers=1).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, use_kernels=True)
    assert model.use_kernels
    want = run(copy.deepcopy(model))
    tigon.patch(model)
    assert not model.use_kernels
    for mode in (True, False, True):
        model.train(mode)
    norm = model.model.norm
    assert "tigon_" in vars(norm)["forward"].__func__.__qualname__
    assert_same_run(run(model), want)
    tigon.unpatch(model)
    assert model.use_kernels and "forward" not in vars(norm)


def test_a_sequence_classifier_has_no_lm_head_to_fuse():
    """Instance patching names only what it bound: a sequence classifier's line has no
    linear_cross_entropy (and its packed-sequence companion stays unswapped), a causal LM's has."""
    from transformers import LlamaForSequenceClassification

    from tests.patch.tiny import tiny_model

    causal = tiny_model("llama")
    classifier = LlamaForSequenceClassification(causal.config)
    applied = tigon.patch(classifier).applied
    try:
        assert "rms_norm" in applied and "linear_cross_entropy" not in applied, applied
    finally:
        tigon.unpatch(classifier)
    assert "linear_cross_entropy" in tigon.patch(causal).applied
    tigon.unpatch(causal)
