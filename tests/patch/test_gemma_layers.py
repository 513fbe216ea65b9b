"""Gemma 3n's and Gemma 4's language models: MLPs whose gate has activation sparsity (Gemma 3n: a
Gaussian top-k cut before the GELU, which no kernel computes) keep HF's forward while the dense
ones run tigon's GeGLU; attentions that reuse an earlier layer's keys and values project q alone,
and so do Gemma 4's full-attention ones whose values are their keys (no v_proj)."""

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


# Three layers (sliding, full, sliding), the last reusing the first's keys and values; beyond that,
# each family's case and how many of its MLPs and q/k/v groups then run as one op.
CASES = {
    "gemma3n_text": (dict(activation_sparsity_pattern=[0.95, 0.0, 0.0]), 2, 2),
    "gemma4_text": (dict(attention_k_eq_v=True), 3, 1),
}


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("model_type", family_params(CASES))
def test_sparse_gates_and_attentions_without_k_or_v_keep_hfs_path(model_type, lora, monkeypatch):
    """With LoRA on the attention and MLP linears, those keep PEFT's path as well."""
    extra, want_mlps, want_groups = CASES[model_type]
    model = tiny_model(
        model_type, num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_kv_shared_layers=1, **extra,
    )
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(
            r=4, lora_alpha=8, target_modules=ATTENTION_AND_MLP, lora_dropout=0.0, init_lora_weights=False,
        ))
    patched = copy.deepcopy(model)
    want = run(model)
    mlps = count_calls(monkeypatch, "lora_gated_mlp" if lora else "glu_mlp")
    groups = count_calls(monkeypatch, "lora_linear_group" if lora else "linear_group")
    assert {"geglu", "qkv_group"} <= set(tigon.patch(patched, moe_experts=False).applied)
    got = run(patched)
    assert (len(mlps), len(groups)) == (want_mlps, want_groups)
    assert_same_run(got, want)
