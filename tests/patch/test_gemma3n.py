"""Gemma 3n's language model: MLPs whose gate has activation sparsity (a Gaussian top-k cut before
the GELU, which no kernel computes) keep HF's forward while the dense ones run tigon's GeGLU, and
layers that reuse an earlier layer's keys and values project q alone."""

from __future__ import annotations

import copy

import pytest
import torch

import tigon
from tests.patch.test_patch import assert_same_run, count_calls, run
from tests.patch.test_training import ATTENTION_AND_MLP
from tests.patch.tiny import family_params, tiny_model


@pytest.fixture(autouse=True)
def clean_patches():
    yield
    tigon.unpatch()


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("model_type", family_params(["gemma3n_text"]))
def test_sparse_gates_keep_hfs_mlp_and_shared_kv_layers_project_q_alone(model_type, lora, monkeypatch):
    """With LoRA on the attention and MLP linears, the sparse MLP keeps PEFT's path as well."""
    model = tiny_model(
        model_type, num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        activation_sparsity_pattern=[0.95, 0.0, 0.0], num_kv_shared_layers=1,
    )
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(
            r=4, lora_alpha=8, target_modules=ATTENTION_AND_MLP, lora_dropout=0.0, init_lora_weights=False,
        ))
    patched = copy.deepcopy(model)
    want = run(model)
    prefix = "lora_" if lora else ""
    mlps = count_calls(monkeypatch, "lora_gated_mlp" if lora else "glu_mlp")
    groups = count_calls(monkeypatch, f"{prefix}linear_group")
    assert {"geglu", "qkv_group"} <= set(tigon.patch(patched).applied)
    got = run(patched)
    assert len(mlps) == 2, "the two dense MLPs run tigon's GeGLU, the sparse one HF's"
    assert len(groups) == 2, "layer 2 reuses layer 0's keys and values: its q has no group"
    assert_same_run(got, want)
