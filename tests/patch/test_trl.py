"""TRL's SFTTrainer on a tigon-patched model: same losses step by step, tigon's kernels running.

TRL (1.x) scores the loss with its own chunked LM head on the backbone's hidden states, so there
the decoder kernels (norms, RoPE, MLP, LoRA) are tigon's and the loss is TRL's.
"""

import pytest
import torch

import tigon
import tigon.functional
from tigon.train.tiny import build_model, build_tokenizer
from tigon.train.data import Sample

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Fused kernels keep intermediates in registers instead of memory.",
    "A residual stream carries the hidden state from layer to layer.",
    "Gradient checkpointing trades compute for activation memory.",
] * 4


def _train(tmp_path, *, patched: bool, lora: bool, monkeypatch) -> tuple[list[float], int]:
    from trl import SFTConfig, SFTTrainer

    tokenizer = build_tokenizer([Sample(where=f"row {i}", text=t) for i, t in enumerate(TEXTS)])
    model = build_model(tokenizer, seed=0, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)  # the adapters' initial A matrices, the same in both runs
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    calls = [0]
    for name in ("add_rms_norm", "add_rms_norm_glu_mlp"):
        fused = getattr(tigon.functional, name)

        def counted(*args, _fused=fused, **kwargs):
            calls[0] += 1
            return _fused(*args, **kwargs)

        monkeypatch.setattr(tigon.functional, name, counted)
    if patched:
        tigon.patch(model)
    args = SFTConfig(
        output_dir=str(tmp_path / ("on" if patched else "off")), max_steps=4, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, seed=0, data_seed=0, max_length=32,
        save_strategy="no", dataloader_num_workers=0, bf16=False, fp16=False,
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": TEXTS}), processing_class=tokenizer
    )
    trainer.train()
    if patched:
        tigon.unpatch(model)
    return [log["loss"] for log in trainer.state.log_history if "loss" in log], calls[0]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sft_trainer_losses_match_unpatched(tmp_path, monkeypatch, lora):
    losses, calls = _train(tmp_path, patched=True, lora=lora, monkeypatch=monkeypatch)
    want, calls_unpatched = _train(tmp_path, patched=False, lora=lora, monkeypatch=monkeypatch)
    assert calls > 0 and calls_unpatched == 0  # the fused layers ran inside TRL's forward
    assert len(losses) == len(want) == 4
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-4, atol=1e-4)
