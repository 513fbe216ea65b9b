import logging

import pytest
import torch

import tigon
from tigon.train.config import SFTConfig
from tigon.train.modeling import apply_kernels, flops_per_token, kernel_switches


def test_kernel_switches():
    assert kernel_switches([]) == {}
    assert kernel_switches(["rope", "swiglu"]) == {"rope": False, "swiglu": False}
    # without the fused linear+CE, the fused CE (from logits) takes over unless it is off too
    assert kernel_switches(["linear_cross_entropy"]) == {"linear_cross_entropy": False, "cross_entropy": True}
    assert kernel_switches(["linear_cross_entropy", "cross_entropy"]) == {
        "linear_cross_entropy": False, "cross_entropy": False}


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1))


def applied(line):
    return set(line.split("applied ")[1].split(" to ")[0].split(", "))


def test_apply_kernels_follows_the_switches(caplog):
    caplog.set_level(logging.INFO)
    model = tiny_llama()
    try:
        everything = applied(apply_kernels(model, SFTConfig()))
        assert "rms_norm" in everything
        tigon.unpatch(model)
        fewer = applied(apply_kernels(model, SFTConfig(kernels_off=["rms_norm"])))
        assert fewer == everything - {"rms_norm"}
        tigon.unpatch(model)
        assert applied(apply_kernels(model, SFTConfig(recompute_mlp=True))) == everything | {"recompute_mlp"}
    finally:
        tigon.unpatch(model)
    assert apply_kernels(model, SFTConfig(kernels=False)).startswith("tigon: kernels off (--no-kernels)")


def test_no_kernels_runs_the_familys_own_functions_after_a_dropped_patched_model():
    """A patched model dropped without unpatch leaves Llama's RoPE function swapped (given back once
    collected, at the next patch or unpatch call, never by the collector mid-step): a --no-kernels
    model built after it still runs transformers' own."""
    import gc

    from transformers.models.llama import modeling_llama

    hf_rope = modeling_llama.apply_rotary_pos_emb
    for collected in (True, False):  # found by the collector already, or only once the run asks
        dropped = tiny_llama()
        tigon.patch(dropped)
        dropped.cycle = dropped
        del dropped
        if collected:
            gc.collect()
        assert modeling_llama.apply_rotary_pos_emb is not hf_rope, "the test needs the swap left behind"
        apply_kernels(tiny_llama(), SFTConfig(kernels=False))
        assert modeling_llama.apply_rotary_pos_emb is hf_rope


def test_unsupported_family_trains_unpatched(caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    line = apply_kernels(model, SFTConfig())
    assert line.startswith("tigon: kernels off:") and "gpt2" in line
    assert line in caplog.text


@pytest.mark.parametrize("frozen", [False, True])
def test_flops_per_token_counts_weight_gradients_of_trainable_weights_only(frozen):
    model = torch.nn.Sequential(torch.nn.Linear(7, 11), torch.nn.ReLU(), torch.nn.Linear(11, 5, bias=False))
    model.requires_grad_(not frozen)
    weights = 7 * 11 + 11 * 5
    assert flops_per_token(model, seq_len=100) == (4 if frozen else 6) * weights
