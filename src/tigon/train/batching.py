"""Rows and batches: optional packing of several samples per row, and the collator that pads a
batch. Packed rows carry ``position_ids`` that restart at 0 for each sample and no attention
mask; from those, Hugging Face models build a block-diagonal causal mask (sdpa/eager) or
per-sample sequence lengths (flash attention), so no token attends across samples. They do so
only when no KV cache is in use, which is why training runs with ``config.use_cache = False``."""

from __future__ import annotations

import random
from typing import Any

import torch

from tigon.train.template import IGNORE


class TokenDataset(torch.utils.data.Dataset):
    """A list of already-tokenized rows (dicts of int lists)."""

    def __init__(self, rows: list[dict[str, list[int]]]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.rows[i]

    def num_tokens(self) -> int:
        return sum(len(r["input_ids"]) for r in self.rows)


def pack(examples: list[dict[str, Any]], max_length: int, seed: int, keep: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Concatenate samples (in a seeded random order) into rows of at most `max_length` tokens,
    with ``position_ids`` restarting at 0 at each sample. Every sample is already truncated to
    `max_length`, so each fits in a row; a sample never straddles two rows. With `keep`, each row
    also lists its samples' values of those keys (and their lengths) under ``samples``, in order."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)

    def empty() -> dict[str, Any]:
        return {"input_ids": [], "labels": [], "position_ids": [], **({"samples": []} if keep else {})}

    rows: list[dict[str, Any]] = []
    row = empty()
    for i in order:
        ex = examples[i]
        n = len(ex["input_ids"])
        if row["input_ids"] and len(row["input_ids"]) + n > max_length:
            rows.append(row)
            row = empty()
        row["input_ids"] += ex["input_ids"]
        row["labels"] += ex["labels"]
        row["position_ids"] += list(range(n))
        if keep:
            row["samples"].append({**{k: ex[k] for k in keep}, "length": n})
    if row["input_ids"]:
        rows.append(row)
    return rows


NUM_TOKENS = "num_tokens"


class Collator:
    """Right-pads a batch to its longest row (or to `width`, for batches of one shape). Unpacked
    rows get an attention mask when any of them is padded (without one the model runs plain causal
    attention and skips checking an all-ones mask on the device, which waits for the GPU); packed
    rows get their padding as one more "sample" (positions from 0, no labels), which their block
    mask already keeps apart, so they need none. ``batch[NUM_TOKENS]`` is the batch's count of real
    (unpadded) tokens as a Python int, for counting tokens without reading the device
    (`tigon.train.trainer` takes it out before the model sees the batch). With `width`
    (``--cuda-graphs``) unpacked rows get no mask at all: a captured step cannot look at a mask's
    values, so it would build and apply the full causal mask, a masked attention several times
    slower than a causal one; padding on the right is after every real token, which causal
    attention never lets a real token see, and its labels are ignored, so the loss and gradients
    are those of the masked batch.

    With `shards` > 1 (``--sequence-parallel``) the width is rounded up to a multiple of it (the
    sequence is cut into that many equal shards) and every row gets ``position_ids``, which the
    shards need to know where they sit, and no attention mask (the all-to-all drops masks): an
    unpacked row's padding follows its tokens as above, so plain causal attention is exact."""

    def __init__(self, pad_token_id: int, width: int | None = None, shards: int = 1):
        self.pad_token_id = pad_token_id
        self.width = width
        self.shards = shards

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        lengths = [len(f["input_ids"]) for f in features]
        width = self.width or max(lengths)
        if width < max(lengths):
            raise ValueError(f"a row of {max(lengths)} tokens does not fit the collator's width {width}")
        width = -(-width // self.shards) * self.shards
        packed = "position_ids" in features[0]
        batch: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
        if packed or self.shards > 1:
            batch["position_ids"] = []
        elif min(lengths) < width and not self.width:
            batch["attention_mask"] = []
        for f, n in zip(features, lengths):
            pad = width - n
            batch["input_ids"].append(f["input_ids"] + [self.pad_token_id] * pad)
            batch["labels"].append(f["labels"] + [IGNORE] * pad)
            if packed:
                batch["position_ids"].append(f["position_ids"] + list(range(pad)))
            elif "position_ids" in batch:
                batch["position_ids"].append(list(range(width)))
            elif "attention_mask" in batch:
                batch["attention_mask"].append([1] * n + [0] * pad)
        return {**{k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}, NUM_TOKENS: sum(lengths)}
