import random

import pytest
import torch

from tigon.train.batching import NUM_TOKENS, Collator, pack
from tigon.train.template import IGNORE

PAD = 0


def examples(rng, n, max_length, vocab=1000):
    out = []
    for _ in range(n):
        length = rng.randint(1, max_length)
        ids = [rng.randrange(1, vocab) for _ in range(length)]
        labels = [IGNORE] + [t if rng.random() < 0.6 else IGNORE for t in ids[1:]]
        out.append({"input_ids": ids, "labels": labels})
    return out


def segments(row):
    """Split a packed row where its position ids restart."""
    starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["position_ids"])]
    return [{k: row[k][a:b] for k in ("input_ids", "labels", "position_ids")} for a, b in zip(starts, starts[1:])]


def test_pack_keeps_every_sample_whole_with_positions_from_zero():
    rng = random.Random()
    max_length = rng.randint(20, 40)
    exs = examples(rng, 57, max_length)
    rows = pack(exs, max_length, seed=rng.randrange(100))
    assert all(len(r["input_ids"]) <= max_length for r in rows)
    assert len(rows) < len(exs)  # something was packed
    found = []
    for row in rows:
        assert len(row["input_ids"]) == len(row["labels"]) == len(row["position_ids"])
        for seg in segments(row):
            assert seg["position_ids"] == list(range(len(seg["input_ids"])))
            assert seg["labels"][0] == IGNORE  # never predicted from the previous sample
            found.append((seg["input_ids"], seg["labels"]))
    assert sorted(found) == sorted((e["input_ids"], e["labels"]) for e in exs)


def test_collator_pads_unpacked_rows_with_a_mask():
    rng = random.Random()
    rows = examples(rng, 5, 17) + examples(rng, 1, 1)  # at least one row shorter than the longest
    rng.shuffle(rows)
    batch = Collator(PAD)(rows)
    width = max(len(r["input_ids"]) for r in rows)
    assert set(batch) == {"input_ids", "labels", "attention_mask", NUM_TOKENS}
    assert batch[NUM_TOKENS] == sum(len(r["input_ids"]) for r in rows)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        assert batch["input_ids"][i].tolist() == r["input_ids"] + [PAD] * (width - n)
        assert batch["labels"][i].tolist() == r["labels"] + [IGNORE] * (width - n)
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (width - n)


def test_collator_leaves_out_an_all_ones_mask():
    """Rows of one length need no mask: the model runs plain causal attention, as it would with
    an all-ones mask, without checking that mask on the device."""
    rng = random.Random()
    length = rng.randint(1, 20)
    rows = [{"input_ids": [rng.randrange(1, 1000) for _ in range(length)], "labels": [IGNORE] * length}
            for _ in range(rng.randint(1, 5))]
    batch = Collator(PAD)(rows)
    assert set(batch) == {"input_ids", "labels", NUM_TOKENS}
    assert batch[NUM_TOKENS] == batch["input_ids"].numel()
    assert batch["input_ids"].tolist() == [r["input_ids"] for r in rows]


def test_collator_pads_packed_rows_as_one_more_sample():
    rng = random.Random()
    rows = pack(examples(rng, 9, 12), 30, seed=0)
    batch = Collator(PAD)(rows)
    width = max(len(r["input_ids"]) for r in rows)
    assert set(batch) == {"input_ids", "labels", "position_ids", NUM_TOKENS}
    assert batch[NUM_TOKENS] == sum(len(r["input_ids"]) for r in rows)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        assert batch["position_ids"][i].tolist() == r["position_ids"] + list(range(width - n))
        assert batch["labels"][i, n:].eq(IGNORE).all()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rows_match_samples_run_alone(attn):
    """No cross-contamination: every token's logits in a packed, padded batch equal the logits of
    its sample run on its own. Without a KV cache, as in training (HF builds the block mask from
    the position ids only then)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(random.randrange(2**31))
    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn)
    model = LlamaForCausalLM(config).eval()
    rng = random.Random()
    rows = pack(examples(rng, 11, 13, vocab=97), 29, seed=1)
    batch = Collator(PAD)(rows)
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.items() if k not in ("labels", NUM_TOKENS)}, use_cache=False).logits
        for i, row in enumerate(rows):
            start = 0
            for seg in segments(row):
                alone = model(input_ids=torch.tensor([seg["input_ids"]])).logits[0]
                n = len(seg["input_ids"])
                torch.testing.assert_close(packed[i, start:start + n], alone, rtol=1e-4, atol=1e-5)
                start += n


@pytest.mark.parametrize("packed", [False, True])
def test_collator_with_a_width_gives_every_batch_one_shape(packed):
    """--cuda-graphs: batches of one shape and the same tensors, whatever their rows' lengths;
    unpacked rows without a mask (their padding is on the right, after every real token)."""
    rng = random.Random()
    rows = examples(rng, 4, 9)
    if packed:
        rows = pack(rows, 20, seed=0)
    collate = Collator(PAD, width=23)
    full = [{**r, "input_ids": r["input_ids"] + [5] * (23 - len(r["input_ids"])),
             "labels": r["labels"] + [IGNORE] * (23 - len(r["labels"]))} for r in rows]
    if packed:
        for f, r in zip(full, rows):
            f["position_ids"] = r["position_ids"] + list(range(23 - len(r["position_ids"])))
    for batch_rows in (rows, full):  # padded rows, and rows filling the width (no padding at all)
        batch = collate(batch_rows)
        assert set(batch) == {"input_ids", "labels", NUM_TOKENS, *(["position_ids"] if packed else [])}
        assert all(v.shape == (len(rows), 23) for k, v in batch.items() if k != NUM_TOKENS)
        assert batch[NUM_TOKENS] == sum(len(r["input_ids"]) for r in batch_rows)
    with pytest.raises(ValueError, match="does not fit the collator's width 8"):
        Collator(PAD, width=8)(full)
