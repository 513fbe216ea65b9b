"""End-to-end embedding fine-tuning benchmark: tigon vs PyTorch eager, torch.compile and
sentence-transformers' ``MultipleNegativesRankingLoss``, same model, data and run.

The model is :mod:`tigon.bench.e2e`'s 1B Llama shape with random weights in bf16 (SDPA attention),
used as an embedder: the decoder (no LM head) embeds each text by its last token's hidden state,
and the loss is InfoNCE with in-batch negatives (temperature 0.05, sentence-transformers' scale
20) on cosine similarity. A step embeds `batch` queries and `batch` positive documents of `seq`
random tokens each, as two forward passes, and trains by AdamW at :mod:`tigon.bench.e2e`'s step
cadence; tokens/s counts both sides. Gradient checkpointing is on by default: without it a
1B model's activations for 64 x 512 tokens a side do not fit one GPU (``--no-checkpointing``).

* ``eager``: transformers' model, the loss by PyTorch (the whole similarity matrix, log-softmax);
* ``compile``: the same under ``torch.compile``;
* ``tigon``: the model after ``tigon.patch``, each side embedded by :func:`tigon.train.embed.embed_batch`
  as `tigon embed --gradient-checkpointing --offload-activations` does: the rows through the
  decoder in chunks of 8192 tokens, so that backward recomputes one chunk's layer at a time (0.6
  GiB, not 2.4), and the layer inputs that checkpointing keeps (4 GiB of the 1B shape's 64 x 512 a
  side) waiting in host memory (``--no-offload`` keeps them on the GPU); the loss
  :func:`tigon.functional.info_nce` on the fp32 embeddings;
* ``peer``: sentence-transformers (``models.Transformer`` + last-token ``models.Pooling``,
  ``losses.MultipleNegativesRankingLoss``) over the same weights, when the package is installed
  (a missing package is said in its row, not an error).

``full`` trains every weight, ``lora`` PEFT LoRA r=16 on every linear of the decoder.

    python -m tigon.bench.embed_e2e --out bench-out/embed-e2e
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

import tigon
from tigon.bench.e2e import LLAMA_1B, LORA_TARGETS, measure_training, release_memory, run_all

MODES = ("full", "lora")
IMPLS = ("eager", "compile", "tigon", "peer")
SCALE = 20.0  # sentence-transformers' default: temperature 0.05
PEER_MISSING = "sentence-transformers is not installed (pip install sentence-transformers): no peer column"


def _eager_loss(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    scores = F.normalize(q.float(), dim=-1) @ F.normalize(d.float(), dim=-1).T * SCALE
    return F.cross_entropy(scores, torch.arange(q.shape[0], device=q.device))


def _tigon_loss(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    from tigon.functional import info_nce

    return info_nce(F.normalize(q, dim=-1), F.normalize(d, dim=-1), temperature=1 / SCALE).mean()


def _last_token(decoder: Callable[..., Any], ids: torch.Tensor) -> torch.Tensor:
    # Unpadded rows: the last position is every row's last token.
    return decoder(input_ids=ids, use_cache=False).last_hidden_state[:, -1]


def _tigon_last_token(offload: bool) -> Callable[[Callable[..., Any], torch.Tensor], torch.Tensor]:
    from tigon.train.embed import embed_batch

    def embed(decoder: Callable[..., Any], ids: torch.Tensor) -> torch.Tensor:
        lengths = torch.full((ids.shape[0],), ids.shape[1], device=ids.device)
        return embed_batch(decoder, {"input_ids": ids, "attention_mask": None, "lengths": lengths}, "last", offload)

    return embed


def embedding_step(decoder: Callable[..., Any], loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   batch: int, embed: Callable[[Callable[..., Any], torch.Tensor], torch.Tensor] = _last_token,
                   ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Forward + backward of one step on ``2 * batch`` rows of ids: queries, then their positives,
    each side's last-token states by `embed`."""

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(embed(decoder, ids[:batch]), embed(decoder, ids[batch:]))
        loss.backward()
        return loss.detach()

    return step


