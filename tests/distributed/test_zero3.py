"""DeepSpeed ZeRO-3's contract, imitated without DeepSpeed (which tigon does not depend on).

Under ZeRO-3 a parameter is marked with a `ds_id` and its data is empty except while its own
module's forward runs (a pre-forward hook gathers it, a post-forward hook releases it). A patched
forward that reads another module's weight directly must not see the empty tensor. This checks
tigon's side of that contract, not DeepSpeed itself.
"""

from __future__ import annotations

import sys

import pytest
import torch

import tigon
from tests.helpers import assert_close
from tests.patch.tiny import batch, tiny_model
from tigon import functional


@pytest.fixture(autouse=True)
def clean_patches():
    yield
    tigon.unpatch()


def imitate_zero3(model: torch.nn.Module) -> None:
    whole = {}
    for ds_id, param in enumerate(model.parameters()):
        param.ds_id = ds_id
        whole[param] = param.data
        param.data = torch.empty(0, dtype=param.dtype)

    def gather(module, *_):
        for param in module.parameters(recurse=False):
            param.data = whole[param]

    def release(module, *_):
        for param in module.parameters(recurse=False):
            param.data = torch.empty(0, dtype=param.dtype)

    for module in model.modules():
        module.register_forward_pre_hook(gather)
        module.register_forward_hook(release)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_patched_forward_reads_weights_only_inside_their_module(model_type, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # the imitation's parameters cannot be gathered
    ids, mask, labels = batch(seed=7)
    model = tiny_model(model_type, seed=7).train()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, labels=labels)
    tigon.patch(model)
    imitate_zero3(model)
    calls = []
    real_rms_norm = functional.rms_norm
    monkeypatch.setattr(functional, "rms_norm", lambda *a, **k: calls.append(1) or real_rms_norm(*a, **k))
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert calls, "the norms did not run on tigon's kernel"
    assert_close(got.loss, want.loss, name="loss")
    assert_close(got.logits, want.logits, name="logits")
    assert all(param.numel() == 0 for param in model.parameters()), "a weight was left gathered"
