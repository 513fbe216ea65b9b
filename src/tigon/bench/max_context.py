"""Long-context benchmark: peak GPU memory and seconds per step by sequence length.

The setting of issue 9's table: the 1B Llama shape (:data:`tigon.bench.e2e.LLAMA_1B`,
bf16, SDPA), PEFT LoRA r=16 on every linear layer of the decoder, gradient checkpointing, batch 1,
random tokens, AdamW. Variants:

* ``tigon``: ``tigon.patch(model)`` (the default kernels);
* ``long``: ``tigon.patch(model, offload_activations=True, tiled_mlp=True)``;
* ``offload`` and ``tiled``: each switch of ``long`` alone, to see what each costs and saves.

Peak is ``torch.cuda.max_memory_allocated()`` from building the model on, in GB (10^9 bytes, the
unit of the issue's table); ``reserved`` is the allocator's peak, what decides an out-of-memory.
Host is the process's peak resident memory (the offloaded states live there, pinned).

Results accumulate in ``max_context.json`` under the output directory, one record per (variant,
length), so lengths can be measured in separate runs (each under a command time limit) and tabled
together; from the two longest measured lengths of a variant the peak is extrapolated linearly to
1,048,576 tokens.

``tigon bench --max-context [TOKENS ...]`` runs both variants; ``python -m
tigon.bench.max_context --help`` lists the knobs.
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import tigon
from tigon.bench.e2e import LLAMA_1B, build_model, current_cuda_device, micro_step, release_memory, timed_steps
from tigon.bench.harness import environment

SEQS = (65536, 131072, 262144, 524288)
VARIANTS: dict[str, dict[str, bool]] = {
    "tigon": {},
    "long": {"offload_activations": True, "tiled_mlp": True},
    "offload": {"offload_activations": True},
    "tiled": {"tiled_mlp": True},
}
DEFAULT_VARIANTS = ("tigon", "long")
EXTRAPOLATE_TO = 1_048_576
RESULTS = "max_context.json"


def run_length(
    variant: str,
    seq: int,
    device: torch.device,
    *,
    steps: int = 1,
    warmup: int = 1,
    shape: dict = LLAMA_1B,
    lora_rank: int = 16,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """`warmup` + `steps` LoRA steps of batch 1 x `seq` tokens under gradient checkpointing with
    `variant`'s switches; the record holds peak memory, seconds per timed step and the losses."""
    release_memory(device)
    record: dict[str, Any] = {"variant": variant, "seq": seq}
    model = None
    try:
        model = build_model("lora", seq, device, shape=shape, lora_rank=lora_rank, checkpointing=True)
        record["applied"] = str(tigon.patch(model, **VARIANTS[variant]))
        log(record["applied"])
        checkpoints = _count_checkpoints(model)
        model.train()
        times, losses = timed_steps(model, micro_step(model), shape["vocab_size"], 1, seq, warmup, steps)
        cuda = device.type == "cuda"
        record["checkpointed_layers"] = checkpoints[0] // (warmup + steps)
        if not record["checkpointed_layers"]:
            log("warning: no layer was checkpointed (a patched layer forward outside transformers' wrapper?)")
        record.update(
            step_s=sum(times) / len(times),
            peak_gb=torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None,
            reserved_gb=torch.cuda.max_memory_reserved(device) / 1e9 if cuda else None,
            losses=losses,
        )
    except Exception as err:  # an out-of-memory length must not hide the others
        record["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    finally:
        if model is not None:
            tigon.unpatch(model)
        del model
        release_memory(device)
    record["host_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return record


def _count_checkpoints(model: torch.nn.Module) -> list[int]:
    """Count the layer forwards that really run under gradient checkpointing (the number is
    what the memory figures rest on), in a one-element list updated in place."""
    calls = [0]
    for module in model.modules():
        checkpoint = getattr(module, "_gradient_checkpointing_func", None)
        if getattr(module, "gradient_checkpointing", False) and checkpoint is not None:

            def counted(*args, _checkpoint=checkpoint, **kwargs):
                calls[0] += 1
                return _checkpoint(*args, **kwargs)

            module._gradient_checkpointing_func = counted
    return calls


def extrapolate(records: list[dict[str, Any]], tokens: int = EXTRAPOLATE_TO) -> dict[str, float]:
    """Per variant, the peak GB at `tokens` on the line through its two longest measured lengths."""
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in records):
        done = sorted((r["seq"], r["peak_gb"]) for r in records if r["variant"] == variant and r.get("peak_gb"))
        if len(done) >= 2 and done[-1][0] != done[-2][0]:
            (s0, p0), (s1, p1) = done[-2:]
            out[variant] = p1 + (p1 - p0) / (s1 - s0) * (tokens - s1)
    return out


def format_table(records: list[dict[str, Any]]) -> str:
    lines = [f"{'tokens':>10}  {'variant':<8}{'peak GB':>9}{'reserved':>10}{'s/step':>9}{'host GB':>9}"
             f"{'vs tigon s':>11}"]
    plain = {r["seq"]: r for r in records if r["variant"] == "tigon" and "error" not in r}
    for r in sorted(records, key=lambda r: (r["seq"], r["variant"])):
        head = f"{r['seq']:>10,}  {r['variant']:<8}"
        if "error" in r:
            lines.append(f"{head}  {r['error']}")
            continue
        base = plain.get(r["seq"])
        ratio = f"{r['step_s'] / base['step_s']:>10.2f}x" if base else f"{'-':>11}"
        peak = "-" if r["peak_gb"] is None else f"{r['peak_gb']:.1f}"
        reserved = "-" if r["reserved_gb"] is None else f"{r['reserved_gb']:.1f}"
        lines.append(f"{head}{peak:>9}{reserved:>10}{r['step_s']:>9.1f}{r['host_gb']:>9.1f}{ratio}")
    for variant, peak in extrapolate(records).items():
        lines.append(f"{EXTRAPOLATE_TO:>10,}  {variant:<8}{peak:>9.1f}  (extrapolated from the two longest lengths)")
    return "\n".join(lines)


def run_max_context(
    seqs: Sequence[int] = SEQS,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    *,
    steps: int = 1,
    warmup: int = 1,
    out_dir: Path | None = None,
    log: Callable[[str], None] = print,
    shape: dict = LLAMA_1B,
    device: torch.device | None = None,
) -> list[dict[str, Any]]:
    """Measure every (variant, length) on the current CUDA device (or `device`: a CPU run of a
    small `shape` checks the pipeline); merge into `out_dir`/max_context.json (earlier runs' other
    lengths kept), print the table of everything measured there, and return this run's records."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"variants must be among {', '.join(VARIANTS)}, got {', '.join(unknown)}")
    bad = [s for s in seqs if s < 2]
    if bad:
        raise ValueError(f"sequence lengths must be >= 2 tokens, got {bad}")
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got {steps} and {warmup}")
    device = device or current_cuda_device("the max-context benchmark")
    env = environment(device)
    log(f"tigon max-context bench on {env['device']} (torch {env['torch']}): LoRA r=16, checkpointing, batch 1, "
        f"{warmup} warm-up + {steps} timed step(s)")
    path = out_dir / RESULTS if out_dir is not None else None
    table = json.loads(path.read_text())["results"] if path is not None and path.is_file() else []
    records = []
    for seq in seqs:
        for variant in variants:
            record = run_length(variant, seq, device, steps=steps, warmup=warmup, shape=shape, log=log)
            records.append(record)
            table = [r for r in table if (r["variant"], r["seq"]) != (variant, seq)] + [record]
            log(format_table([record]))
    log("\n" + format_table(table))
    if path is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"environment": env, "results": table}, indent=1))
        log(f"wrote {path}")
    return records


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tigon.bench.max_context", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", nargs="+", type=int, default=list(SEQS), metavar="TOKENS")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(DEFAULT_VARIANTS))
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", metavar="DIR", help=f"merge results into DIR/{RESULTS}")
    args = parser.parse_args(argv)
    records = run_max_context(
        args.seq, args.variants, steps=args.steps, warmup=args.warmup, out_dir=Path(args.out) if args.out else None
    )
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    raise SystemExit(main())
