"""The switch table drives tigon.patch, the auto class, `--kernels-off`, and what runs."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch

import tigon
from tests.patch.tiny import batch, tiny_config, tiny_model
from tests.patch.tiny_vlm import tiny_vlm, vlm_batch
from tigon import functional
from tigon.patch import FAMILIES, VLM_FAMILIES, switches


@pytest.fixture(autouse=True)
def clean_patches():
    yield
    tigon.unpatch()


def test_patch_keywords_are_the_table():
    """Every keyword of tigon.patch is a switch of the table, but `role` (the logged line's name
    for the model) and `fp8` / `fp8_all_gather` (a recipe for the linears, not a kernel to switch)."""
    keywords = [p for p in inspect.signature(tigon.patch).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert [p.name for p in keywords if p.annotation != "bool"] == ["role", "fp8"]
    params = [p for p in keywords if p.name not in ("role", "fp8", "fp8_all_gather")]
    assert [p.name for p in params] == list(switches.SWITCHES)
    assert {p.name: p.default for p in params} == switches.DEFAULTS
    assert all(p.annotation == "bool" for p in params)


def test_every_op_is_covered_by_a_switch_or_not_patched():
    from tigon import ops

    covered = {op for switch in switches.TABLE for op in switch.ops}
    assert covered | set(switches.UNPATCHED_OPS) == set(ops.op_names())
    assert not covered & set(switches.UNPATCHED_OPS)
    assert switches.covering("moe_experts") == ("moe_experts",)
    assert switches.covering("linear_log_probs") == ("trl_log_probs",)
    assert switches.covering("linear_policy_loss") == ()
    assert switches.covering("glu_mlp") == ("swiglu", "geglu")
    assert switches.covering("add_rms_norm_glu_mlp") == ("swiglu", "geglu", "add_rms_norm")
    assert switches.covering("lora_linear_group") == ("lora",)
    assert switches.covering("tiled_mlp") == switches.covering("warp_drive") == ()


def test_op_names_and_unknown_names_are_refused_everywhere():
    from tigon.train.config import SFTConfig, SFTError, resolve

    model = tiny_model("llama")
    with pytest.raises(ValueError, match="'glu_mlp' is an op name .*switches covering it: swiglu, geglu"):
        tigon.patch(model, glu_mlp=False)
    with pytest.raises(ValueError, match="'linear_policy_loss' is an op name .*tigon.patch does not apply, so no switch"):
        tigon.patch(model, linear_policy_loss=False)
    with pytest.raises(ValueError, match=r"tigon.patch: unknown kernel\(s\) warp_drive; choose from rms_norm, rope"):
        tigon.patch("llama", warp_drive=False)
    assert not any("forward" in vars(m) for m in model.modules())
    with pytest.raises(ValueError, match="'linear_group' is an op name .*covering it: qkv_group"):
        tigon.AutoModelForCausalLM.from_config(tiny_config("llama"), linear_group=False)
    with pytest.raises(SFTError, match="--kernels-off: 'lora_linear' is an op name .*covering it: lora$"):
        resolve(SFTConfig(kernels_off=["rope", "lora_linear"]))
    assert resolve(SFTConfig(kernels_off=["tiled_mlp", "qkv_group"])).kernels_off == ["tiled_mlp", "qkv_group"]


def test_auto_model_patches_with_tiled_mlp_and_offload(monkeypatch):
    """The long-context switches are tigon's, not transformers' arguments."""
    from tigon.patch import offload, tiled, vision

    monkeypatch.setattr(tiled, "CHUNK_WIDTHS", 1)
    make_embed = vision.patch_embed_forward

    def embed_forward(*args):
        forward = make_embed(*args)
        return lambda *a: ran.add("patch_embed") or forward(*a)

    monkeypatch.setattr(vision, "patch_embed_forward", embed_forward)
    tiles, sessions = [], []
    apply, session = tiled._TiledFunction.apply, offload.ActivationOffload
    monkeypatch.setattr(tiled._TiledFunction, "apply", lambda *a: tiles.append(a[1]) or apply(*a))
    monkeypatch.setattr(offload, "ActivationOffload", lambda *a: sessions.append(a) or session(*a))
    model = tigon.AutoModelForCausalLM.from_config(tiny_config("llama"), tiled_mlp=True, offload_activations=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids, mask, labels = batch(seed=1, rows=1, cols=70)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert tiles and sessions == [(64, 70)]


# Per switch: the model it acts on, and the other switches it is compared under.
CASES = {
    "rms_norm": ("llama", {}),
    "rope": ("llama", {}),
    "swiglu": ("llama", {}),
    "geglu": ("gemma", {}),
    "layer_norm": ("phi", {}),
    "add_rms_norm": ("llama", {}),
    "qkv_group": ("llama", {}),
    "linear_cross_entropy": ("llama", {}),
    "cross_entropy": ("llama", {"linear_cross_entropy": False}),
    # TRL's fused head is the model's forward: the causal LM's loss must stay TRL's to keep it.
    "trl_log_probs": ("trl", {"linear_cross_entropy": False}),
    "lora": ("lora", {}),
    "offload_activations": ("checkpointed", {}),
    "tiled_mlp": ("llama", {}),
    "recompute_mlp": ("llama", {}),
    "moe_experts": ("qwen3_moe", {}),
    "gelu_mlp": ("qwen2_vl", {}),  # its vision tower's MLPs
    "patch_embed": ("qwen2_vl", {}),  # its vision tower's Conv3d patch embedding
    "vision_attention": ("qwen2_vl", {}),  # its vision tower's attention (SDPA: _model sets it)
}


def _model(kind: str) -> torch.nn.Module:
    """One decoder layer: every replacement still runs (its closing add goes with the final norm)."""
    if kind in VLM_FAMILIES:
        model = tiny_vlm(kind)
        model.model.visual.config._attn_implementation = "sdpa"  # vision_attention replaces that path alone
        return model
    model = tiny_model(kind if kind in FAMILIES else "llama", num_hidden_layers=1)
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        model = get_peft_model(model, config)
    if kind == "checkpointed":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if kind == "trl":  # called as TRL's trainers call it: the loss from TRL's fused LM head
        add_fused_lm_head = pytest.importorskip("trl.trainer.utils").add_fused_lm_head
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        model.forward = functools.partial(model.forward, fused_lm_head=True)
    return model


def test_every_switch_is_in_a_case():
    assert set(CASES) == set(switches.SWITCHES)


@pytest.mark.parametrize("name", switches.SWITCHES)
def test_every_switch_changes_what_runs(name, monkeypatch):
    """Turning a switch off stops some of the ops the table says it covers and no other (a
    switch that covers no op: its wrapper)."""
    from tigon.patch import offload, tiled, vision

    ran: set[str] = set()

    def seen(op: str, real, *args, **kwargs):
        ran.add(op)
        if kwargs.get("recompute"):
            ran.add("recompute_mlp")
        return real(*args, **kwargs)

    for op in functional.__all__:
        monkeypatch.setattr(functional, op, functools.partial(seen, op, getattr(functional, op)))
    apply, session = tiled._TiledFunction.apply, offload.ActivationOffload
    monkeypatch.setattr(tiled._TiledFunction, "apply", lambda *a: ran.add("tiled_mlp") or apply(*a))
    monkeypatch.setattr(offload, "ActivationOffload", lambda *a: ran.add("offload_activations") or session(*a))
    monkeypatch.setattr(tiled, "CHUNK_WIDTHS", 1)
    make_embed, make_attention = vision.patch_embed_forward, vision.vision_attention_forward

    def embed_forward(*args):
        forward = make_embed(*args)
        return lambda *a: ran.add("patch_embed") or forward(*a)

    def attention_forward(*args):
        make = make_attention(*args)
        return lambda plan: (lambda *a, **k: ran.add("vision_attention") or make(plan)(*a, **k))

    monkeypatch.setattr(vision, "patch_embed_forward", embed_forward)
    monkeypatch.setattr(vision, "vision_attention_forward", attention_forward)

    kind, others = CASES[name]
    model = _model(kind).train()
    # Chunks of the width, 64 tokens: tiled_mlp needs more than one.
    ids, mask, labels = batch(seed=2, rows=1, cols=70 if name == "tiled_mlp" else 9, pad_tail=2)
    inputs = vlm_batch(kind) if kind in VLM_FAMILIES else dict(input_ids=ids, attention_mask=mask, labels=labels)

    def what_runs(on: bool) -> set[str]:
        tigon.patch(model, **others, **{name: on})
        ran.clear()
        model(**inputs).loss.backward()
        return set(ran)

    gone = what_runs(True) - what_runs(False)
    ops = switches.TABLE[switches.SWITCHES.index(name)].ops
    if ops:
        assert gone and gone <= set(ops), f"{name}=False stopped {sorted(gone)}; the table says {ops}"
    else:
        assert name in gone, f"{name}=False did not take its wrapper away"


@pytest.mark.parametrize("kind", ["llama", "lora"])
def test_recompute_mlp_keeps_less_and_changes_no_number(kind):
    """recompute_mlp: the MLPs (add + norm + MLP as one op, or the fused LoRA MLP) keep neither
    gate nor up for backward; loss and every gradient are those without it, bit for bit."""
    from tests.helpers import saved_activation_bytes

    ids, mask, labels = batch(seed=3, rows=2, cols=11, pad_tail=2)
    model = _model(kind).train()
    config = model.config
    results = []
    for recompute in (False, True):
        tigon.patch(model, recompute_mlp=recompute)
        model.zero_grad(set_to_none=True)
        kept, out = saved_activation_bytes(model, input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        results.append((kept, out.loss.detach(), grads))
    (kept, loss, grads), (kept_recomputed, loss_recomputed, grads_recomputed) = results
    gate_and_up = 2 * ids.numel() * config.intermediate_size * 4 * config.num_hidden_layers
    assert kept - kept_recomputed == gate_and_up
    assert torch.equal(loss, loss_recomputed) and len(grads) == len(grads_recomputed) > 0
    for default, recomputed in zip(grads, grads_recomputed):
        assert torch.equal(default, recomputed)