def _lora(model: torch.nn.Module, rank: int, seed: int) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)  # the adapters' initialisation, the same for every implementation
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                            target_modules=list(LORA_TARGETS)))


def build_decoder(mode: str, seq: int, device: torch.device, *, shape: dict, lora_rank: int, checkpointing: bool,
                  seed: int = 0) -> torch.nn.Module:
    """The Llama of `shape`'s decoder (its base model: no LM head) on `device` in bf16, random
    weights from `seed`, LoRA-wrapped for mode "lora"."""
    from transformers import LlamaConfig

    from tigon.train.tiny import random_model

    config = LlamaConfig(**shape, max_position_embeddings=max(seq, 8192), use_cache=False)
    config._attn_implementation = "sdpa"
    decoder = random_model(config, seed, device=device, dtype=torch.bfloat16).get_decoder()
    if checkpointing:
        decoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return _lora(decoder, lora_rank, seed) if mode == "lora" else decoder


def peer_step(path: str, device: torch.device, batch: int, mode: str, lora_rank: int, checkpointing: bool,
              seed: int) -> tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """sentence-transformers over the decoder saved in `path`, laid out as its own saved models are
    (``modules.json``: the Transformer, then last-token Pooling), and its step: its loss module
    called on the two sides' features, as its trainer calls it."""
    from peft import LoraConfig, inject_adapter_in_model
    from sentence_transformers import SentenceTransformer
    try:  # its home from sentence-transformers 6 on
        from sentence_transformers.sentence_transformer import losses
    except ImportError:
        from sentence_transformers import losses
    from transformers import PreTrainedModel

    from tigon.train import tiny
    from tigon.train.data import Sample

    folder = Path(path)
    tiny.build_tokenizer([Sample("", text="tokens")]).save_pretrained(folder)  # read, never used: the ids are given
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    width = json.loads((folder / "config.json").read_text())["hidden_size"]
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": width,
                                                                  "pooling_mode_lasttoken": True}))
    model = SentenceTransformer(str(folder), device=str(device)).to(torch.bfloat16)
    inner = next(m for m in model.modules() if isinstance(m, PreTrainedModel))
    if checkpointing:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode == "lora":
        torch.manual_seed(seed)
        inject_adapter_in_model(LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                                           target_modules=list(LORA_TARGETS)), inner)
        for name, parameter in inner.named_parameters():
            parameter.requires_grad_("lora_" in name)
    loss_fn = losses.MultipleNegativesRankingLoss(model, scale=SCALE)
    release_memory(device)  # what loading left (a float32 copy on the way to bf16) is not the run's

    def step(ids: torch.Tensor) -> torch.Tensor:
        mask = torch.ones_like(ids)
        features = [{"input_ids": ids[:batch], "attention_mask": mask[:batch]},
                    {"input_ids": ids[batch:], "attention_mask": mask[batch:]}]
        loss = loss_fn(features, None)
        loss.backward()
        return loss.detach()

    return model, step


