"""Tiny random-weight models of every patched family, built from the HF config classes."""

from __future__ import annotations

import torch

VOCAB = 1000

# Beyond the shared sizes, what each family needs to be small, exercise its quirks, and keep every
# token id inside the vocabulary.
EXTRA = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True),
    "qwen3_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, mlp_only_layers=[1],
        output_router_logits=True,
    ),
    "gemma2": dict(final_logit_softcapping=30.0, attn_logit_softcapping=50.0, sliding_window=8),
    "gemma3_text": dict(final_logit_softcapping=30.0, sliding_window=8),
    "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=4.0),
    # Residual dropout on: the fused layer must draw the same masks in the same order.
    "phi3": dict(resid_pdrop=0.1, embd_pdrop=0.0, attention_dropout=0.0, partial_rotary_factor=0.5),
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
    """Built on the CPU from `seed`, then moved: the same weights on every device."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
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
