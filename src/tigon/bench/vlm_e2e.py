"""End-to-end fine-tuning benchmark of a Qwen-VL-shaped vision-language model: eager, the peer
(Liger-Kernel's patch of the instance), tigon and torch.compile of the eager model, same model,
images, text and steps.

Each sample is one 448 x 448 image (a 32 x 32 grid of 14-pixel patches, merged 2 x 2 into 256
visual tokens, between the vision start and end tokens) and random text filling the rest of
``--seq`` tokens; the loss is on the text only. The model has random weights in bf16 with SDPA
attention and is trained by AdamW at :mod:`tigon.bench.e2e`'s cadence:

* ``lora``: PEFT LoRA r=16 on every linear layer of the language model, the vision tower frozen
  (Qwen2.5-VL-7B's shape by default);
* ``full``: every parameter trains, the vision tower too (use ``--shape 2b``: Qwen2-VL-2B, its
  LayerNorm + QuickGELU tower included, to fit one GPU with AdamW's state). After the training
  steps the vision tower alone is timed too (forward + backward of ``visual`` on the batch's
  pixels, synchronised, median of ``--vision-reps``), its own row with the ratio to eager's.

``--loss-steps N`` runs each case for at least N steps on the same weights and data, prints the
largest per-step loss difference to eager's, and writes the curves to the JSON (and a PNG).

    python -m tigon.bench.vlm_e2e --out bench-out/vlm-e2e
    python -m tigon.bench.vlm_e2e --shape 2b --modes full --loss-steps 20 --out bench-out/vlm-e2e-2b
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import tigon
from tigon.bench.e2e import _sync, apply_peer, measure_training, release_memory, run_all

MODES = ("lora", "full")
# Special token ids: the image's, the vision start's and end's, and the first special one (a random
# batch draws its text below it). Qwen-VL's, and the tiny shapes' inside their vocabulary.
QWEN_SPECIALS = dict(image=151655, start=151652, end=151653, first=151643)
TINY_SPECIALS = dict(image=1021, start=1018, end=1019, first=1016)
GRID = 32  # patches per side of a 448-pixel image (the tiny shapes': 8)
IMPLS = ("eager", "peer", "tigon", "compile")  # compile: last, the slowest to start
QWEN2_5_VL_VISION = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14, spatial_merge_size=2,
    temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31], in_chans=3,
)
# Qwen2-VL's tower: LayerNorm + QuickGELU MLP blocks, full attention everywhere (`hidden_size` is
# the merger's output width, the language model's).
QWEN2_VL_VISION = dict(depth=32, embed_dim=1280, mlp_ratio=4, num_heads=16, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2, in_channels=3, hidden_act="quick_gelu")
# (A vocabulary of 1024 with the image tokens at its top: a CPU check's head over Qwen's 152k
# would be most of its run.)
TINY_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=1024)
SHAPES = {
    "7b": dict(family="qwen2_5_vl",
               text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064), vision=dict(QWEN2_5_VL_VISION, out_hidden_size=3584),
               grid=GRID, specials=QWEN_SPECIALS),
    "2b": dict(family="qwen2_vl",
               text=dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936), vision=dict(QWEN2_VL_VISION, hidden_size=1536),
               grid=GRID, specials=QWEN_SPECIALS),
    # (CPU checks of the pipeline, not of speed: the 7b's family and the 2b's.)
    "tiny": dict(family="qwen2_5_vl", text=TINY_TEXT, grid=8, specials=TINY_SPECIALS,
                 vision=dict(QWEN2_5_VL_VISION, depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                             fullatt_block_indexes=[1], out_hidden_size=64)),
    "tiny-2b": dict(family="qwen2_vl", text=TINY_TEXT, grid=8, specials=TINY_SPECIALS,
                    vision=dict(QWEN2_VL_VISION, depth=2, embed_dim=32, num_heads=2, hidden_size=64)),
}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _sections(text: dict) -> list[int]:
    """M-RoPE's split of a head's frequencies over time, height and width (Qwen2.5-VL's 16/24/24 of 64)."""
    half = text["hidden_size"] // text["num_attention_heads"] // 2
    return [half // 4, 3 * half // 8, half - half // 4 - 3 * half // 8]


def build_vlm(mode: str, seq: int, device: torch.device, *, shape: str, lora_rank: int, seed: int = 0):
    """The Qwen-VL of `shape` on `device` in bf16, random weights from `seed`; with ``lora``, PEFT
    LoRA on the language model's linears and the vision tower frozen."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    sizes = SHAPES[shape]
    specials = sizes["specials"]
    config = AutoConfig.for_model(
        sizes["family"], text_config=dict(sizes["text"], max_position_embeddings=max(seq, 32768), use_cache=False,
                                       rope_scaling={"type": "mrope", "mrope_section": _sections(sizes["text"])}),
        vision_config=sizes["vision"],
        image_token_id=specials["image"], vision_start_token_id=specials["start"],
        vision_end_token_id=specials["end"],
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


def image_batch(device: torch.device, batch: int, grid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pixels (patches flattened, as Qwen-VL's processor gives them) and grids of `batch`
    images of `grid` x `grid` patches, the same on every call."""
    gen = torch.Generator(device).manual_seed(99)
    patch_dim = 3 * QWEN2_5_VL_VISION["temporal_patch_size"] * QWEN2_5_VL_VISION["patch_size"] ** 2
    pixels = torch.randn(batch * grid * grid, patch_dim, device=device, generator=gen, dtype=torch.bfloat16)
    return pixels, torch.tensor([[1, grid, grid]] * batch, device=device)


def image_step(model: torch.nn.Module, device: torch.device, batch: int, shape: str,
               run: torch.nn.Module | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """Forward + backward of `model` (through `run`, its compiled form, when given) on random text
    ids with one image per row: ids from the text vocabulary, the image's tokens after the first,
    the loss on the text."""
    side, specials = SHAPES[shape]["grid"], SHAPES[shape]["specials"]
    pixels, grid = image_batch(device, batch, side)
    tokens = side * side // 4

    def forward_backward(ids: torch.Tensor) -> torch.Tensor:
        ids = ids % specials["first"]
        ids[:, 1], ids[:, 2:2 + tokens], ids[:, 2 + tokens] = specials["start"], specials["image"], specials["end"]
        labels = ids.clone()
        labels[:, : 3 + tokens] = -100
        extra = {}
        if "mm_token_type_ids" in _forward_parameters(model):
            extra["mm_token_type_ids"] = (ids == specials["image"]).int()
        loss = (model if run is None else run)(input_ids=ids, labels=labels, pixel_values=pixels, image_grid_thw=grid, **extra).loss
        loss.backward()
        return loss.detach()

    return forward_backward


def _forward_parameters(model: torch.nn.Module) -> set[str]:
    import inspect

    return set(inspect.signature(_inner(model).forward).parameters)


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """The *ForConditionalGeneration's model (the one holding ``visual``), under PEFT or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model


def time_vision(model: torch.nn.Module, device: torch.device, batch: int, reps: int, grid: int,
                compiled: bool = False) -> float:
    """Median ms of one forward + backward of the vision tower alone (patch embedding, blocks,
    merger; torch.compile'd with `compiled`) on the batch's pixels, synchronised around each; a
    fixed random gradient flows back."""
    visual = _inner(model).visual
    visual = torch.compile(visual) if compiled else visual
    pixels, grid_thw = image_batch(device, batch, grid)
    grad = None
    times = []
    for _ in range(reps + 1):  # the first is a warm-up (kernel compiles, allocator)
        _sync(device)
        start = time.perf_counter()
        out = visual(pixels, grid_thw=grid_thw).pooler_output
        if grad is None:
            grad = torch.randn(out.shape, device=device, dtype=out.dtype, generator=torch.Generator(device).manual_seed(7))
        out.backward(grad)
        _sync(device)
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return 1e3 * statistics.median(times[1:])


def run_vlm_case(mode: str, impl: str, device: torch.device, *, batch: int, seq: int, steps: int, warmup: int,
                 shape: str, lora_rank: int, log: Callable[[str], None], vision_reps: int = 0) -> dict[str, Any]:
    """Train one model for `warmup` + `steps` AdamW steps; throughput, peak memory and losses; with
    `vision_reps` (full mode: the tower trains) also the vision tower's own fwd+bwd time."""
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
        run = torch.compile(model) if impl == "compile" else None
        record.update(measure_training(model, image_step(model, device, batch, shape, run), vocab, batch, seq, warmup,
                                       steps))
        if vision_reps and mode == "full":
            record["vision_ms"] = time_vision(model, device, batch, vision_reps, SHAPES[shape]["grid"],
                                              compiled=impl == "compile")
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


def vision_and_losses(records: list[dict[str, Any]], loss_steps: int) -> str:
    """Add each record's vision-tower time ratio to eager's of its mode; the vision rows and, with
    `loss_steps`, each implementation's largest per-step loss difference to eager, as text."""
    eager = {r["mode"]: r for r in records if r["impl"] == "eager"}
    lines = []
    for r in records:
        base = eager.get(r["mode"], {})
        if "vision_ms" in r:
            if "vision_ms" in base:
                r["vision_vs_eager"] = r["vision_ms"] / base["vision_ms"]
            lines.append(f"vision tower fwd+bwd  {r['mode']:<6}{r['impl']:<8}{r['vision_ms']:>9.2f} ms"
                         f"{r.get('vision_vs_eager', float('nan')):>8.2f}x eager")
        if loss_steps and "max_loss_diff" in r and r is not base:
            lines.append(f"losses over {len(r['losses'])} steps  {r['mode']:<6}{r['impl']:<8}"
                         f"max |loss - eager| {r['max_loss_diff']:.5f}")
    return "\n".join(lines)


def plot_losses(records: list[dict[str, Any]], path: Path) -> bool:
    """Each case's per-step loss, one line per (mode, impl). False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in records:
        if "losses" in r:
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{r['mode']} {r['impl']}", marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


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
    loss_steps: int = 0,
    vision_reps: int = 5,
    out_dir: Path | None = None,
    log: Callable[[str], None] = print,
    device: torch.device | None = None,
) -> list[dict[str, Any]]:
    """Every (mode, impl) pair on the current CUDA device; a table, ``vlm_e2e.json`` in `out_dir`,
    the records. With `loss_steps` every case runs at least that many steps in all (the extra ones
    timed too) and its losses are compared with eager's step by step (``vlm_losses.png`` in
    `out_dir`); `vision_reps` times the vision tower alone in full mode (0: not)."""
    steps = max(steps, loss_steps - warmup)
    settings = dict(batch=batch, seq=seq, steps=steps, warmup=warmup, shape=shape, lora_rank=lora_rank,
                    loss_steps=loss_steps, vision_reps=vision_reps)

    def run_one(mode: str, impl: str, device: torch.device) -> dict[str, Any]:
        return run_vlm_case(mode, impl, device, batch=batch, seq=seq, steps=steps, warmup=warmup, shape=shape,
                            lora_rank=lora_rank, log=log, vision_reps=vision_reps)

    side = SHAPES[shape]["grid"] * QWEN2_5_VL_VISION["patch_size"]
    records = run_all(
        "VLM e2e bench", "the VLM end-to-end benchmark", modes, impls, (MODES, IMPLS), run_one, settings=settings,
        summary=f"{SHAPES[shape]['family']} {shape} shape, batch {batch} x {seq} tokens (one {side}x{side} image each), "
                f"{steps} timed steps after {warmup}",
        out_dir=out_dir, out_name="vlm_e2e.json", log=log, device=device,
    )
    extra = vision_and_losses(records, loss_steps)
    if extra:
        log(extra)
    if out_dir is not None:
        # run_all wrote the records before the vision ratios existed: write them again with them.
        path = out_dir / "vlm_e2e.json"
        saved = json.loads(path.read_text())
        path.write_text(json.dumps({**saved, "results": records}, indent=1))
        if loss_steps and plot_losses(records, out_dir / "vlm_losses.png"):
            log(f"wrote {out_dir / 'vlm_losses.png'}")
    return records


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
    parser.add_argument("--loss-steps", type=int, default=0, metavar="N",
                        help="run at least N steps per case and compare each step's loss with eager's")
    parser.add_argument("--vision-reps", type=int, default=5, metavar="N",
                        help="full mode: time the vision tower's fwd+bwd alone, median of N (0: not)")
    parser.add_argument("--out", metavar="DIR", help="write vlm_e2e.json here")
    args = parser.parse_args(argv)
    records = run_vlm_e2e(
        args.modes, args.impls, batch=args.batch, seq=args.seq, steps=args.steps, warmup=args.warmup,
        shape=args.shape, lora_rank=args.lora_rank, loss_steps=args.loss_steps, vision_reps=args.vision_reps, out_dir=Path(args.out) if args.out else None,
    )
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    from tigon.bench.e2e import exit_status

    raise SystemExit(exit_status(main, "python -m tigon.bench.vlm_e2e"))
