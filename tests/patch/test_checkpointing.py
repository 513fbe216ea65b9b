"""Gradient checkpointing survives tigon.patch: every decoder layer is still checkpointed once,
whichever way the installed transformers checkpoints (in `__call__`, or in a wrapper around the
class's `forward`, which a forward bound by tigon would otherwise replace)."""

from __future__ import annotations

import pytest
import torch

import tigon
from tests.patch.test_patch import assert_same_run, run
from tests.patch.tiny import tiny_model


@pytest.fixture(autouse=True)
def clean_patches():
    yield
    tigon.unpatch()


def count_checkpoints(model: torch.nn.Module) -> list[int]:
    """Wrap each layer's checkpoint function with a counter; returns the live counts."""
    counts = []
    for layer in model.model.layers:
        inner = layer._gradient_checkpointing_func
        counts.append(0)

        def counted(*args, _inner=inner, _index=len(counts) - 1, **kwargs):
            counts[_index] += 1
            return _inner(*args, **kwargs)

        layer._gradient_checkpointing_func = counted
    return counts


@pytest.mark.parametrize("model_type,reentrant", [("llama", False), ("llama", True), ("gemma2", False), ("phi3", True)])
@pytest.mark.parametrize("target", ["instance", "class"])
def test_every_layer_is_checkpointed_once_and_results_hold(model_type, reentrant, target):
    plain = tiny_model(model_type).train()
    plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    want = run(plain)

    if target == "class":
        tigon.patch(model_type)
    model = tiny_model(model_type).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if target == "instance":
        tigon.patch(model)
    counts = count_checkpoints(model)
    got = run(model)
    assert counts == [1] * len(counts), f"checkpoint calls per layer: {counts}"
    assert_same_run(got, want)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("recompute_mlp", [False, True])
def test_a_replayed_layer_forms_only_what_its_mlp_keeps(reentrant, recompute_mlp, monkeypatch):
    """Checkpointing replays each layer in backward for what its ops save; there the fused MLP's
    output only joins the residual sum that torch throws away, so the replay skips the activation
    and the down projection (and, with recompute_mlp, gate and up too). The loss and gradients are
    those of a replay that forms everything (bit for bit) and HF's. Gemma 2's post-MLP norm reads
    the output: it is formed there."""
    from tigon.ops.composite import glu_mlp
    from tigon.patch import forwards

    formed = []
    real_forward = glu_mlp.glu_mlp_forward
    monkeypatch.setattr(glu_mlp, "glu_mlp_forward", lambda *args: formed.append(1) or real_forward(*args))
    for model_type, replay_forms in (("llama", False), ("gemma2", True)):
        plain = tiny_model(model_type).train()
        plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        want = run(plain)
        model = tiny_model(model_type).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        tigon.patch(model, recompute_mlp=recompute_mlp)
        layers = len(model.model.layers)
        formed.clear()
        skipped = run(model)
        assert len(formed) == layers * (2 if replay_forms else 1), (model_type, len(formed))
        assert_same_run(skipped, want)
        if replay_forms:
            continue
        with monkeypatch.context() as patches:
            patches.setattr(forwards, "replaying", lambda layer: False)
            formed_again = run(model)
        assert len(formed) == 3 * layers
        assert torch.equal(skipped[0], formed_again[0])
        for name, grad in skipped[2].items():
            assert torch.equal(grad, formed_again[2][name]), name
        tigon.unpatch()


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_non_reentrant_early_stop_is_not_a_kernel_failure(model_type, monkeypatch):
    """Non-reentrant checkpointing stops a layer's recomputation by raising from the pack hook of
    the last tensor it needs, which is inside a fused op's forward: outside the tests' strict mode
    that must still reach torch, not switch the op to its reference halfway through."""
    from tigon import ops

    monkeypatch.delenv("TIGON_STRICT", raising=False)
    ops.reset()
    plain = tiny_model(model_type).train()
    plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    want = run(plain)
    model = tiny_model(model_type).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tigon.patch(model)
    assert_same_run(run(model), want)
    broken = [reason for op in ops.op_names() if "failed" in (reason := ops.why_not_triton(op, torch.device("cpu")) or "")]
    assert not broken, broken


def test_early_stop_leaves_no_frames_in_reference_cycles():
    """Checkpointing's early stop is an exception raised inside the fused ops of every recomputed
    layer. Re-raised so that no frame holds it, it leaves nothing behind; re-raised from a frame
    that holds it, each recomputation's traceback (every frame it passed, with their tensors:
    whole layers of activations) stays in a reference cycle until the garbage collector runs,
    which a GPU step's few Python allocations make rare."""
    import gc

    model = tiny_model("llama").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tigon.patch(model)
    run(model)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        run(model)
        gc.collect()
        frames = [o.f_code.co_name for o in gc.garbage if type(o).__name__ == "frame"]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not frames, f"frames kept alive by reference cycles: {sorted(set(frames))}"


def test_a_patched_model_collected_mid_step_changes_no_other_models_recomputation():
    """A patched model dropped in a reference cycle is collected whenever the collector runs: here
    between another model's checkpointed forward and its backward. The family's RoPE function
    that forward ran must still be the one its recomputation runs; the shared swap is given back
    at the next patch or unpatch call instead."""
    import gc

    from tigon.patch.families import FAMILIES, modeling_module

    module = __import__(modeling_module(FAMILIES["llama"]), fromlist=["_"])
    hf_rope = module.apply_rotary_pos_emb
    dropped = tiny_model("llama")
    tigon.patch(dropped)
    dropped.cycle = dropped  # only the collector frees it
    other = tiny_model("llama").train()
    other.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, other.config.vocab_size, (2, 7))
    loss = other(input_ids=ids, labels=ids).loss
    assert module.apply_rotary_pos_emb is not hf_rope, "the test needs the forward to run tigon's RoPE"
    del dropped
    gc.collect()
    loss.backward()
    assert all(p.grad is not None for p in other.parameters() if p.requires_grad)
    tigon.unpatch(other)
    assert module.apply_rotary_pos_emb is hf_rope, "the next unpatch call gives the function back"
