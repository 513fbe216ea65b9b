"""`tigon embed`: fine-tune a decoder into a text-embedding model with an in-batch-negatives
InfoNCE loss (tigon's fused :func:`tigon.functional.info_nce`), hard negatives when the rows have
them, and Matryoshka dimensions if asked.

A text's embedding is the decoder's last hidden state at its last token (Qwen3-Embedding: the
tokenizer's EOS is appended to every text), or the mean over its tokens (``--pooling mean``),
L2-normalised. The decoder is the causal LM's base model (``get_decoder()``), tigon's kernels
patched in as for `tigon sft`; the LM head is never run. The run shares `tigon sft`'s stages
(`tigon.train.run`): the model is saved as a causal LM (or a LoRA adapter on one), and
``embedding.json`` beside it records the pooling, which `load_embedder` and `tigon serve`
(``/v1/embeddings``) read back.

Retrieval accuracy (recall@1: the share of held-out queries whose nearest document, among the
held-out positives, is their own) is logged before and after training.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from tigon.train.config import SFTError
from tigon.train.embed_config import POOLINGS, EmbedConfig, parse_dims, resolve_embed

log = logging.getLogger("tigon.train")

EMBED_FILE = "embedding.json"  # beside a saved embedding model: how it pools
BUNDLED_PAIRS = Path(__file__).parent / "data" / "pairs.jsonl"
_RECALL_BATCH = 64


# --- data -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pair:
    """One training row: a query, its positive document and hard negatives (maybe none)."""

    where: str
    query: str = ""
    positive: str = ""
    negatives: tuple[str, ...] = ()


def _pair(query_key: str, negatives_key: str | None):
    from tigon.train.data import RowError, _json_cell, _text

    def convert(row: dict) -> Pair:
        negatives: tuple[str, ...] = ()
        if negatives_key is not None:
            value = row[negatives_key]
            if isinstance(value, str):  # one negative, or (a CSV cell) a JSON list of them
                value = _json_cell(value, negatives_key) if value.lstrip().startswith("[") else [value]
            if not isinstance(value, list) or not value:
                raise RowError(f"{negatives_key} must be a non-empty list of texts (this file's rows have hard "
                               f"negatives: every row needs one at least), got {row[negatives_key]!r}")
            negatives = tuple(_text(v, f"{negatives_key}[{i}]") for i, v in enumerate(value))
        return Pair("", _text(row[query_key], query_key), _text(row["positive"], "positive"), negatives)

    return convert


# Detected from a file's first row: a file whose first row has hard negatives needs them on every row.
PAIR_FORMATS = [
    ("query/positive/negatives", ("query", "positive", "negatives"), _pair("query", "negatives")),
    ("anchor/positive/negative", ("anchor", "positive", "negative"), _pair("anchor", "negative")),
    ("anchor/positive/negatives", ("anchor", "positive", "negatives"), _pair("anchor", "negatives")),
    ("query/positive", ("query", "positive"), _pair("query", None)),
    ("anchor/positive", ("anchor", "positive"), _pair("anchor", None)),
]


def load_pairs(cfg: EmbedConfig) -> tuple[list[Pair], list[Pair]]:
    """The training pairs and the evaluation pairs (--eval-dataset or --eval-split)."""
    from tigon.train.data import load_samples
    from tigon.train.run import split_off

    pairs = load_samples(cfg.dataset or [str(BUNDLED_PAIRS)], cfg.seed, PAIR_FORMATS)
    if cfg.eval_dataset:
        held = load_samples(cfg.eval_dataset, cfg.seed, PAIR_FORMATS)
    elif cfg.eval_split:
        pairs, held = split_off(pairs, cfg.eval_split, cfg.seed)
    else:
        held = []
    if cfg.batch_size < 2 and not any(p.negatives for p in pairs):
        raise SFTError(f"--batch-size 1: with no hard negatives in the data ({pairs[0].where.rsplit(' line', 1)[0]}) "
                       "a query's only negatives are the other positives of its batch; use --batch-size 2 or more")
    return pairs, held


def encode_text(tokenizer: Any, text: str, max_length: int) -> list[int]:
    """`text`'s token ids as the embedder reads them: truncated, the EOS last (appended if the
    tokenizer did not end with it)."""
    ids = tokenizer(text, add_special_tokens=True, truncation=True, max_length=max_length - 1)["input_ids"]
    return with_eos(ids, tokenizer)


def with_eos(ids: list[int], tokenizer: Any) -> list[int]:
    """`ids` ending in the tokenizer's EOS (appended unless it is last already)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise SFTError("the tokenizer has no EOS token, which an embedding model appends to every text")
    return ids if ids and ids[-1] == eos else ids + [eos]