def run_embed_case(mode: str, impl: str, device: torch.device, *, batch: int, seq: int, steps: int, warmup: int,
                   shape: dict, lora_rank: int, checkpointing: bool, log: Callable[[str], None],
                   offload: bool = True) -> dict[str, Any]:
    """Train one embedder for `warmup` + `steps` AdamW steps; throughput, peak memory and losses."""
    release_memory(device)
    record: dict[str, Any] = {"mode": mode, "impl": impl, "batch": batch, "seq": seq}
    if impl == "peer" and importlib.util.find_spec("sentence_transformers") is None:
        return {**record, "error": PEER_MISSING}
    model = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if impl == "peer":
                # The same weights, through the disk (as sentence-transformers loads them), one copy in memory.
                build_decoder("full", seq, device, shape=shape, lora_rank=lora_rank, checkpointing=False).save_pretrained(tmp)
                release_memory(device)
                model, step = peer_step(tmp, device, batch, mode, lora_rank, checkpointing, seed=0)
                record.update(measure_training(model, step, shape["vocab_size"], 2 * batch, seq, warmup, steps))
                return record
            model = build_decoder(mode, seq, device, shape=shape, lora_rank=lora_rank, checkpointing=checkpointing)
            if impl == "tigon":
                record["applied"] = str(tigon.patch(model))
                log(record["applied"])
                step = embedding_step(model, _tigon_loss, batch, _tigon_last_token(offload and checkpointing))
            else:
                forward = torch.compile(model) if impl == "compile" else model
                step = embedding_step(forward, _eager_loss, batch)
            record.update(measure_training(model, step, shape["vocab_size"], 2 * batch, seq, warmup, steps))
    except Exception as err:  # one failing case must not hide the others' numbers
        record["error"] = f"{type(err).__name__}: {err}"
    finally:
        if model is not None and impl == "tigon":
            tigon.unpatch(model)
        del model
        release_memory(device)
    return record


def run_embed_e2e(
    modes: Sequence[str] = ("full",),
    impls: Sequence[str] = IMPLS,
    *,
    batch: int = 64,
    seq: int = 512,
    steps: int = 10,
    warmup: int = 3,
    lora_rank: int = 16,
    checkpointing: bool = True,
    offload: bool = True,
    shape: dict = LLAMA_1B,
    out_dir: Path | None = None,
    log: Callable[[str], None] = print,
    device: torch.device | None = None,
) -> list[dict[str, Any]]:
    """Every (mode, impl) pair on the current CUDA device (or `device`: a CPU run of a small
    `shape` checks the pipeline, not speed); a table, ``embed_e2e.json`` in `out_dir`, the records."""
    settings = dict(batch=batch, seq=seq, steps=steps, warmup=warmup, lora_rank=lora_rank,
                    checkpointing=checkpointing, offload=offload, shape=shape)

    def run_one(mode: str, impl: str, device: torch.device) -> dict[str, Any]:
        return run_embed_case(mode, impl, device, batch=batch, seq=seq, steps=steps, warmup=warmup, shape=shape,
                              lora_rank=lora_rank, checkpointing=checkpointing, log=log, offload=offload)

    return run_all(
        "embedding e2e bench", "the embedding end-to-end benchmark", modes, impls, (MODES, IMPLS), run_one,
        settings=settings, summary=f"{batch} queries + {batch} documents x {seq} tokens, in-batch negatives, "
        f"{steps} timed steps after {warmup}{', gradient checkpointing' if checkpointing else ''}"
        f"{' (tigon: offloaded)' if checkpointing and offload else ''}",
        out_dir=out_dir, out_name="embed_e2e.json", log=log, device=device,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tigon.bench.embed_e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["full"])
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--batch", type=int, default=64, help="queries per step (as many positives)")
    parser.add_argument("--seq", type=int, default=512, help="tokens per text")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True,
                        help="gradient checkpointing (default on)")
    parser.add_argument("--offload", action=argparse.BooleanOptionalAction, default=True,
                        help="tigon: the checkpointed layer inputs in host memory (default on)")
    parser.add_argument("--out", metavar="DIR", help="write embed_e2e.json here")
    args = parser.parse_args(argv)
    records = run_embed_e2e(
        args.modes, args.impls, batch=args.batch, seq=args.seq, steps=args.steps, warmup=args.warmup,
        lora_rank=args.lora_rank, checkpointing=args.checkpointing, offload=args.offload, out_dir=Path(args.out) if args.out else None,
    )
    return 1 if any("error" in r and r["error"] != PEER_MISSING for r in records) else 0


if __name__ == "__main__":
    from tigon.bench.e2e import exit_status

    raise SystemExit(exit_status(main, "python -m tigon.bench.embed_e2e"))
