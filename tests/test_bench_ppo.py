"""The PPO step benchmark's pipeline on CPU (its numbers mean nothing here): eager over the
logits and tigon's fused ops from the same weights and rollout give the same PPO losses, update
after update, full fine-tuning (a frozen reference copy) and LoRA (the adapter switched off)."""

import json

import pytest
import torch

from tigon.bench import e2e, ppo
from tigon.bench.ppo import format_table, run_ppo_bench

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=300, tie_word_embeddings=True, rope_theta=10000.0)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_eager_and_tigon_take_the_same_ppo_steps(mode, monkeypatch, tmp_path):
    if mode == "lora":
        pytest.importorskip("peft")
    monkeypatch.setenv("TIGON_DISABLE", "linear_policy_loss,linear_log_probs")  # their references, in seconds
    # fp32: the Triton interpreter's bf16 is not the GPU's (the other kernels run there).
    monkeypatch.setattr(ppo, "build_model", lambda *args, **kwargs: e2e.build_model(*args, **kwargs).float())
    torch.set_num_threads(1)
    lines = []
    records = run_ppo_bench([mode], ["eager", "tigon"], prompts=3, prompt_len=5, new_tokens=7, epochs=2, steps=1,
                            warmup=1, shape=SHAPE, lora_rank=4, device=torch.device("cpu"), log=lines.append,
                            out_dir=tmp_path)
    saved = json.loads((tmp_path / "ppo.json").read_text())
    assert saved["environment"]["device"] == "cpu" and [r["impl"] for r in saved["records"]] == ["eager", "tigon"]
    assert not [r["error"] for r in records if "error" in r]
    eager, tigon = records
    assert len(eager["losses"]) == len(tigon["losses"]) == 4 and eager["losses"][0] != 0
    assert tigon["losses"] == pytest.approx(eager["losses"], rel=1e-4, abs=1e-6)
    assert eager["losses"][-1] != eager["losses"][0]  # the updates moved the policy
    assert tigon["step_ms"] > 0 and len(format_table(records).splitlines()) == 3