def pair_rows(tokenizer: Any, pairs: Sequence[Pair], max_length: int) -> list[dict[str, Any]]:
    return [{"query": encode_text(tokenizer, p.query, max_length), "positive": encode_text(tokenizer, p.positive, max_length),
             "negatives": [encode_text(tokenizer, n, max_length) for n in p.negatives]} for p in pairs]


def pad(rows: Sequence[list[int]], pad_id: int) -> dict[str, torch.Tensor | None]:
    """Right-padded ids, their lengths, and an attention mask when any row is padded."""
    lengths = [len(r) for r in rows]
    width = max(lengths)
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long() if min(lengths) < width else None
    return {"input_ids": ids, "attention_mask": mask, "lengths": torch.tensor(lengths, dtype=torch.long)}


class PairCollator:
    """A batch of pairs: the queries, and the documents (every positive, in query order, then every
    hard negative of the batch), each padded to its longest text."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        from tigon.train.batching import NUM_TOKENS

        queries = [f["query"] for f in features]
        documents = [f["positive"] for f in features] + [n for f in features for n in f["negatives"]]
        return {"query": pad(queries, self.pad_id), "documents": pad(documents, self.pad_id),
                NUM_TOKENS: sum(map(len, queries)) + sum(map(len, documents))}


# --- the model --------------------------------------------------------------------------------

def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The base model (no LM head) of a causal LM, through a PEFT wrapper if any; a model without
    a head is its own."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if get is not None else None
    return decoder if decoder is not None else model


def pool(hidden: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor | None, pooling: str) -> torch.Tensor:
    """(R, H) embeddings, fp32, not normalised, of right-padded (R, L, H) hidden states."""
    if pooling == "last":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1].float()
    # Summed in fp32 as it is read: no fp32 copy of the (R, L, H) states (256 MiB a side at 64 x 512 x 2048).
    if mask is None:
        return hidden.sum(1, dtype=torch.float32) / hidden.shape[1]
    return (hidden * mask[..., None].to(hidden.dtype)).sum(1, dtype=torch.float32) / lengths[:, None]


# A checkpointed forward recomputes one layer of its whole input at a time in backward: the 1B
# Llama shape's layer keeps ~75 KB a token, so 64 texts x 512 tokens recompute 2.4 GiB at once.
# Under checkpointing the rows go through the decoder in chunks of this many tokens instead (~0.6
# GiB): the same layer inputs are kept (or offloaded), the GEMMs stay thick.
CHECKPOINTED_CHUNK_TOKENS = 8192


def embed_batch(decoder: torch.nn.Module, batch: dict[str, torch.Tensor | None], pooling: str,
                offload: bool = False) -> torch.Tensor:
    """The (R, H) fp32 embeddings (not normalised) of one padded batch (`pad`'s dict, on the model's
    device); under gradient checkpointing the rows in chunks of ``CHECKPOINTED_CHUNK_TOKENS``.
    `offload`: the layer inputs gradient checkpointing keeps wait in host memory
    (``--offload-activations``; tigon.patch's switch wraps the causal LM's forward, which an
    embedder never calls)."""
    from tigon.patch.offload import checkpointed, offload_scope

    ids, mask, lengths = batch["input_ids"], batch["attention_mask"], batch["lengths"]
    rows = max(1, CHECKPOINTED_CHUNK_TOKENS // ids.shape[1]) if checkpointed(decoder) else ids.shape[0]
    parts = []
    for start in range(0, ids.shape[0], rows):
        part = slice(start, start + rows)
        part_mask = None if mask is None else mask[part]
        with offload_scope(decoder, ids[part].numel()) if offload else contextlib.nullcontext():
            out = decoder(input_ids=ids[part], attention_mask=part_mask, use_cache=False)
        parts.append(pool(out.last_hidden_state, lengths[part], part_mask, pooling))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def contrastive_loss(q: torch.Tensor, d: torch.Tensor, temperature: float, symmetric: bool = False,
                     dims: Sequence[int] = ()) -> torch.Tensor:
    """Mean InfoNCE of queries `q` (B, H) against documents `d` (N, H) (row i's positive is d[i]) on
    cosine similarity, summed over the full embedding and each Matryoshka dim (renormalised)."""
    from tigon.functional import info_nce

    total = None
    for width in (*[k for k in dims if k < q.shape[1]], q.shape[1]):
        loss = info_nce(F.normalize(q[:, :width], dim=-1), F.normalize(d[:, :width], dim=-1),
                        temperature=temperature, symmetric=symmetric).mean()
        total = loss if total is None else total + loss
    return total


def recall_at_1(model: torch.nn.Module, rows: list[dict[str, Any]], pooling: str, pad_id: int) -> float:
    """The share of `rows`' queries whose most similar positive (of all rows') is their own."""
    decoder = decoder_of(model)
    was_training = model.training
    model.eval()
    try:
        q = embed_ids(decoder, [r["query"] for r in rows], pooling, pad_id)
        d = embed_ids(decoder, [r["positive"] for r in rows], pooling, pad_id)
    finally:
        model.train(was_training)
    hits = (q @ d.T).argmax(-1) == torch.arange(len(rows), device=q.device)
    return hits.float().mean().item()


def _trainer_class():
    from tigon.train.batching import NUM_TOKENS
    from tigon.train.trainer import TigonTrainer

    class EmbedTrainer(TigonTrainer):
        """The Trainer of `tigon embed`: its loss is the InfoNCE of the batch's embeddings."""

        def __init__(self, *args, pooling: str, temperature: float, symmetric: bool, dims: tuple[int, ...],
                     offload: bool = False, **kwargs):
            super().__init__(*args, **kwargs)
            self.pooling, self.temperature, self.symmetric, self.dims = pooling, temperature, symmetric, dims
            self.offload = offload
            self.model_accepts_loss_kwargs = False  # the loss is a batch mean: accumulation divides it

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            decoder = decoder_of(model)
            q = embed_batch(decoder, inputs["query"], self.pooling, self.offload)
            d = embed_batch(decoder, inputs["documents"], self.pooling, self.offload)
            loss = contrastive_loss(q, d, self.temperature, self.symmetric, self.dims)
            return (loss, None) if return_outputs else loss

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            inputs = self._prepare_inputs(inputs)
            inputs.pop(NUM_TOKENS, None)
            with torch.no_grad():
                return self.compute_loss(model, inputs).detach(), None, None

    return EmbedTrainer


