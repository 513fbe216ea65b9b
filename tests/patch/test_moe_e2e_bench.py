"""The MoE end-to-end benchmark's pipeline on a tiny Qwen3-MoE on CPU (its numbers mean nothing here)."""

from __future__ import annotations

import json

import torch

import tigon
from tigon.bench.moe_e2e import IMPLS, run_moe_e2e

TINY = dict(
    hidden_size=64, intermediate_size=88, moe_intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, vocab_size=1000,
    tie_word_embeddings=False, output_router_logits=True, router_aux_loss_coef=0.01,
)


def test_moe_e2e_runs_every_case_with_matching_losses(tmp_path):
    records = run_moe_e2e(
        batch=1, seq=8, steps=1, warmup=0, layers=1, shape=TINY, dtype=torch.float32,
        device=torch.device("cpu"), out_dir=tmp_path, log=lambda line: None,
    )
    assert [(r["mode"], r["impl"]) for r in records] == [(m, i) for m in ("full", "lora") for i in IMPLS]
    assert not [r["error"] for r in records if "error" in r]
    for record in records:
        assert record["tokens_per_s"] > 0 and len(record["losses"]) == 1
        assert record["max_loss_diff"] < 1e-4, "fp32 runs of the same model and data"
    assert json.loads((tmp_path / "moe_e2e.json").read_text())["results"][-1]["impl"] == "tigon"
    tigon.unpatch()
