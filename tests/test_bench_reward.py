"""`tigon bench --reward` on CPU at a tiny shape: every implementation but the compiled one runs
TRL's or tigon's reward trainer to the end, on the same model, data and seed, to the same loss."""

import pytest
import torch

pytest.importorskip("trl")


def test_reward_bench_cases_run_and_train_alike(monkeypatch):
    from tigon.bench import reward

    monkeypatch.setenv("TIGON_DISABLE", "all")  # the kernels run in tests/ops; here, the trainers around them
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=300)
    try:
        records = [reward.run_case(impl, pairs=2, seq=12, steps=2, warmup=1, lora_rank=4, seed=0,
                                   device=torch.device("cpu"), shape=shape) for impl in ("peer", "eager", "tigon")]
    finally:
        torch.set_num_threads(threads)
    assert [r["impl"] for r in records] == ["peer", "eager", "tigon"]
    assert all(r["tok_s"] > 0 and r["step_ms"] > 0 for r in records)
    losses = [r["train_loss"] for r in records]
    assert losses[0] == pytest.approx(losses[1], rel=2e-2) and losses[0] == pytest.approx(losses[2], rel=2e-2)
