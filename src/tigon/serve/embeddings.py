"""`tigon serve`'s ``/v1/embeddings``: a model `tigon embed` saved (its ``embedding.json`` says how
it pools) embeds texts or token ids as it was trained to: EOS last, last-token or mean pooling,
L2-normalised. Inputs are refused, not truncated, past the served context, as OpenAI refuses them.

Forward passes run one batch at a time in a worker thread; a request's inputs are sorted by length
and cut into batches of at most `MAX_BATCH_TOKENS` padded tokens, so padding stays small and the
memory of one pass bounded whatever the request holds."""

from __future__ import annotations

import base64
from typing import Any

import torch
import torch.nn.functional as F

from tigon.serve.protocol import APIError

MAX_BATCH_TOKENS = 16384


class Embedder:
    """The decoder of an embedding model and how it pools."""

    def __init__(self, decoder: torch.nn.Module, tokenizer: Any, settings: dict[str, Any]):
        self.decoder, self.tokenizer, self.settings = decoder, tokenizer, settings
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.dimensions = decoder.config.hidden_size

    def ids(self, tokens: list[int]) -> list[int]:
        """A text's (or a client's) token ids as the model reads them: EOS last."""
        from tigon.train.embed import with_eos

        return with_eos(tokens, self.tokenizer)

    def embed(self, rows: list[list[int]]) -> torch.Tensor:
        """(len(rows), H) fp32 normalised embeddings on the CPU, in the order of `rows`."""
        from tigon.train.embed import embed_ids

        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        out = torch.empty(len(rows), self.dimensions)
        start = 0
        while start < len(order):
            # Sorted by length: the last row of a batch is its longest.
            stop = start + 1
            while stop < len(order) and (stop + 1 - start) * len(rows[order[stop]]) <= MAX_BATCH_TOKENS:
                stop += 1
            chunk = order[start:stop]
            vectors = embed_ids(self.decoder, [rows[i] for i in chunk], self.settings["pooling"], self.pad_id,
                                batch_size=len(chunk))
            out[chunk] = vectors.cpu()
            start = stop
        return out


def load_embedder_for_serving(path: str, dtype: str = "auto", base: str | None = None) -> Embedder:
    from tigon.train.embed import load_embedder
    from tigon.train.modeling import pick_dtype

    decoder, tokenizer, settings = load_embedder(path, pick_dtype(dtype), base=base)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{path}: tigon serve needs a fast (Rust) tokenizer; {type(tokenizer).__name__} is not one")
    return Embedder(decoder, tokenizer, settings)


def encoded(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """One embedding as OpenAI sends it: a list of floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def check_dimensions(embedder: Embedder, dimensions: int | None) -> None:
    if dimensions is not None and dimensions > embedder.dimensions:
        raise APIError(400, f"dimensions is {dimensions}, more than this model's {embedder.dimensions}",
                       param="dimensions")


def truncated(vectors: torch.Tensor, dimensions: int | None) -> torch.Tensor:
    """The first `dimensions` of each embedding, renormalised (all of them for None)."""
    return vectors if dimensions is None else F.normalize(vectors[:, :dimensions], dim=-1)
