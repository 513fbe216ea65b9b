"""tigon.patch on PEFT LoRA models: the fused LoRA ops, compared with PEFT itself.

Most tests patch the LoRA layers alone (every other switch off), so PEFT's own numbers are the
oracle for what the LoRA path changes; tests/patch/test_training.py patches everything."""

import copy
import logging

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import tigon  # noqa: E402
import tigon.functional as F  # noqa: E402
from tests.helpers import assert_close, autograd_nodes  # noqa: E402
from tests.ops.composite.test_lora import one_cpu_thread  # noqa: E402,F401 (autouse fixture)
from tigon.patch import SWITCHES  # noqa: E402

VOCAB = 101
LORA_ONLY = {name: name == "lora" for name in SWITCHES}


@pytest.fixture(autouse=True)
def clean_patches():
    yield
    tigon.unpatch()


def apply_lora(model, **switches):
    """The LoRA summary of patching `model` with only the lora switch on."""
    return tigon.patch(model, **{**LORA_ONLY, **switches}).lora


def _config(family):
    sizes = dict(hidden_size=48, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB)
    if family == "llama":
        return transformers.LlamaConfig(**sizes)
    if family == "qwen2":  # q/k/v carry biases
        return transformers.Qwen2Config(**sizes)
    if family == "gemma":  # GeGLU with gelu_pytorch_tanh, head_dim != hidden / heads
        return transformers.GemmaConfig(**sizes, head_dim=16)
    raise ValueError(family)


def _models(family="llama", dtype=torch.float32, device="cpu", **lora):
    """A PEFT LoRA model with random (non-zero) adapters and an untouched deep copy of it."""
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(_config(family)).to(device=device, dtype=dtype)
    lora = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "init_lora_weights": False, **lora}
    model = peft.get_peft_model(base, peft.LoraConfig(**lora), autocast_adapter_dtype=False)
    return model, copy.deepcopy(model)


def _ids(device="cpu"):
    return torch.randint(0, VOCAB, (2, 13), device=device)


def _run(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out.logits.detach(), out.loss.detach(), grads


def _cast_parameters(out):
    """The parameters that reach `out` through an autograd cast node (``.to(dtype)``)."""
    return {
        id(next_node.variable)
        for node in autograd_nodes(out) if type(node).__name__ == "ToCopyBackward0"
        for next_node, _ in node.next_functions if hasattr(next_node, "variable")
    }


def _assert_same_step(ours, theirs, ids, dtype=torch.float32):
    logits, loss, grads = _run(ours, ids)
    ref_logits, ref_loss, ref_grads = _run(theirs, ids)
    assert_close(logits, ref_logits, dtype, "logits")
    assert_close(loss, ref_loss, dtype, "loss")
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert_close(grads[name], ref_grads[name], dtype, name)


def _add_second_adapter(model):
    torch.manual_seed(1)  # the same random adapter in both models
    model.add_adapter("second", peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))


# What one forward of the two-layer models runs when everything fuses.
FUSED = {"lora_linear": 2, "lora_linear_group": 2, "lora_gated_mlp": 2}