# --- the run ----------------------------------------------------------------------------------

def run_embed(cfg: EmbedConfig, given: set[str] = frozenset()) -> Path:
    """Fine-tune an embedding model as `cfg` says; returns the directory of the final model (or
    adapter), with ``embedding.json`` beside it."""
    from tigon.train.run import guarded

    return guarded(cfg, lambda: _run(resolve_embed(cfg, given)))


def _run(cfg: EmbedConfig) -> Path:
    from tigon.train import tiny
    from tigon.train.data import Sample
    from tigon.train.modeling import load_tokenizer
    from tigon.train.run import Job, start, train, training_arguments

    dims = parse_dims(cfg.matryoshka_dims)
    resume_from = start(cfg)
    pairs, held = load_pairs(cfg)
    if cfg.model is not None:
        tokenizer = load_tokenizer(cfg.model)
    else:
        texts = [t for p in pairs + held for t in (p.query, p.positive, *p.negatives)]
        tokenizer = tiny.build_tokenizer([Sample("", text=t) for t in texts])
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out and never pooled
    rows = pair_rows(tokenizer, pairs, cfg.max_length)
    eval_rows = pair_rows(tokenizer, held, cfg.max_length) if held else []
    tokens = sum(len(r["query"]) + len(r["positive"]) + sum(map(len, r["negatives"])) for r in rows)
    sequences = sum(2 + len(r["negatives"]) for r in rows)
    log.info("tokens: %d pairs, %d hard negatives, %d tokens, max length %d; %s pooling, temperature %g%s",
             len(rows), sequences - 2 * len(rows), tokens, cfg.max_length, cfg.pooling, cfg.temperature,
             f", Matryoshka dims {','.join(map(str, dims))}" if dims else "")
    state: dict[str, Any] = {}

    def trainer(built, args):
        hidden = built.model.config.hidden_size
        if dims and max(dims) >= hidden:
            raise SFTError(f"--matryoshka-dims {cfg.matryoshka_dims}: each must be below the embedding's "
                           f"{hidden} dimensions (the full one is always trained)")
        built.model_files[EMBED_FILE] = json.dumps({"pooling": cfg.pooling, "normalize": True,
                                                    "append_eos": True, "max_length": cfg.max_length}) + "\n"
        if eval_rows:
            state["before"] = recall_at_1(built.model, eval_rows, cfg.pooling, tokenizer.pad_token_id)
            log.info("recall@1 on %d held-out pairs before training: %.3f", len(eval_rows), state["before"])
        state["trainer"] = _trainer_class()(
            model=built.model, args=args, train_dataset=rows, eval_dataset=eval_rows or None,
            data_collator=PairCollator(tokenizer.pad_token_id), processing_class=tokenizer,
            save_limit=cfg.save_limit, pooling=cfg.pooling, temperature=cfg.temperature, symmetric=cfg.symmetric,
            dims=dims, offload=cfg.offload_activations)
        return state["trainer"]

    job = Job("embed", rows, tokens, sequences,
              arguments=lambda dtype: training_arguments(cfg, dtype, bool(eval_rows)), trainer=trainer,
              prompts=lambda: [], try_with="tigon serve {}: /v1/embeddings")
    final = train(cfg, resume_from, tokenizer, job)
    if eval_rows and "trainer" in state:
        model = state["trainer"].model
        after = recall_at_1(model, eval_rows, cfg.pooling, tokenizer.pad_token_id)
        log.info("recall@1 on %d held-out pairs: %.3f before training, %.3f after", len(eval_rows),
                 state["before"], after)
        state["recall"] = (state["before"], after)
    log.info("embedding model: %s (tigon serve %s answers /v1/embeddings)", final, final)
    return final


