"""The end-to-end benchmark's pipeline on a tiny Llama on CPU (its numbers mean nothing here)."""

from __future__ import annotations

import json

import pytest
import torch

import tigon
from tigon.bench.e2e import run_e2e

TINY = dict(
    hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=1000, tie_word_embeddings=True,
)


def test_e2e_runs_both_modes_and_reports_matching_losses(tmp_path):
    from transformers.models.llama import modeling_llama

    hf_rope = modeling_llama.apply_rotary_pos_emb  # (a module, not a function, where `kernels` is installed)
    lines = []
    records = run_e2e(
        batch=1, seq=8, steps=2, warmup=1, shape=TINY, device=torch.device("cpu"), out_dir=tmp_path, log=lines.append
    )
    assert [(r["mode"], r["impl"]) for r in records] == [
        ("full", "eager"), ("full", "tigon"), ("lora", "eager"), ("lora", "tigon"),
    ]
    assert not [r["error"] for r in records if "error" in r]
    for record in records:
        assert record["tokens_per_s"] > 0 and len(record["losses"]) == 3
        assert record["max_loss_diff"] < 0.02, "bf16 runs of the same model and data"
    assert "lora" in records[-1]["applied"]
    assert json.loads((tmp_path / "e2e.json").read_text())["results"][0]["impl"] == "eager"
    # Every patch is undone after its run.
    assert modeling_llama.apply_rotary_pos_emb is hf_rope
    tigon.unpatch()


def test_e2e_cadences_train_alike():
    """Synchronising around each step changes what is timed, not what is trained."""
    runs = [
        run_e2e(modes=["full"], impls=["tigon"], batch=1, seq=8, steps=2, warmup=1, shape=TINY,
                device=torch.device("cpu"), sync_steps=sync, log=lambda line: None)[0]
        for sync in (False, True)
    ]
    for record in runs:
        assert "error" not in record, record.get("error")
        assert record["tokens_per_s"] > 0 and len(record["losses"]) == 3
    assert runs[0]["losses"] == runs[1]["losses"]


def test_busy_reading_skips_the_warm_up_and_spans_the_minimum_time(monkeypatch):
    """Where GPU busy is read, its window opens at the first timed step and again BUSY_SETTLE_S
    later (NVML's samples reach back into the warm-up), and the timed steps go on past their
    number until they span BUSY_MIN_TIMED_S (a clock that each step moves by 20 ms)."""
    from types import SimpleNamespace

    import tigon.bench.e2e as e2e

    now = [0.0]
    monkeypatch.setattr(e2e, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(e2e, "BUSY_SETTLE_S", 0.05)
    monkeypatch.setattr(e2e, "BUSY_MIN_TIMED_S", 0.19)
    model = e2e.build_model("full", 8, torch.device("cpu"), shape=TINY, lora_rank=4, checkpointing=False)
    forward_backward = e2e.micro_step(model)
    opened = []

    class Meter:
        def window(self):
            opened.append(now[0])

    def step(ids):
        now[0] += 0.02
        return forward_backward(ids)

    times, losses = e2e.timed_steps(model, step, TINY["vocab_size"], 1, 8, 2, 3, busy=Meter())
    assert times == pytest.approx([0.02] * 10) and len(losses) == 12  # 2 warm-up steps, then 0.19 s or more
    assert opened == pytest.approx([0.04, 0.1])  # at the first timed step, and 0.06 s of steps later
    plain_times, plain_losses = e2e.timed_steps(model, step, TINY["vocab_size"], 1, 8, 2, 3)
    assert len(plain_times) == 3 and len(plain_losses) == 5  # no meter: the steps asked for


def test_bench_e2e_runs_each_shape_given(tmp_path, monkeypatch, capsys):
    import tigon.bench.e2e as e2e
    from tigon.cli import main

    calls = []
    monkeypatch.setattr(e2e, "run_e2e", lambda **kw: calls.append(kw) or [{"mode": "full"}])
    assert main(["bench", "--e2e", "1x1024", "4x2048", "--e2e-impls", "tigon", "tigon+graphs", "--out", str(tmp_path)]) == 0
    assert [(c["batch"], c["seq"], c["impls"], c["out_dir"].name, c["steps"]) for c in calls] == [
        (1, 1024, ["tigon", "tigon+graphs"], "1x1024", 80), (4, 2048, ["tigon", "tigon+graphs"], "4x2048", 10)]
    calls.clear()
    assert main(["bench", "--e2e"]) == 0
    assert [(c["batch"], c["seq"], c["impls"], c["out_dir"], c["steps"]) for c in calls] == [
        (4, 2048, ["eager", "tigon"], None, 10)]
    assert main(["bench", "--e2e", "1x1024x3"]) == 2
    assert "--e2e takes batch x tokens shapes such as 1x1024, got 1x1024x3" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_e2e_graph_replay_trains_like_plain_and_reports_busy():
    """tigon+graphs (the patched model's micro-steps and AdamW's update replayed from CUDA graphs)
    takes the same steps as tigon, over every step both ran (with NVML the timed steps go on for
    seconds, the replayed ones many more), and the GPU busy reading is a percentage."""
    shape = dict(TINY, hidden_size=256, intermediate_size=688, vocab_size=32000)
    records = run_e2e(modes=["full", "lora"], impls=["tigon", "tigon+graphs"], batch=1, seq=256, steps=3, warmup=3,
                      shape=shape, log=lambda line: None)
    assert not [r["error"] for r in records if "error" in r]
    by = {(r["mode"], r["impl"]): r for r in records}
    for mode in ("full", "lora"):
        plain, graphs = by[(mode, "tigon")]["losses"], by[(mode, "tigon+graphs")]["losses"]
        both = min(len(plain), len(graphs))
        assert both >= 6 and graphs[:both] == pytest.approx(plain[:both], rel=2e-2)
    assert all(0 <= r["gpu_busy_pct"] <= 100 for r in records if "gpu_busy_pct" in r)