@pytest.fixture
def spy(monkeypatch):
    """Counts calls to the fused LoRA ops."""
    calls = {"lora_linear": 0, "lora_linear_group": 0, "lora_gated_mlp": 0}
    for name in calls:
        real = getattr(F, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(F, name, counted)
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_matches_peft(family, spy):
    ours, theirs = _models(family)
    summary = apply_lora(ours)
    assert (summary.linears, summary.gated_mlps, summary.qkv_groups, summary.left) == (14, 2, 2, {})
    _assert_same_step(ours, theirs, _ids())
    # Per layer: q/k/v as one op, o on its own, gate/up/down as one op.
    assert spy == FUSED


@pytest.mark.parametrize("rank", [1, 64])
def test_ranks(rank):
    ours, theirs = _models(r=rank, lora_alpha=2 * rank)
    apply_lora(ours)
    _assert_same_step(ours, theirs, _ids())


def test_rslora_scaling_and_per_module_ranks():
    ours, theirs = _models(use_rslora=True, rank_pattern={"down_proj": 3, "q_proj": 5})
    apply_lora(ours)
    _assert_same_step(ours, theirs, _ids())


def test_trainable_base_weights():
    ours, theirs = _models()
    for model in (ours, theirs):
        layer = model.base_model.model.model.layers[0]
        layer.mlp.down_proj.base_layer.weight.requires_grad_(True)
        layer.self_attn.q_proj.base_layer.weight.requires_grad_(True)
    apply_lora(ours)
    _assert_same_step(ours, theirs, _ids())


def test_fp16_as_accurate_as_peft():
    ours, theirs = _models(dtype=torch.float16)
    oracle = copy.deepcopy(theirs).float()
    apply_lora(ours)
    ids = _ids()
    want_logits, want_loss, want_grads = _run(oracle, ids)
    for_ours, for_peft = _run(ours, ids), _run(theirs, ids)

    def error(got, want):
        return ((got.double() - want.double()).norm() / want.double().norm()).item()

    for got, peft_got, want in zip(for_ours[:2], for_peft[:2], (want_logits, want_loss)):
        assert error(got, want) <= 2 * error(peft_got, want) + 1e-3
    for name, want in want_grads.items():
        assert error(for_ours[2][name], want) <= 2 * error(for_peft[2][name], want) + 1e-3, name


def test_gradient_checkpointing():
    ours, theirs = _models()
    for model in (ours, theirs):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    apply_lora(ours)
    _assert_same_step(ours, theirs, _ids())


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("early_stop", [True, False])
def test_checkpointed_replay_skips_the_down_projections_output(reentrant, early_stop, monkeypatch):
    """Checkpointing replays each layer in backward for what its ops save; there the fused LoRA
    MLP's output only joins the residual sum that torch throws away, so its down projection's
    output GEMMs run once per layer and step instead of twice. The loss and every gradient are
    those of a run that forms the output again (bit for bit) and PEFT's."""
    from tigon.ops.composite import lora_mlp
    from tigon.patch import forwards

    ours, theirs = _models()
    for model in (ours, theirs):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    tigon.patch(ours)
    outputs = []
    formed = lora_mlp.lora_forward
    monkeypatch.setattr(lora_mlp, "lora_forward", lambda *args, **kwargs: outputs.append(1) or formed(*args, **kwargs))
    layers, ids = len(ours.base_model.model.model.layers), _ids()

    def run(model):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        skipped = run(ours)
        assert len(outputs) == layers, "the down projection's output was formed again in the replay"
        monkeypatch.setattr(forwards, "replaying", lambda layer: False)
        formed_again = run(ours)
        assert len(outputs) == 3 * layers
        want = run(theirs)
    assert torch.equal(skipped[0], formed_again[0])
    assert_close(skipped[0], want[0], torch.float32, "loss")
    for name, grad in skipped[1].items():
        assert torch.equal(grad, formed_again[1][name]), name
        assert_close(grad, want[1][name], torch.float32, name)


def test_dropout_uses_peft_in_training_and_fuses_in_eval(spy):
    ours, theirs = _models(lora_dropout=0.1)
    summary = apply_lora(ours)
    assert summary.linears == 0 and summary.left == {"lora_dropout > 0 in training": 14}
    ours.train()
    theirs.train()
    ids = _ids()
    torch.manual_seed(1)
    logits = ours(input_ids=ids).logits
    torch.manual_seed(1)
    assert torch.equal(logits, theirs(input_ids=ids).logits)
    assert spy == {"lora_linear": 0, "lora_linear_group": 0, "lora_gated_mlp": 0}
    ours.eval()
    theirs.eval()
    _assert_same_step(ours, theirs, ids)
    assert spy == FUSED


def test_dora_fuses_and_embedding_layers_stay_on_peft(spy):
    ours, theirs = _models(use_dora=True, target_modules=["q_proj", "v_proj", "embed_tokens"])
    summary = apply_lora(ours)
    assert (summary.linears, summary.dora, summary.left) == (4, 4, {"Embedding layer": 1})
    _assert_same_step(ours, theirs, _ids())
    assert spy["lora_linear"] == 4  # q and v of each layer: no whole q/k/v group to fuse


def test_dora_on_every_linear_matches_peft(spy):
    ours, theirs = _models(use_dora=True)
    summary = apply_lora(ours)
    assert (summary.linears, summary.dora, summary.gated_mlps, summary.qkv_groups) == (14, 14, 2, 2)
    assert str(summary).endswith("; 14 DoRA")
    _assert_same_step(ours, theirs, _ids())
    assert spy == FUSED


def test_other_lora_variants_stay_on_peft(spy):
    ours, theirs = _models(target_modules=["q_proj", "v_proj"], alora_invocation_tokens=[3])
    summary = apply_lora(ours)
    assert (summary.linears, summary.left) == (0, {"a LoRA variant other than DoRA": 4})


def test_disabled_merged_and_several_adapters_follow_peft(spy):
    ours, theirs = _models()
    apply_lora(ours)
    ids = _ids()
    with ours.disable_adapter(), theirs.disable_adapter():
        assert_close(ours(input_ids=ids).logits, theirs(input_ids=ids).logits, name="disabled")
    assert spy == {"lora_linear": 0, "lora_linear_group": 0, "lora_gated_mlp": 0}

    ours.merge_adapter()
    theirs.merge_adapter()
    assert_close(ours(input_ids=ids).logits, theirs(input_ids=ids).logits, name="merged")
    assert spy == {"lora_linear": 0, "lora_linear_group": 0, "lora_gated_mlp": 0}
    ours.unmerge_adapter()
    theirs.unmerge_adapter()

    for model in (ours, theirs):
        _add_second_adapter(model)
        model.base_model.set_adapter(["default", "second"])
    assert apply_lora(ours).left == {"2 active adapters": 14}
    assert_close(ours(input_ids=ids).logits, theirs(input_ids=ids).logits, name="two adapters")
    assert spy == {"lora_linear": 0, "lora_linear_group": 0, "lora_gated_mlp": 0}

    for model in (ours, theirs):
        model.set_adapter("second")
    _assert_same_step(ours, theirs, ids)
    assert spy == FUSED


def test_mixed_adapter_batch_follows_peft():
    ours, theirs = _models()
    for model in (ours, theirs):
        _add_second_adapter(model)
        model.eval()
    apply_lora(ours)
    ids = _ids()
    names = ["default", "second"]
    with torch.no_grad():
        assert_close(ours(input_ids=ids, adapter_names=names).logits,
                     theirs(input_ids=ids, adapter_names=names).logits, name="mixed batch")


def test_hooks_are_not_bypassed(spy):
    ours, theirs = _models()
    apply_lora(ours)
    seen = []
    mlp = ours.base_model.model.model.layers[1].mlp
    mlp.up_proj.base_layer.register_forward_hook(lambda m, i, o: seen.append("up base"))
    ours.base_model.model.model.layers[0].self_attn.k_proj.register_forward_pre_hook(
        lambda m, i: seen.append("k lora layer"))
    _assert_same_step(ours, theirs, _ids())
    assert seen == ["k lora layer", "up base"]
    # layer 1's up_proj runs PEFT's path, so its MLP cannot be fused; layer 0's still is. A hook on
    # k_proj itself still runs: the module is called and hands back its part of the q/k/v group.
    assert spy == {"lora_linear": 2 + 2, "lora_linear_group": 2, "lora_gated_mlp": 1}


def test_qkv_group_parts_go_only_to_their_own_input(spy):
    """The attention's first q/k/v call computes all three for its hidden states; a projection
    whose call gets another tensor (here a pre-hook scales k_proj's input) computes its own."""
    ours, theirs = _models()
    apply_lora(ours)
    for model in (ours, theirs):
        model.base_model.model.model.layers[0].self_attn.k_proj.register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))
    _assert_same_step(ours, theirs, _ids())
    # o_proj twice, layer 0's k_proj on its own; both layers still group (layer 0's k part unused).
    assert spy == {"lora_linear": 3, "lora_linear_group": 2, "lora_gated_mlp": 2}


