"""tigon.patch in use: PEFT LoRA models, the auto-class wrapper, and training runs step by step."""

from __future__ import annotations

import copy

import pytest
import torch

import tigon
from tests.patch.test_patch import assert_same_run, run
from tests.patch.tiny import batch, family_params, tiny_config, tiny_model
from tigon.patch import FAMILIES


@pytest.fixture(autouse=True)
def clean_patches(monkeypatch):
    yield
    tigon.unpatch()


ATTENTION_AND_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(model_type: str, seed: int = 0, device="cpu"):
    from peft import LoraConfig, get_peft_model

    # PEFT refuses LoRA on a Mamba mixer's linears: Falcon-H1 gets its attention and MLP ones.
    targets = ATTENTION_AND_MLP if model_type == "falcon_h1" else "all-linear"
    model = get_peft_model(
        tiny_model(model_type, seed, device=device),
        LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0),
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # PEFT starts B at zero, which would hide a wrong adapter path
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


# Each way a family's LoRA linears can meet: a gated MLP of three (llama), a packed gate_up_proj
# (phi3), an MLP with multipliers (falcon_h1), MLA's two input projections (deepseek_v3), MLP
# dropout (seed_oss), a hybrid model's layers (qwen3_next).
LORA_CASES = ["llama", "phi3", "falcon_h1", "deepseek_v3", "seed_oss", "qwen3_next"]


@pytest.mark.parametrize("model_type", family_params(LORA_CASES))
def test_peft_lora_model_matches_unpatched(model_type, device):
    model = lora_model(model_type, device=device)
    want = run(model)
    result = tigon.patch(model)
    assert {"lora", "rms_norm", "linear_cross_entropy"} <= set(result.applied)
    assert result.target == f"{type(model.get_base_model()).__name__}"
    got = run(model)
    assert all("lora_" in name for name in got[2]), "only the adapters train"
    assert_same_run(got, want)
    tigon.unpatch(model)
    assert not any("forward" in vars(m) for m in model.modules())


def test_patch_before_peft_wrapping():
    """Patch the plain model, then add LoRA: the patched MLPs call the LoRA-wrapped projections."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    base = tiny_model("qwen3")
    patched_base = copy.deepcopy(base)
    torch.manual_seed(5)
    want = run(get_peft_model(base, config))
    tigon.patch(patched_base)
    torch.manual_seed(5)
    assert_same_run(run(get_peft_model(patched_base, config)), want)


def test_from_config_and_from_pretrained_patch_the_family(tmp_path):
    config = tiny_config("qwen3")
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_config(config)
    want = run(reference)
    from transformers.models.qwen3 import modeling_qwen3

    hf_rope = modeling_qwen3.apply_rotary_pos_emb  # (a module, not a function, where `kernels` is installed)
    torch.manual_seed(0)
    model = tigon.AutoModelForCausalLM.from_config(config, rope=False)
    assert "tigon_" in type(model.model.norm).forward.__qualname__
    assert modeling_qwen3.apply_rotary_pos_emb is hf_rope, "rope=False is honoured"
    assert_same_run(run(model), want)

    reference.save_pretrained(tmp_path)
    tigon.unpatch()
    loaded = tigon.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "tigon_" in type(loaded).forward.__qualname__
    assert_same_run(run(loaded), want)


def train(model, steps: int, **batch_kwargs):
    """Losses of `steps` AdamW steps on fixed random batches."""
    device = next(model.parameters()).device
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for step in range(steps):
        ids, mask, labels = (t.to(device) for t in batch(100 + step % 4, **batch_kwargs))
        torch.manual_seed(step)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


def test_twenty_adamw_steps_match_step_by_step(device):
    model = tiny_model("llama", device=device)
    patched = copy.deepcopy(model)
    want = train(model, 20, rows=1, cols=8, pad_tail=2)
    tigon.patch(patched)
    got = train(patched, 20, rows=1, cols=8, pad_tail=2)
    assert want[-1] < want[0] - 0.5, "the run must actually learn for the comparison to mean much"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_hf_trainer_with_gradient_accumulation_and_checkpointing(tmp_path, device):
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
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=device.type == "cpu", seed=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
        assert model.model.layers[0].gradient_checkpointing
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    model = tiny_model("gemma2", device=device)
    patched = copy.deepcopy(model)
    want = losses(model)
    tigon.patch(patched)
    got = losses(patched)
    assert len(want) == 3
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", family_params())
def test_bf16_on_gpu_no_less_accurate_than_hf(model_type, device):
    """In bf16 neither side is exact: both are held against the same model in fp32, and tigon's
    error in the loss and every gradient must stay within twice HF's own bf16 error (+ slack)."""
    oracle = run(tiny_model(model_type, device=device))
    hf = tiny_model(model_type, device=device, dtype=torch.bfloat16)
    want = run(hf)
    tigon.patch(hf)
    got = run(hf)
    for name, (ours, theirs, exact) in {
        "loss": (got[0], want[0], oracle[0]),
        **{f"grad {n}": (got[2][n], want[2][n], oracle[2][n]) for n in oracle[2]},
    }.items():
        hf_error = relative_error(theirs, exact)
        assert relative_error(ours, exact) <= 2 * hf_error + 2e-3, f"{name}: HF's bf16 error is {hf_error:.2e}"


@pytest.mark.gpu
def test_bf16_training_losses_follow_eager(device):
    model = tiny_model("llama", device=device, dtype=torch.bfloat16)
    patched = copy.deepcopy(model)
    want = train(model, 20, cols=64)
    tigon.patch(patched)
    got = train(patched, 20, cols=64)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "gemma2", "qwen3_moe"])
def test_torch_compile_of_patched_model(model_type, device):
    """torch.compile of the whole patched model gives the eager patched model's loss and gradients
    (the loss ops are graph breaks by design; the rest compiles around the Triton kernels)."""
    model = tiny_model(model_type, device=device)
    tigon.patch(model)
    want = run(model)
    torch._dynamo.reset()
    got = run(torch.compile(model))
    assert_same_run(got, want)
