"""`tigon embed`'s settings (apart from :mod:`tigon.train.embed`, which imports torch: the command
line reads them for every `tigon` command)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from tigon.train.config import SFTConfig, SFTError, _opt, resolve

POOLINGS = ("last", "mean")
# The built-in model learns from scratch: mean pooling reads every token, where the last token's
# state has yet to learn to gather the text (recall@1 0.15 against 0.48 in the same CPU minute).
_BUILTIN = {"epochs": 12.0, "lr": 2e-3, "batch_size": 16, "max_length": 64, "eval_split": 0.2, "pooling": "mean"}


@dataclass
class EmbedConfig(SFTConfig):
    """Every `tigon embed` setting: sft's (less those of generating and packing) with the embedding
    model's. ``None`` means "the default for this run"."""

    LEFT_OUT: ClassVar[tuple[str, ...]] = ("packing", "samples", "max_new_tokens", "cuda_graphs", "neftune_alpha",
                                         "sequence_parallel")

    dataset: list[str] | None = _opt(
        None, "pair files (.jsonl .json .csv .parquet): query/positive (or anchor/positive, as sentence-transformers) "
        "with optional hard negatives (negatives: a list, or negative: one); PATH#N takes N random rows "
        "(default: bundled synthetic pairs)", nargs="+", metavar="PATH")
    eval_split: float | None = _opt(None, "hold out this fraction of the pairs for evaluation and recall@1 "
                                    "(default 0; 0.2 for the built-in model)")
    max_length: int | None = _opt(None, "truncate each text to this many tokens, EOS included (default 512; 64 for "
                                  "the built-in model)")
    epochs: float | None = _opt(None, "passes over the data (default 1; 12 for the built-in model)")
    lr: float | None = _opt(None, "peak learning rate (default: 2e-4 LoRA, 2e-5 full, 2e-3 built-in)")
    batch_size: int | None = _opt(None, "pairs per device per step: each query's negatives are the other "
                                  "positives of the batch and every hard negative in it (default 4; 16 built-in)")
    output_dir: str = _opt("tigon-embed-out", "where checkpoints, metrics.jsonl and loss.png go", metavar="DIR")
    pooling: str | None = _opt(None, "a text's embedding: the last token's hidden state (an EOS is appended; "
                               "Qwen3-Embedding's) or the mean over its tokens (default last; mean for the "
                               "built-in model)", choices=list(POOLINGS))
    temperature: float = _opt(0.05, "the InfoNCE temperature: cosine similarities are divided by it "
                              "(sentence-transformers' scale 20 is 0.05)")
    symmetric: bool = _opt(False, "also train document -> query (the loss averaged over both directions)")
    matryoshka_dims: str | None = _opt(None, "Matryoshka: also train each of these leading dimensions of the "
                                       "embedding as an embedding, the loss summed over them and the full one, "
                                       "e.g. 64,128,256 (default: off)", metavar="DIMS")


def parse_dims(text: str | None) -> tuple[int, ...]:
    """``--matryoshka-dims`` as ascending distinct ints (empty for None), or an SFTError."""
    if text is None:
        return ()
    try:
        dims = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise SFTError(f"--matryoshka-dims takes comma-separated integers such as 64,128,256, got {text!r}") from None
    if not dims or min(dims) < 1 or len(set(dims)) != len(dims):
        raise SFTError(f"--matryoshka-dims takes distinct positive integers such as 64,128,256, got {text!r}")
    return tuple(sorted(dims))


def resolve_embed(cfg: EmbedConfig, given: set[str] = frozenset()) -> EmbedConfig:
    """`resolve` for `tigon embed`: the built-in model's defaults, sft's checks, then the loss's."""
    builtin = cfg.model is None
    own = _BUILTIN if builtin else {}
    eval_split = cfg.eval_split
    if eval_split is None:
        eval_split = own["eval_split"] if builtin and not cfg.eval_dataset else 0.0
    cfg = dataclasses.replace(
        cfg, eval_split=eval_split,
        max_length=cfg.max_length if cfg.max_length is not None else own.get("max_length", 512),
        epochs=cfg.epochs if cfg.epochs is not None else own.get("epochs"),
        lr=cfg.lr if cfg.lr is not None else own.get("lr"),
        batch_size=cfg.batch_size if cfg.batch_size is not None else own.get("batch_size"),
        pooling=cfg.pooling if cfg.pooling is not None else own.get("pooling", "last"),
    )
    cfg = resolve(cfg, given)
    if cfg.max_length < 2:
        raise SFTError(f"--max-length must be >= 2 (a token and the EOS), got {cfg.max_length}")
    if not cfg.temperature > 0:
        raise SFTError(f"--temperature must be > 0, got {cfg.temperature}")
    if cfg.pooling not in POOLINGS:
        raise SFTError(f"--pooling must be one of {', '.join(POOLINGS)}, got {cfg.pooling!r}")
    parse_dims(cfg.matryoshka_dims)
    return cfg