def test_save_and_load_with_peft(tmp_path):
    ours, theirs = _models()
    apply_lora(ours)
    ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "theirs")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    expected = load_file(tmp_path / "theirs" / "adapter_model.safetensors")
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in saved)

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "ours", is_trainable=True)
    apply_lora(loaded)
    _assert_same_step(loaded, theirs, _ids())


def test_unpatch_restores_and_patching_again_is_idempotent(spy):
    ours, theirs = _models()
    first = apply_lora(ours)
    assert apply_lora(ours) == first
    tigon.unpatch(ours)
    assert not any("forward" in vars(m) for m in ours.modules())
    _assert_same_step(ours, theirs, _ids())
    assert spy == {"lora_linear": 0, "lora_linear_group": 0, "lora_gated_mlp": 0}


def test_logs_the_lora_line_then_the_patch_line(caplog):
    ours, _ = _models(target_modules=["q_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"])
    with caplog.at_level(logging.INFO, logger="tigon"):
        apply_lora(ours)
    assert [r.getMessage() for r in caplog.records] == [
        "tigon: fused LoRA on 8 of 9 LoRA layers (6 of them as 2 gated MLPs); "
        "left on PEFT's path: Embedding layer: 1",
        "tigon: applied lora to LlamaForCausalLM (2 layers)",
    ]


def test_autocast_matches_peft_under_autocast():
    ours, theirs = _models()
    apply_lora(ours)
    ids = _ids()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_same_step(ours, theirs, ids, torch.bfloat16)


