"""The embedding e2e benchmark's pipeline on CPU, at a tiny shape (its numbers mean nothing here)."""

import importlib.util

import torch

from tigon.bench.embed_e2e import PEER_MISSING, run_embed_e2e

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=97, tie_word_embeddings=True)


def test_each_implementation_trains_the_same_embedder():
    records = run_embed_e2e(["full"], ["eager", "tigon", "peer"], batch=3, seq=8, steps=1, warmup=1, shape=TINY,
                            device=torch.device("cpu"), log=lambda line: None)
    eager, tigon, peer = records
    assert "error" not in eager and "error" not in tigon and tigon["applied"].startswith("tigon: applied")
    # One step with the same weights and ids: the same loss (bf16 weights, so within its rounding).
    assert abs(eager["losses"][0] - tigon["losses"][0]) < 0.05 * abs(eager["losses"][0])
    assert eager["tokens_per_s"] > 0 and tigon["vs_eager_speed"] > 0
    if importlib.util.find_spec("sentence_transformers") is None:
        assert peer["error"] == PEER_MISSING
    else:
        assert abs(peer["losses"][0] - eager["losses"][0]) < 0.05 * abs(eager["losses"][0])
