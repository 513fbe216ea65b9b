"""`tigon embed`: the embedded default (recall@1 on held-out pairs rises), the model loaded back as
it was trained, LoRA, the pair layouts, and bad rows refused in one line before training."""

import json
import logging

import pytest
import torch

from tigon.cli import main
from tigon.train.config import SFTError
from tigon.train.embed import PAIR_FORMATS, embed_texts, load_embedder, load_pairs, pair_rows, recall_at_1, run_embed
from tigon.train.embed_config import EmbedConfig, parse_dims, resolve_embed
from tigon.train.data import read_file


def _recall(caplog):
    lines = [r.getMessage() for r in caplog.records if "before training," in r.getMessage()]
    assert lines, "no recall@1 line"
    before, after = (float(part.split()[0]) for part in lines[-1].split(": ")[1].split(", ")[:2])
    return before, after


def test_builtin_default_raises_recall_and_loads_back(tmp_path, caplog):
    # The embedded default's settings; the decoder's kernels off, as Triton's interpreter would take
    # minutes (the LoRA test below runs them, the fused loss runs here).
    with caplog.at_level(logging.INFO, logger="tigon.train"):
        final = run_embed(EmbedConfig(output_dir=str(tmp_path), kernels=False), {"output_dir", "kernels"})
    before, after = _recall(caplog)
    assert after >= before + 0.2, (before, after)
    finish = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model: ")][-1]
    assert "/v1/embeddings" in finish and "tigon chat" not in finish, finish
    settings = json.loads((final / "embedding.json").read_text())
    assert settings["pooling"] == "mean"
    decoder, tokenizer, loaded = load_embedder(str(final))
    assert "LMHead" not in type(decoder).__name__ and loaded == settings
    # The reloaded model ranks the held-out pairs as the trained one did.
    _, held = load_pairs(resolve_embed(EmbedConfig(output_dir=str(tmp_path))))
    rows = pair_rows(tokenizer, held, settings["max_length"])
    assert recall_at_1(decoder, rows, "mean", tokenizer.pad_token_id) == pytest.approx(after)
    vectors = embed_texts(decoder, tokenizer, [held[0].query, held[0].positive], settings)
    assert torch.allclose(vectors.norm(dim=-1), torch.ones(2), atol=1e-5)


def test_lora_last_token_matryoshka_run_saves_an_adapter_that_loads(tmp_path):
    # Short texts, small batches, few held out: the decoder's kernels run interpreted here.
    options = dict(output_dir=str(tmp_path), tuner="lora", pooling="last", max_steps=2, matryoshka_dims="16,32",
                   symmetric=True, lr=1e-3, max_length=16, batch_size=4, eval_split=0.05)
    final = run_embed(EmbedConfig(**options), set(options))
    assert (final / "adapter_config.json").is_file()
    decoder, tokenizer, settings = load_embedder(str(final))
    assert settings["pooling"] == "last"
    assert embed_texts(decoder, tokenizer, ["Where does Anna live?"], settings).shape == (1, 128)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("row, detected, negatives", [
    ({"query": "q", "positive": "p", "negatives": ["n1", "n2"]}, "query/positive/negatives", 2),
    ({"anchor": "q", "positive": "p"}, "anchor/positive", 0),
    ({"anchor": "q", "positive": "p", "negative": "n"}, "anchor/positive/negative", 1),
    ({"query": "q", "positive": "p"}, "query/positive", 0),
])
def test_pair_layouts(tmp_path, row, detected, negatives):
    pairs, name = read_file(str(_write(tmp_path / "d.jsonl", [row, row])), 0, PAIR_FORMATS)
    assert name == detected and len(pairs[1].negatives) == negatives and pairs[1].positive == "p"
    assert pairs[1].where.endswith("line 2")