def test_half_model_with_float32_adapters():
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(_config("llama")).to(torch.bfloat16)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    ours = peft.get_peft_model(base, config)  # PEFT's default keeps the adapters in float32
    theirs = copy.deepcopy(ours)
    assert ours.base_model.model.model.layers[0].mlp.up_proj.lora_A["default"].weight.dtype == torch.float32
    assert apply_lora(ours).linears == 14
    ids = _ids()
    # The fused ops cast the adapters themselves: no autograd cast node between an adapter and them.
    assert _cast_parameters(ours(input_ids=ids, labels=ids).loss) == set()
    adapter = ours.base_model.model.model.layers[0].mlp.up_proj.lora_A["default"].weight
    assert _cast_parameters(adapter.to(torch.bfloat16).sum()) == {id(adapter)}  # what it would find
    logits, _, grads = _run(ours, ids)
    ref_logits, _, ref_grads = _run(theirs, ids)
    assert logits.dtype == torch.bfloat16
    assert_close(logits, ref_logits, torch.bfloat16, "logits")
    for name in grads:
        assert grads[name].dtype == torch.float32
        assert_close(grads[name], ref_grads[name], torch.bfloat16, name)


@pytest.mark.gpu
def test_bf16_llama_on_gpu_as_accurate_as_peft():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                                      num_attention_heads=16, num_key_value_heads=4, vocab_size=1000)
    base = transformers.AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16)
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
    ours = peft.get_peft_model(base, lora)
    theirs = copy.deepcopy(ours)
    oracle = copy.deepcopy(ours).float()
    apply_lora(ours)
    ids = torch.randint(0, 1000, (4, 512), device="cuda")
    want, got, peft_got = _run(oracle, ids), _run(ours, ids), _run(theirs, ids)

    def error(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    assert error(got[0], want[0]) <= 1.5 * error(peft_got[0], want[0]) + 1e-3
    for name, w in want[2].items():
        assert error(got[2][name], w) <= 1.5 * error(peft_got[2][name], w) + 2e-3, name


class _SwappedMLP(torch.nn.Module):
    """Looks like a gated MLP but gates the other way: must not be fused."""

    def __init__(self):
        super().__init__()
        self.gate_proj = torch.nn.Linear(48, 88, bias=True)
        self.up_proj = torch.nn.Linear(48, 88, bias=True)
        self.down_proj = torch.nn.Linear(88, 48, bias=True)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


def test_only_the_familys_mlp_class_fuses(spy):
    """The family table names the MLP class: a lookalike module in its place (same projections,
    another function) keeps its forward, its LoRA linears running fused one by one."""
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    base.model.layers[0].mlp = _SwappedMLP()
    config = peft.LoraConfig(r=5, lora_alpha=7, target_modules="all-linear", init_lora_weights=False)
    ours = peft.get_peft_model(base, config, autocast_adapter_dtype=False)
    theirs = copy.deepcopy(ours)
    summary = apply_lora(ours)
    assert (summary.linears, summary.gated_mlps) == (14, 1)
    _assert_same_step(ours, theirs, _ids())
    assert spy == {"lora_linear": 2 + 3, "lora_linear_group": 2, "lora_gated_mlp": 1}


def test_mlp_recognised_after_its_class_forward_is_patched(monkeypatch, spy):
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaMLP.forward
    calls = []

    def patched(self, x):
        calls.append(1)
        return original(self, x)

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", patched)
    ours, theirs = _models()
    assert apply_lora(ours).gated_mlps == 2
    _assert_same_step(ours, theirs, _ids())
    assert spy["lora_gated_mlp"] == 2
    calls.clear()
    with ours.disable_adapter():
        ours(input_ids=_ids())
    assert len(calls) == 2  # the fallback is the class's (patched) forward


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_lora_ops_keep_the_norms_inputs_not_their_outputs(family, monkeypatch):
    """With the norms on tigon's kernel too, each layer's q/k/v group and LoRA MLP save the tensor
    their RMSNorm normalised (which the norm keeps anyway) instead of the norm's output, and
    renormalise it in backward: two hidden-sized tensors less per layer, the same loss and
    gradients bit for bit."""
    from tests.helpers import saved_activation_bytes
    from tigon.patch.handoff import Relay

    model, _ = _models(family)
    tigon.patch(model)
    ids = _ids()

    def step():
        kept, out = saved_activation_bytes(model, input_ids=ids, labels=ids)
        out.loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        return kept, out.loss.detach(), grads

    handed_over = step()
    monkeypatch.setattr(Relay, "normed_input_of", lambda self, x: None)
    normed_kept = step()
    config = model.config
    # The first layer's input norm reads the frozen embeddings with a frozen weight: it keeps
    # nothing, so its output is kept.
    fewer = 2 * config.num_hidden_layers - 1
    assert normed_kept[0] - handed_over[0] == fewer * ids.numel() * config.hidden_size * 4
    assert torch.equal(handed_over[1], normed_kept[1])
    for name, grad in normed_kept[2].items():
        assert torch.equal(handed_over[2][name], grad), name
