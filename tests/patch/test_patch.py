"""tigon.patch on tiny random models of every family: same logits, loss and gradients as HF."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

import tigon
from tests.helpers import assert_close
from tests.patch.tiny import batch, tiny_model
from tigon.patch import FAMILIES
from tigon.patch.families import Family


@pytest.fixture(autouse=True)
def clean_patches():
    yield
    tigon.unpatch()


def modeling(family: Family):
    return importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")


def run(model, seed=0, **kwargs):
    """Loss, logits and every parameter's gradient after one forward/backward in training mode."""
    model.train()
    model.zero_grad(set_to_none=True)
    ids, mask, labels = batch(seed)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, **kwargs)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
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


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_instance_patch_matches_hf(model_type):
    model = tiny_model(model_type)
    patched = copy.deepcopy(model)
    result = tigon.patch(patched)
    assert "rms_norm" in result.applied
    assert result.layers == 2
    assert_same_run(run(patched), run(model))


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_class_patch_matches_hf_and_unpatch_restores(model_type):
    family = FAMILIES[model_type]
    module = modeling(family)
    originals = {name: vars(getattr(module, name)).get("forward") for name in (family.norm.cls,)}
    want = run(tiny_model(model_type))
    result = tigon.patch(model_type)
    assert str(result).startswith("tigon: applied rms_norm")
    assert all(vars(getattr(module, name))["forward"] is not fwd for name, fwd in originals.items())
    assert_same_run(run(tiny_model(model_type)), want)
    tigon.unpatch(model_type)
    assert all(vars(getattr(module, name))["forward"] is fwd for name, fwd in originals.items())


def test_instance_unpatch_restores_hf_forwards():
    model = tiny_model("llama")
    norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    tigon.patch(model)
    assert all("forward" in vars(m) for m in norms)
    tigon.unpatch(model)
    assert not any("forward" in vars(m) for m in norms)


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
