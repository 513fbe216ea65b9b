"""Hand-offs between patched forwards: declared slots, nothing left on tensors or modules, off
under torch.compile."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import tigon
from tests.patch.test_patch import assert_same_run, run
from tests.patch.test_training import lora_model
from tests.patch.tiny import batch, tiny_model
from tigon.patch import handoff


@pytest.fixture(autouse=True)
def clean_patches():
    yield
    tigon.unpatch()


def test_slot_holds_by_identity_until_taken_dropped_or_freed():
    slot = handoff.Slot("test")
    a, b = torch.zeros(3), torch.zeros(3)
    slot.put(a, "for a")
    assert slot.get(b) is None and slot.get(a) == "for a"
    assert slot.take(a) == "for a" and slot.get(a) is None and len(slot) == 0
    with slot.lent(b, "for b"):
        assert slot.get(b) == "for b"
    assert len(slot) == 0
    slot.put(a, 1)
    del a
    gc.collect()
    assert len(slot) == 0, "a freed key's value must go with it"
    single = handoff.Slot("single", single=True)
    single.put(b, 1)
    c = torch.zeros(1)
    single.put(c, 2)
    assert single.get(b) is None and single.get(c) == 2


def test_slots_are_untouched_inside_torch_compile():
    """Inside torch.compile no slot is written, dropped included: a traced drop keyed by a
    tensor's identity broke the graph of every patched forward that lends a slot on torch 2.11
    (its dynamo cannot take id() of a tensor there), and a traced write would replay as a side
    effect on every call."""
    slot = handoff.Slot("test")
    held, lent = torch.zeros(3), torch.ones(2)
    slot.put(held, "kept")

    def step(x):
        slot.drop(held)
        with slot.lent(x, "lent"):
            return x * 2

    torch._dynamo.reset()
    try:
        torch.compile(step, backend="eager", fullgraph=True)(lent)
    finally:
        torch._dynamo.reset()
    assert slot.get(held) == "kept" and len(slot) == 1


def _keys(model):
    return {name: set(vars(module)) for name, module in model.named_modules()}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_patched_model_leaves_nothing_on_tensors_or_modules(lora):
    """Patching binds forwards and nothing else on the modules; a training step leaves no tigon
    attribute on the tensors it passes between modules (the hidden states, the position ids the
    causal-LM forward makes), no value in a slot, and no per-call forward on a module; unpatching
    restores every forward."""
    model = lora_model("llama") if lora else tiny_model("llama")
    before = _keys(model)
    tigon.patch(model)
    patched = _keys(model)
    assert all(patched[name] - keys <= {"forward"} for name, keys in before.items())
    decoder = model.get_base_model().model if lora else model.model
    assert all(handoff.NEXT_NORM.get(layer) is not None for layer in decoder.layers)

    seen = []
    handles = [decoder.register_forward_pre_hook(lambda m, a, k: seen.append(k["position_ids"]), with_kwargs=True)]
    handles += [layer.register_forward_hook(lambda m, i, o: seen.append(o)) for layer in decoder.layers]
    ids, _, labels = batch()
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        model(input_ids=ids, labels=labels).loss.backward()
    for handle in handles:
        handle.remove()
    assert seen[0] is not None, "the causal-LM forward made the position ids"
    assert not [vars(t) for t in seen if isinstance(t, torch.Tensor) and any("tigon" in k for k in vars(t))]
    assert [len(slot) for slot in handoff.SLOTS if slot is not handoff.NEXT_NORM] == [0] * (len(handoff.SLOTS) - 1)
    assert _keys(model) == patched

    tigon.unpatch(model)
    assert _keys(model) == before
    assert not any(handoff.NEXT_NORM.get(layer) for layer in decoder.layers)


def test_torch_compile_of_a_patched_model_gives_eager_results():
    """Under torch.compile the hand-offs are off (handoff.available): the compiled patched model
    computes the eager patched model's loss and gradients."""
    model = tiny_model("llama", num_hidden_layers=1)
    compiled_model = copy.deepcopy(model)
    tigon.patch(model)
    want = run(model)
    tigon.patch(compiled_model)
    torch._dynamo.reset()
    try:
        got = run(torch.compile(compiled_model, backend="eager"))
    finally:
        torch._dynamo.reset()
    assert_same_run(got, want)


@pytest.mark.parametrize("fused", [True, False], ids=["linear_cross_entropy", "cross_entropy"])
def test_token_accuracy_is_handed_to_the_lender(fused):
    """With a list lent for its labels, the patched causal LM appends the step's argmax hits and
    target count, those of HF's logits; without one it computes none and the loss is the same."""
    model = tiny_model("llama")
    ids, mask, labels = batch()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    labels[0, 3:8] = logits[0, 2:7].argmax(-1)  # five hits at least, whatever the weights
    targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    valid = targets != -100
    tigon.patch(model, linear_cross_entropy=fused, cross_entropy=not fused)
    model.train()
    plain = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    hits = []
    with handoff.TOKEN_ACCURACY.lent(labels, hits):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert len(handoff.TOKEN_ACCURACY) == 0 and len(hits) == 1
    (hit, count), = hits
    assert count == valid.sum() and hit == ((logits.argmax(-1) == targets) & valid).sum() and hit >= 5
    assert torch.equal(loss, plain)