@pytest.mark.parametrize("second, message", [
    ({"query": "q"}, "line 2: missing positive"),
    ({"query": "q", "positive": "p"}, "line 2: missing negatives"),
    ({"query": "q", "positive": "p", "negatives": []}, "line 2: negatives must be a non-empty list"),
    ({"query": "q", "positive": " ", "negatives": ["n"]}, "line 2: positive is empty"),
])
def test_bad_rows_are_one_line_naming_file_and_row(tmp_path, capsys, second, message):
    data = _write(tmp_path / "d.jsonl", [{"query": "q", "positive": "p", "negatives": ["n"]}, second])
    assert main(["embed", "--dataset", str(data), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(data) in err and message in err, err
    assert not (tmp_path / "out").exists()


def test_a_loss_without_negatives_is_refused(tmp_path, capsys):
    data = _write(tmp_path / "d.jsonl", [{"query": "q", "positive": "p"}] * 3)
    assert main(["embed", "--dataset", str(data), "--batch-size", "1", "--output-dir", str(tmp_path / "o")]) == 2
    assert "--batch-size 1" in capsys.readouterr().err


def test_settings_are_checked():
    with pytest.raises(SFTError, match="--temperature"):
        resolve_embed(EmbedConfig(temperature=0.0))
    with pytest.raises(SFTError, match="--matryoshka-dims"):
        parse_dims("64,x")
    assert parse_dims("128, 64") == (64, 128)
    assert resolve_embed(EmbedConfig(model="some/model")).pooling == "last"


def test_matryoshka_dims_must_be_below_the_width(tmp_path, capsys):
    assert main(["embed", "--matryoshka-dims", "64,128", "--output-dir", str(tmp_path / "o")]) == 2
    assert "below the embedding's 128" in capsys.readouterr().err


def test_offload_moves_the_decoders_checkpoints_and_changes_nothing(monkeypatch):
    """--offload-activations reaches the embedder: the layer inputs gradient checkpointing keeps go to
    host memory and come back bit for bit (the causal LM's wrapped forward is never called here)."""
    from tests.helpers import record_offload_sessions
    from tests.patch.tiny import batch, tiny_model
    from tigon.train.embed import decoder_of, embed_batch

    opened = record_offload_sessions(monkeypatch)
    model = tiny_model("llama").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    decoder = decoder_of(model)
    ids, mask, _ = batch(seed=4, rows=3, cols=9)
    inputs = {"input_ids": ids, "attention_mask": mask, "lengths": mask.sum(1)}

    def run(flag):
        model.zero_grad()
        out = embed_batch(decoder, inputs, "last", offload=flag)
        (out * torch.arange(out.shape[1])).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = run(False)
    assert not opened
    got = run(True)
    (session,) = opened
    assert session.offloaded >= model.config.num_hidden_layers and session.held == 0
    assert torch.equal(got[0], want[0]) and got[1].keys() == want[1].keys()
    assert all(torch.equal(got[1][n], want[1][n]) for n in want[1])


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_checkpointed_rows_go_through_in_chunks(monkeypatch, pooling):
    """Under gradient checkpointing the decoder embeds the rows a chunk at a time (its backward then
    recomputes one chunk's layer at a time): the same embeddings and gradients as one call."""
    from tests.patch.tiny import batch, tiny_model
    from tigon.train import embed

    model = tiny_model("llama").train()
    decoder = embed.decoder_of(model)
    ids, mask, _ = batch(seed=5, rows=5, cols=9)
    inputs = {"input_ids": ids, "attention_mask": mask, "lengths": mask.sum(1)}
    calls = []
    decoder.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape[0]),
                                      with_kwargs=True)

    def run():
        model.zero_grad()
        out = embed.embed_batch(decoder, inputs, pooling)
        (out * torch.arange(out.shape[1])).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = run()
    assert calls == [5]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    monkeypatch.setattr(embed, "CHECKPOINTED_CHUNK_TOKENS", 2 * 9)
    calls.clear()
    got = run()
    assert calls == [2, 2, 1]
    torch.testing.assert_close(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-4, atol=1e-4)  # sums in other orders
