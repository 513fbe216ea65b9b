"""End-to-end fine-tuning benchmark of a Qwen2.5-VL-shaped vision-language model: eager, the peer
(Liger-Kernel's patch of the instance) and tigon, same model, images, text and steps.

Each sample is one 448 x 448 image (a 32 x 32 grid of 14-pixel patches, merged 2 x 2 into 256
visual tokens, between the vision start and end tokens) and random text filling the rest of
``--seq`` tokens; the loss is on the text only. The model has random weights in bf16 with SDPA
attention and is trained by AdamW at :mod:`tigon.bench.e2e`'s cadence:

* ``lora``: PEFT LoRA r=16 on every linear layer of the language model, the vision tower frozen
  (Qwen2.5-VL-7B's shape by default);
* ``full``: every parameter trains, the vision tower too (use ``--shape 2b``: Qwen2-VL-2B's
  language model widths with Qwen2.5-VL's tower, to fit one GPU with AdamW's state).

    python -m tigon.bench.vlm_e2e --out bench-out/vlm-e2e
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import tigon
from tigon.bench.e2e import apply_peer, measure_training, release_memory, run_all

MODES = ("lora", "full")
IMPLS = ("eager", "peer", "tigon")
QWEN2_5_VL_VISION = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14, spatial_merge_size=2,
    temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31], in_chans=3,
)
SHAPES = {
    "7b": dict(text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064), vision=dict(QWEN2_5_VL_VISION, out_hidden_size=3584)),
    "2b": dict(text=dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936), vision=dict(QWEN2_5_VL_VISION, out_hidden_size=1536)),
    # (A CPU check of the pipeline, not of speed.)
    "tiny": dict(text=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=152064),
                 vision=dict(QWEN2_5_VL_VISION, depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                             fullatt_block_indexes=[1], out_hidden_size=64)),
}
# Qwen-VL's special tokens: the ids above the text vocabulary a random batch must not draw.
IMAGE, START, END, FIRST_SPECIAL = 151655, 151652, 151653, 151643
GRID = 32  # patches per side of a 448-pixel image
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _sections(text: dict) -> list[int]:
    """M-RoPE's split of a head's frequencies over time, height and width (Qwen2.5-VL's 16/24/24 of 64)."""
    half = text["hidden_size"] // text["num_attention_heads"] // 2
    return [half // 4, 3 * half // 8, half - half // 4 - 3 * half // 8]


def build_vlm(mode: str, seq: int, device: torch.device, *, shape: str, lora_rank: int, seed: int = 0):
    """The Qwen2.5-VL of `shape` on `device` in bf16, random weights from `seed`; with ``lora``, PEFT
    LoRA on the language model's linears and the vision tower frozen."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    sizes = SHAPES[shape]
    config = AutoConfig.for_model(
        "qwen2_5_vl", text_config=dict(sizes["text"], max_position_embeddings=max(seq, 32768), use_cache=False,
                                       rope_scaling={"type": "mrope", "mrope_section": _sections(sizes["text"])}),
        vision_config=sizes["vision"],
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END,
    )
    config._attn_implementation = "sdpa"
    for sub in (config.get_text_config(), config.vision_config):
        sub._attn_implementation = "sdpa"
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed)
        model = get_peft_model(model, LoraConfig(
            r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS),
            exclude_modules=r".*visual.*",  # the language model's linears only
        ))
    return model


def image_step(model: torch.nn.Module, device: torch.device, batch: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Forward + backward of `model` on random text ids with one image per row: ids from the
    text vocabulary, the image's tokens after the first, the loss on the text."""
    gen = torch.Generator(device).manual_seed(99)
    patch_dim = 3 * QWEN2_5_VL_VISION["temporal_patch_size"] * QWEN2_5_VL_VISION["patch_size"] ** 2
    pixels = torch.randn(batch * GRID * GRID, patch_dim, device=device, generator=gen, dtype=torch.bfloat16)
    grid = torch.tensor([[1, GRID, GRID]] * batch, device=device)
    tokens = GRID * GRID // 4

    def forward_backward(ids: torch.Tensor) -> torch.Tensor:
        ids = ids % FIRST_SPECIAL
        ids[:, 1], ids[:, 2:2 + tokens], ids[:, 2 + tokens] = START, IMAGE, END
        labels = ids.clone()
        labels[:, : 3 + tokens] = -100
        extra = {}
        if "mm_token_type_ids" in _forward_parameters(model):
            extra["mm_token_type_ids"] = (ids == IMAGE).int()
        loss = model(input_ids=ids, labels=labels, pixel_values=pixels, image_grid_thw=grid, **extra).loss
        loss.backward()
        return loss.detach()

    return forward_backward


def _forward_parameters(model: torch.nn.Module) -> set[str]:
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return set(inspect.signature(base.model.forward).parameters)


def run_vlm_case(mode: str, impl: str, device: torch.device, *, batch: int, seq: int, steps: int, warmup: int,
                 shape: str, lora_rank: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Train one model for `warmup` + `steps` AdamW steps; throughput, peak memory and losses."""
    release_memory(device)
    record: dict[str, Any] = {"mode": mode, "impl": impl, "batch": batch, "seq": seq, "shape": shape}
    model = undo_peer = None
    try:
        model = build_vlm(mode, seq, device, shape=shape, lora_rank=lora_rank)
        if impl == "peer":
            undo_peer = apply_peer(model)
        if impl == "tigon":
            record["applied"] = str(tigon.patch(model))
            log(record["applied"])
        vocab = SHAPES[shape]["text"]["vocab_size"]
        record.update(measure_training(model, image_step(model, device, batch), vocab, batch, seq, warmup, steps))
    except Exception as err:  # one failing case must not hide the others' numbers
        record["error"] = f"{type(err).__name__}: {err}"
    finally:
        if model is not None:
            tigon.unpatch(model)
        if undo_peer is not None:
            undo_peer()
        del model
        release_memory(device)
    return record


def run_vlm_e2e(
    modes: Sequence[str] = ("lora",),
    impls: Sequence[str] = IMPLS,
    *,
    batch: int = 4,
    seq: int = 2048,
    steps: int = 6,
    warmup: int = 2,
    shape: str = "7b",
    lora_rank: int = 16,
    out_dir: Path | None = None,
    log: Callable[[str], None] = print,
    device: torch.device | None = None,
) -> list[dict[str, Any]]:
    """Every (mode, impl) pair on the current CUDA device; a table, ``vlm_e2e.json`` in `out_dir`,
    the records."""
    settings = dict(batch=batch, seq=seq, steps=steps, warmup=warmup, shape=shape, lora_rank=lora_rank)

    def run_one(mode: str, impl: str, device: torch.device) -> dict[str, Any]:
        return run_vlm_case(mode, impl, device, batch=batch, seq=seq, steps=steps, warmup=warmup, shape=shape,
                            lora_rank=lora_rank, log=log)

    return run_all(
        "VLM e2e bench", "the VLM end-to-end benchmark", modes, impls, (MODES, IMPLS), run_one, settings=settings,
        summary=f"Qwen2.5-VL {shape} shape, batch {batch} x {seq} tokens (one 448x448 image each), {steps} timed "
                f"steps after {warmup}",
        out_dir=out_dir, out_name="vlm_e2e.json", log=log, device=device,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tigon.bench.vlm_e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["lora"])
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--out", metavar="DIR", help="write vlm_e2e.json here")
    args = parser.parse_args(argv)
    records = run_vlm_e2e(
        args.modes, args.impls, batch=args.batch, seq=args.seq, steps=args.steps, warmup=args.warmup,
        shape=args.shape, lora_rank=args.lora_rank, out_dir=Path(args.out) if args.out else None,
    )
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    raise SystemExit(main())
