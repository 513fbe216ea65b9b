"""End-to-end fine-tuning benchmark of a Qwen3-MoE-shaped model: transformers' experts vs tigon's.

The model has Qwen3-30B-A3B's widths (hidden 2048, 32 heads / 4 KV heads of 128, 128 experts of
intermediate 768, top-8 with renormalised weights, vocab 151936, the router's aux loss on) with
its 48 layers reduced to fit one GPU (``--layers``, default 8), random weights in bf16, SDPA
attention, trained by AdamW on random tokens, as :mod:`tigon.bench.e2e` trains its Llama (same
step cadence, same per-step loss comparison against the first implementation, "eager"):

* ``full``: every parameter trains;
* ``lora``: PEFT LoRA r=16 on q/k/v/o and, through ``target_parameters``, on every layer's
  expert weights ``gate_up_proj`` and ``down_proj``.

Implementations: ``eager`` is transformers' expert loop (``experts_implementation="eager"``),
``grouped_mm`` its grouped-GEMM path (its default where torch has grouped_mm), ``tigon`` the
model after ``tigon.patch`` with the experts on :func:`tigon.functional.moe_experts` (through
transformers' experts-implementation dispatch, :func:`tigon.patch.moe.register_experts_implementation`).

    python -m tigon.bench.moe_e2e --out bench-out/moe-e2e
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import tigon
from tigon.bench.e2e import measure_training, micro_step, release_memory, run_all
from tigon.patch.moe import register_experts_implementation

MODES = ("full", "lora")
IMPLS = ("eager", "grouped_mm", "tigon")
QWEN3_30B_A3B = dict(
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    vocab_size=151936, tie_word_embeddings=False, output_router_logits=True, router_aux_loss_coef=0.001,
)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def build_moe_model(mode: str, impl: str, seq: int, device: torch.device, *, shape: dict, layers: int,
                    lora_rank: int, dtype: torch.dtype, seed: int = 0):
    """The Qwen3-MoE of `shape` with `layers` layers on `device`, random weights from `seed`, its
    experts on `impl` (for "tigon": patched and on tigon's experts)."""
    from transformers import Qwen3MoeConfig

    from tigon.train.tiny import random_model

    config = Qwen3MoeConfig(**shape, num_hidden_layers=layers, max_position_embeddings=max(seq, 8192), use_cache=False)
    config._attn_implementation = "sdpa"
    model = random_model(config, seed, device=device, dtype=dtype)
    model.set_experts_implementation(register_experts_implementation() if impl == "tigon" else impl)
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed)  # the adapters' initialisation, the same for every implementation
        model = get_peft_model(model, LoraConfig(
            r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS),
            target_parameters=list(LORA_PARAMETERS),
        ))
    applied = str(tigon.patch(model)) if impl == "tigon" else None
    return model, applied


def run_moe_case(mode: str, impl: str, device: torch.device, *, batch: int, seq: int, steps: int, warmup: int,
                 shape: dict, layers: int, lora_rank: int, dtype: torch.dtype, log: Callable[[str], None]) -> dict[str, Any]:
    """Train one model for `warmup` + `steps` AdamW steps; throughput, peak memory and losses."""
    release_memory(device)
    record: dict[str, Any] = {"mode": mode, "impl": impl, "batch": batch, "seq": seq, "layers": layers}
    model = None
    try:
        model, applied = build_moe_model(mode, impl, seq, device, shape=shape, layers=layers, lora_rank=lora_rank, dtype=dtype)
        if applied is not None:
            record["applied"] = applied
            log(applied)
        record.update(measure_training(model, micro_step(model), shape["vocab_size"], batch, seq, warmup, steps))
    except Exception as err:  # one failing case must not hide the others' numbers
        record["error"] = f"{type(err).__name__}: {err}"
    finally:
        if model is not None:
            tigon.unpatch(model)
        del model
        release_memory(device)
    return record


def run_moe_e2e(
    modes: Sequence[str] = MODES,
    impls: Sequence[str] = IMPLS,
    *,
    batch: int = 4,
    seq: int = 2048,
    steps: int = 10,
    warmup: int = 3,
    layers: int = 8,
    lora_rank: int = 16,
    shape: dict = QWEN3_30B_A3B,
    dtype: torch.dtype = torch.bfloat16,
    out_dir: Path | None = None,
    log: Callable[[str], None] = print,
    device: torch.device | None = None,
) -> list[dict[str, Any]]:
    """Every (mode, impl) pair on the current CUDA device (or `device`: a CPU run of a small
    `shape` checks the pipeline, not speed); a table, ``moe_e2e.json`` in `out_dir`, the records."""
    settings = dict(batch=batch, seq=seq, steps=steps, warmup=warmup, layers=layers, lora_rank=lora_rank, shape=shape)

    def run_one(mode: str, impl: str, device: torch.device) -> dict[str, Any]:
        return run_moe_case(mode, impl, device, batch=batch, seq=seq, steps=steps, warmup=warmup, shape=shape,
                            layers=layers, lora_rank=lora_rank, dtype=dtype, log=log)

    return run_all(
        "MoE e2e bench", "the MoE end-to-end benchmark", modes, impls, (MODES, IMPLS), run_one, settings=settings,
        summary=f"{layers} layers, batch {batch} x {seq} tokens, {steps} timed steps after {warmup}",
        out_dir=out_dir, out_name="moe_e2e.json", log=log, device=device,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tigon.bench.moe_e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (Qwen3-30B-A3B has 48)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--out", metavar="DIR", help="write moe_e2e.json here")
    args = parser.parse_args(argv)
    records = run_moe_e2e(
        args.modes, args.impls, batch=args.batch, seq=args.seq, steps=args.steps, warmup=args.warmup,
        layers=args.layers, lora_rank=args.lora_rank, out_dir=Path(args.out) if args.out else None,
    )
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    from tigon.bench.e2e import exit_status

    raise SystemExit(exit_status(main, "python -m tigon.bench.moe_e2e"))
