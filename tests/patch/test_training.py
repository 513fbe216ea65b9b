"""tigon.patch in use: PEFT LoRA models, the auto-class wrapper, and training runs step by step."""

from __future__ import annotations

import copy

import pytest
import torch

import tigon
from tests.patch.test_patch import assert_same_run, run
from tests.patch.tiny import batch, tiny_config, tiny_model


@pytest.fixture(autouse=True)
def clean_patches(monkeypatch):
    yield
    tigon.unpatch()


def lora_model(model_type: str, seed: int = 0):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_model(model_type, seed),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0),
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # PEFT starts B at zero, which would hide a wrong adapter path
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_peft_lora_model_matches_unpatched(model_type):
    model = lora_model(model_type)
    patched = copy.deepcopy(model)
    result = tigon.patch(patched)
    assert {"lora", "rms_norm", "linear_cross_entropy"} <= set(result.applied)
    assert result.target == f"{type(model.get_base_model()).__name__}"
    got = run(patched)
    assert all("lora_" in name for name in got[2]), "only the adapters train"
    assert_same_run(got, run(model))
    tigon.unpatch(patched)
    assert not any("forward" in vars(m) for m in patched.modules())


def test_patch_before_peft_wrapping():
    """Patch the plain model, then add LoRA: the patched MLPs call the LoRA-wrapped projections."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    base = tiny_model("qwen3")
    patched_base = copy.deepcopy(base)
    tigon.patch(patched_base)
    torch.manual_seed(5)
    model = get_peft_model(base, config)
    torch.manual_seed(5)
    patched = get_peft_model(patched_base, config)
    assert_same_run(run(patched), run(model))


def test_from_config_and_from_pretrained_patch_the_family(tmp_path):
    config = tiny_config("qwen3")
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_config(config)
    want = run(reference)
    torch.manual_seed(0)
    model = tigon.AutoModelForCausalLM.from_config(config, rope=False)
    from transformers.models.qwen3 import modeling_qwen3

    assert "tigon_" in type(model.model.norm).forward.__qualname__
    assert "tigon_" not in modeling_qwen3.apply_rotary_pos_emb.__qualname__, "rope=False is honoured"
    assert_same_run(run(model), want)

    reference.save_pretrained(tmp_path)
    tigon.unpatch()
    loaded = tigon.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "tigon_" in type(loaded).forward.__qualname__
    assert_same_run(run(loaded), want)


def train(model, steps: int, **batch_kwargs):
    """Losses of `steps` AdamW steps on fixed random batches."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for step in range(steps):
        ids, mask, labels = batch(100 + step % 4, **batch_kwargs)
        torch.manual_seed(step)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


def test_twenty_adamw_steps_match_step_by_step():
    model = tiny_model("llama")
    patched = copy.deepcopy(model)
    tigon.patch(patched)
    got, want = train(patched, 20, cols=9), train(model, 20, cols=9)
    assert want[-1] < want[0] - 0.5, "the run must actually learn for the comparison to mean much"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_hf_trainer_with_gradient_accumulation_and_checkpointing(tmp_path):
    """Trainer passes num_items_in_batch across accumulated micro-batches and recomputes layers
    under gradient checkpointing; the logged losses must not notice tigon."""
    from transformers import Trainer, TrainingArguments

    def losses(model):
        rows = []
        for seed in range(6):
            ids, mask, labels = batch(200 + seed, rows=1, cols=11, pad_tail=seed % 3)
            rows.append(dict(input_ids=ids[0], attention_mask=mask[0], labels=labels[0]))
        args = TrainingArguments(
            output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=1,
            gradient_accumulation_steps=2, gradient_checkpointing=True, learning_rate=3e-3,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
        assert model.model.layers[0].gradient_checkpointing
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    model = tiny_model("gemma2")
    patched = copy.deepcopy(model)
    tigon.patch(patched)
    got, want = losses(patched), losses(model)
    assert len(want) == 3
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
