"""Hand-offs between patched forwards: one relay per patched model, nothing left on tensors or
modules, nothing shared between models, off under torch.compile."""

from __future__ import annotations

import copy

import pytest
import torch

import tigon
from tests.patch.test_patch import assert_same_run, run
from tests.patch.test_training import lora_model
from tests.patch.tiny import batch, tiny_model
from tigon.patch import handoff, token_accuracy
from tigon.patch.apply import layer_plans


@pytest.fixture(autouse=True)
def clean_patches():
    yield
    tigon.unpatch()


def test_relay_hands_a_value_to_its_reader_only():
    """A normed sum goes to the norm it was formed for and for the tensor it was formed from, once;
    a normed input answers only for the tensor it was lent with."""
    relay = handoff.Relay()
    norm, other = torch.nn.Identity(), torch.nn.Identity()
    total, normed, replaced = torch.zeros(3), torch.ones(3), torch.zeros(3)
    relay.normed = (total, norm, normed)
    assert relay.take_normed(total, other) is None and relay.normed is not None
    assert relay.take_normed(total, norm) is normed and relay.normed is None
    relay.normed = (total, norm, normed)
    assert relay.take_normed(replaced, norm) is None and relay.normed is None, "a hook replaced the sum"
    relay.normed_input = (normed, "made from")
    assert relay.normed_input_of(normed) == "made from" and relay.normed_input_of(total) is None


def test_relay_is_untouched_inside_torch_compile():
    """Inside torch.compile nothing is handed over: a traced take would bake a tensor's identity
    into the graph's guards, and a traced write would replay as a side effect on every call."""
    relay = handoff.Relay()
    norm = torch.nn.Identity()
    held = torch.zeros(3)
    relay.normed = (held, norm, held)

    def step(x):
        assert relay.take_normed(held, norm) is None
        return x * 2

    torch._dynamo.reset()
    try:
        torch.compile(step, backend="eager", fullgraph=True)(torch.ones(2))
    finally:
        torch._dynamo.reset()
    assert relay.normed == (held, norm, held)


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
    plans = layer_plans(model)
    norms_after = [layer.input_layernorm for layer in decoder.layers[1:]] + [decoder.norm]
    assert [plan.next_norm for plan in plans] == norms_after
    relay = plans[0].relay

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
    assert (relay.normed, relay.normed_input, relay.accuracy) == (None, None, None), "nothing in flight after a step"
    assert _keys(model) == patched

    tigon.unpatch(model)
    assert _keys(model) == before
    assert not layer_plans(model)


def test_two_patched_models_do_not_interact():
    """Each patched model has a relay and layer plans of its own: a layer is planned into its own
    model's next norm, and accuracy lent for one model is not given by the other's forward, though
    both are called on the same labels."""
    first, second = tiny_model("llama"), tiny_model("llama")
    want = run(tiny_model("llama"))
    tigon.patch(first)
    tigon.patch(second)
    first_plans, second_plans = layer_plans(first), layer_plans(second)
    assert first_plans[0].relay is not second_plans[0].relay
    assert first_plans[0].next_norm is first.model.layers[1].input_layernorm
    assert second_plans[-1].next_norm is second.model.norm
    ids, mask, labels = batch()
    first.train()
    second.train()
    hits = []
    with token_accuracy(first, hits):
        second(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        assert hits == []
        first(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert len(hits) == 1
    tigon.unpatch(first)
    assert not layer_plans(first) and len(layer_plans(second)) == 2
    assert_same_run(run(second), want)


def test_torch_compile_of_a_patched_model_gives_eager_results():
    """Under torch.compile the hand-offs are off (handoff.live): the compiled patched model
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
    with token_accuracy(model, hits):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert layer_plans(model)[0].relay.accuracy is None and len(hits) == 1
    (hit, count), = hits
    assert count == valid.sum() and hit == ((logits.argmax(-1) == targets) & valid).sum() and hit >= 5
    assert torch.equal(loss, plain)


def test_a_layer_planned_without_a_next_norm_adds_alone(monkeypatch):
    """The layer forwards read their plan on each call: with the planned next norms cleared (how
    scripts/cross_layer_norm_e2e.py times the model without the cross-layer fusion) every norm
    after a layer runs as its own kernel, with the same loss and gradients."""
    from tigon import functional

    model = tiny_model("llama")
    want = run(model)
    tigon.patch(model)
    calls = {"add_rms_norm": 0, "rms_norm": 0}
    for name in calls:
        original = getattr(functional, name)
        monkeypatch.setattr(functional, name,
                            lambda *a, _f=original, _n=name, **k: calls.__setitem__(_n, calls[_n] + 1) or _f(*a, **k))
    for plan in layer_plans(model):
        plan.next_norm = None
    assert_same_run(run(model), want)
    assert calls == {"add_rms_norm": 0, "rms_norm": 1 + model.config.num_hidden_layers}


def test_what_varies_per_call_is_asked_in_one_place():
    """Compilation, capture, distribution and checkpointing are asked through tigon.patch.handoff
    (and the capture, on the ops floor, through tigon.ops.capturing) and nowhere else in patch/:
    a forward that asked torch itself would be a second answer to one question."""
    from pathlib import Path

    src = Path(tigon.__file__).parent
    questions = {"is_compiling": "handoff.py", "is_current_stream_capturing": None,
                 "distributed.is_initialized": "handoff.py", '"gradient_checkpointing"': "handoff.py"}
    for path in sorted((src / "patch").glob("*.py")):
        text = path.read_text()
        for question, home in questions.items():
            assert question not in text or path.name == home, f"{path.name} asks {question} itself"
    askers = [p.relative_to(src).as_posix() for p in src.rglob("*.py") if "is_current_stream_capturing" in p.read_text()]
    assert askers == ["ops/_dispatch.py"]