# --- loading back -----------------------------------------------------------------------------

def embedding_settings(path: str | Path) -> dict[str, Any] | None:
    """What ``embedding.json`` in `path` says (None when it has none: not an embedding model)."""
    file = Path(path) / EMBED_FILE
    if not file.is_file():
        return None
    try:
        settings = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise SFTError(f"{file}: unreadable ({err})") from None
    if not isinstance(settings, dict) or settings.get("pooling") not in POOLINGS:
        raise SFTError(f"{file}: expected {{\"pooling\": one of {', '.join(POOLINGS)}, ...}}")
    return settings


def load_embedder(path: str, dtype: torch.dtype = torch.float32, base: str | None = None) -> tuple[Any, Any, dict]:
    """(decoder in eval mode, tokenizer, settings) of a `tigon embed` output (a model or a LoRA
    adapter, merged into its base)."""
    from tigon.train.infer import load_for_inference

    settings = embedding_settings(path)
    if settings is None:
        raise SFTError(f"{path}: no {EMBED_FILE}: not a model `tigon embed` saved")
    model, tokenizer = load_for_inference(path, dtype, base=base)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    return decoder_of(model).eval(), tokenizer, settings


@torch.no_grad()
def embed_texts(decoder: torch.nn.Module, tokenizer: Any, texts: Sequence[str], settings: dict[str, Any],
                batch_size: int = _RECALL_BATCH) -> torch.Tensor:
    """(len(texts), H) fp32 L2-normalised embeddings, as the model was trained to make them."""
    rows = [encode_text(tokenizer, t, int(settings.get("max_length", 512))) for t in texts]
    return embed_ids(decoder, rows, settings["pooling"], tokenizer.pad_token_id
                     if tokenizer.pad_token_id is not None else tokenizer.eos_token_id, batch_size)


@torch.no_grad()
def embed_ids(decoder: torch.nn.Module, rows: Sequence[list[int]], pooling: str, pad_id: int,
              batch_size: int = _RECALL_BATCH) -> torch.Tensor:
    """(len(rows), H) fp32 L2-normalised embeddings of token-id rows (EOS already last)."""
    device = next(decoder.parameters()).device
    parts = []
    for start in range(0, len(rows), batch_size):
        batch = {k: (v.to(device) if v is not None else None) for k, v in pad(rows[start:start + batch_size], pad_id).items()}
        parts.append(F.normalize(embed_batch(decoder, batch, pooling), dim=-1))
    return torch.cat(parts)
