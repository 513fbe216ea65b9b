"""Tiny random-weight models of every patched family, built from the HF config classes."""

from __future__ import annotations

import pytest
import torch

from tigon.patch import FAMILIES
from tigon.patch.families import available, modeling_module

VOCAB = 1000

# Beyond the shared sizes, what each family needs to be small, exercise its quirks, and keep every
# token id inside the vocabulary.
SLIDING = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
HYBRID = dict(
    layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=3, initializer_range=0.02,
)
# An expert block in layer 1 with a shared expert beside it, a dense MLP in layer 0.
DEEPSEEK_MOE = dict(
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, n_shared_experts=1,
    first_k_dense_replace=1, n_group=1, topk_group=1,
)
MLA = dict(
    q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8, num_key_value_heads=4,
)
EXTRA = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True),
    "qwen3_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, mlp_only_layers=[1],
        output_router_logits=True,
    ),
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, shared_expert_intermediate_size=48,
        mlp_only_layers=[0], output_router_logits=True,
    ),
    "qwen3_next": dict(
        HYBRID, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, shared_expert_intermediate_size=48,
        mlp_only_layers=[0], output_router_logits=True,
    ),
    "qwen3_5_text": HYBRID,
    "qwen3_5_moe_text": dict(
        HYBRID, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, shared_expert_intermediate_size=48,
        output_router_logits=True,
    ),
    "gemma2": dict(final_logit_softcapping=30.0, attn_logit_softcapping=50.0, sliding_window=8),
    "gemma3_text": dict(final_logit_softcapping=30.0, sliding_window=8),
    "gemma4_text": dict(
        final_logit_softcapping=30.0, sliding_window=8, hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
        global_head_dim=16, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=40,
    ),
    # (Sparse gates and layers reusing another's keys and values: tests/patch/test_gemma_layers.py.)
    "gemma3n_text": dict(
        SLIDING, activation_sparsity_pattern=[0.0, 0.0], num_kv_shared_layers=0, final_logit_softcapping=3.0,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB, laurel_rank=8, altup_num_inputs=2,
    ),
    "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=4.0),
    # (No router logits: transformers 5.17's GraniteMoe records none, and its own loss then fails.)
    "granitemoe": dict(
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=4.0,
        num_local_experts=4, num_experts_per_tok=2,
    ),
    # Residual dropout on: the fused layer must draw the same masks in the same order.
    "phi3": dict(resid_pdrop=0.1, embd_pdrop=0.0, attention_dropout=0.0, partial_rotary_factor=0.5),
    "seed_oss": dict(residual_dropout=0.1, attention_dropout=0.0),
    "starcoder2": dict(residual_dropout=0.1),
    # Clipping q/k/v in place, on the parts of a grouped projection.
    "olmo": dict(clip_qkv=0.3),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, clip_qkv=0.3, output_router_logits=True),
    "olmo3": SLIDING,
    "ministral": SLIDING,
    "cohere2": SLIDING,
    "exaone4": dict(SLIDING, sliding_window_pattern=2),
    "gpt_oss": dict(SLIDING, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True),
    "llama4_text": dict(
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, intermediate_size_mlp=72,
        no_rope_layer_interval=2, attn_temperature_tuning=True, floor_scale=4, output_router_logits=True,
    ),
    "cohere": dict(logit_scale=0.7),
    "deepseek_v3": {**DEEPSEEK_MOE, **MLA},
    "deepseek_v2": {**DEEPSEEK_MOE, **MLA},
    "glm4_moe": dict(DEEPSEEK_MOE, use_qk_norm=True),
    "dots1": DEEPSEEK_MOE,
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2),
    "ernie4_5_moe": dict(
        moe_num_experts=4, moe_k=2, moe_intermediate_size=40, moe_num_shared_experts=1, moe_layer_start_index=1,
        output_router_logits=True,
    ),
    "minimax": dict(
        layer_types=["linear_attention", "full_attention"], block_size=4, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True,
    ),
    "falcon_h1": dict(
        mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=3,
        mamba_chunk_size=8, mlp_multipliers=[0.7, 1.3], lm_head_multiplier=0.5, key_multiplier=0.9,
        attention_in_multiplier=1.1, attention_out_multiplier=0.8, ssm_out_multiplier=1.2,
    ),
}


def tiny_config(model_type: str, **overrides):
    from transformers import AutoConfig

    kwargs = dict(
        hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, initializer_range=0.1,
    )
    kwargs.update(EXTRA.get(model_type, {}))
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = "eager"
    return config


def randomise_norms(model: torch.nn.Module, generator: torch.Generator) -> None:
    """HF initialises norm weights to 1 (or 0 for Gemma's offset form); random ones make a
    wrong offset or rounding order show."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5 + 0.5)


def tiny_model(model_type: str, seed: int = 0, device="cpu", dtype=torch.float32, **overrides):
    """Built on the CPU from `seed`, then moved: the same weights on every device. What the test
    draws next from torch's generator (adapters, dropout) follows from `seed` too."""
    from tigon.train.tiny import random_model

    torch.manual_seed(seed)
    model = random_model(tiny_config(model_type, **overrides), seed)
    randomise_norms(model, torch.Generator().manual_seed(seed))
    return model.to(device, dtype)


def batch(seed: int = 0, rows: int = 2, cols: int = 13, pad_tail: int = 3):
    """Token ids, labels with ignored (-100) positions, and an attention mask with right padding."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, cols), generator=gen)
    mask = torch.ones(rows, cols, dtype=torch.long)
    mask[-1, cols - pad_tail:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :2] = -100
    return ids, mask, labels


def family_params(model_types=None) -> list:
    """`model_types` (default: every family) as pytest parameters, each one the installed
    transformers lacks skipped with the module it lacks."""
    return [
        pytest.param(t, marks=pytest.mark.skipif(
            not available(t), reason=f"transformers has no {modeling_module(FAMILIES[t])}"
        ))
        for t in sorted(FAMILIES if model_types is None else model_types)
    ]
