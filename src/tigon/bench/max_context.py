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

``--quant nf4`` makes it QLoRA (the base's linear layers NF4 with double quantisation, as
``tigon bench --e2e``'s qlora mode loads them); ``--shape 8b`` the Llama-3-8B shape. ``unsloth``
is Unsloth's ``FastLanguageModel`` on the same saved model with its own offloading checkpointing
(``use_gradient_checkpointing="unsloth"``), ``unsloth-tiled`` with its tiled MLP as well; each runs
in a process of its own (Unsloth patches transformers as it is imported), where it is installed.
``--memory-cap GB`` caps what the process may allocate on the GPU
(``torch.cuda.set_per_process_memory_fraction``) to compare with figures published for a smaller
card: a length that does not fit is an out-of-memory row. With ``--isolate`` (implied by unsloth
variants) every (variant, length) runs in a fresh process, so one length's out-of-memory or crash
leaves the next length's allocator clean.

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
from tigon.bench.e2e import (
    LLAMA_1B, shape_arg, build_model, build_unsloth, current_cuda_device, micro_step, release_memory, timed_steps,
)
from tigon.bench.harness import environment, run_isolated

SEQS = (65536, 131072, 262144, 524288)
VARIANTS: dict[str, dict[str, bool]] = {
    "tigon": {},
    "long": {"offload_activations": True, "tiled_mlp": True},
    "offload": {"offload_activations": True},
    "tiled": {"tiled_mlp": True},
}
# Unsloth's variants: from_pretrained's options with its offloading checkpointing.
UNSLOTH_VARIANTS: dict[str, dict[str, bool]] = {"unsloth": {}, "unsloth-tiled": {"unsloth_tiled_mlp": True}}
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
    quant: str | None = None,
    memory_cap_gb: float | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """`warmup` + `steps` LoRA steps of batch 1 x `seq` tokens under gradient checkpointing with
    `variant`'s switches (on an NF4 base with `quant`, the process's GPU memory capped at
    `memory_cap_gb` GB where given); the record holds peak memory, seconds per timed step and the
    losses."""
    release_memory(device)
    record: dict[str, Any] = {"variant": variant, "seq": seq}
    if memory_cap_gb is not None:
        cap(memory_cap_gb, device)
        record["memory_cap_gb"] = memory_cap_gb
    mode = "qlora" if quant else "lora"
    model = None
    try:
        if variant in UNSLOTH_VARIANTS:
            model = build_unsloth(mode, seq, device, shape=shape, lora_rank=lora_rank, checkpointing="unsloth",
                                  **UNSLOTH_VARIANTS[variant])
        else:
            model = build_model(mode, seq, device, shape=shape, lora_rank=lora_rank, checkpointing=True)
            record["applied"] = str(tigon.patch(model, **VARIANTS[variant]))
            log(record["applied"])
        checkpoints = _count_checkpoints(model)
        model.train()
        times, losses = timed_steps(model, micro_step(model), shape["vocab_size"], 1, seq, warmup, steps)
        cuda = device.type == "cuda"
        record["checkpointed_layers"] = checkpoints[0] // (warmup + steps)
        if not record["checkpointed_layers"] and variant not in UNSLOTH_VARIANTS:  # Unsloth checkpoints its own way
            log("warning: no layer was checkpointed (a patched layer forward outside transformers' wrapper?)")
        record.update(
            step_s=sum(times) / len(times),
            peak_gb=torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None,
            reserved_gb=torch.cuda.max_memory_reserved(device) / 1e9 if cuda else None,
            losses=losses,
        )
    except ImportError as err:  # Unsloth, where it is not installed (or cannot start)
        if variant not in UNSLOTH_VARIANTS:
            raise
        record["skipped"] = f"{variant} cannot be imported here ({str(err).splitlines()[0][:160]})"
    except Exception as err:  # an out-of-memory length must not hide the others
        record["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    finally:
        if model is not None:
            tigon.unpatch(model)
        del model
        release_memory(device)
    record["host_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return record


def cap(gb: float, device: torch.device) -> None:
    """Let this process allocate at most `gb` GB (10^9 bytes) on `device` (a no-op off CUDA)."""
    if device.type != "cuda":
        return
    torch.cuda.set_per_process_memory_fraction(gb * 1e9 / torch.cuda.get_device_properties(device).total_memory, device)


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
    lines = [f"{'tokens':>10}  {'variant':<14}{'peak GB':>9}{'reserved':>10}{'s/step':>9}{'host GB':>9}"
             f"{'vs tigon s':>11}"]
    plain = {r["seq"]: r for r in records if r["variant"] == "tigon" and "step_s" in r}
    for r in sorted(records, key=lambda r: (r["seq"], r["variant"])):
        head = f"{r['seq']:>10,}  {r['variant']:<14}"
        if "step_s" not in r:
            lines.append(f"{head}  {r.get('error') or 'skipped: ' + r.get('skipped', '')}")
            continue
        base = plain.get(r["seq"])
        ratio = f"{r['step_s'] / base['step_s']:>10.2f}x" if base else f"{'-':>11}"
        peak = "-" if r["peak_gb"] is None else f"{r['peak_gb']:.1f}"
        reserved = "-" if r["reserved_gb"] is None else f"{r['reserved_gb']:.1f}"
        lines.append(f"{head}{peak:>9}{reserved:>10}{r['step_s']:>9.1f}{r['host_gb']:>9.1f}{ratio}")
    for variant, peak in extrapolate(records).items():
        lines.append(f"{EXTRAPOLATE_TO:>10,}  {variant:<14}{peak:>9.1f}  (extrapolated from the two longest lengths)")
    return "\n".join(lines)


def run_max_context(
    seqs: Sequence[int] = SEQS,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    *,
    steps: int = 1,
    warmup: int = 1,
    quant: str | None = None,
    memory_cap_gb: float | None = None,
    isolate: bool = False,
    out_dir: Path | None = None,
    log: Callable[[str], None] = print,
    shape: dict = LLAMA_1B,
    device: torch.device | None = None,
) -> list[dict[str, Any]]:
    """Measure every (variant, length) on the current CUDA device (or `device`: a CPU run of a
    small `shape` checks the pipeline), on an NF4 base with `quant`, within `memory_cap_gb`; each
    in a fresh process with `isolate` (always for Unsloth's variants). Merge into
    `out_dir`/max_context.json (max_context-nf4.json with `quant`; earlier runs' other lengths
    kept), print the table of everything measured there, and return this run's records."""
    unknown = [v for v in variants if v not in VARIANTS and v not in UNSLOTH_VARIANTS]
    if unknown:
        raise ValueError(f"variants must be among {', '.join([*VARIANTS, *UNSLOTH_VARIANTS])}, got {', '.join(unknown)}")
    bad = [s for s in seqs if s < 2]
    if bad:
        raise ValueError(f"sequence lengths must be >= 2 tokens, got {bad}")
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got {steps} and {warmup}")
    if quant not in (None, "nf4"):
        raise ValueError(f"quant must be nf4 or None, got {quant!r}")
    if memory_cap_gb is not None and memory_cap_gb <= 0:
        raise ValueError(f"memory cap must be > 0 GB, got {memory_cap_gb:g}")
    device = device or current_cuda_device("the max-context benchmark")
    if memory_cap_gb is not None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if memory_cap_gb * 1e9 > total:
            raise ValueError(f"memory cap {memory_cap_gb:g} GB is more than the GPU's {total / 1e9:.0f} GB")
    env = environment(device)
    log(f"tigon max-context bench on {env['device']} (torch {env['torch']}): {'QLoRA (nf4)' if quant else 'LoRA'} "
        f"r=16, checkpointing, batch 1, {warmup} warm-up + {steps} timed step(s)"
        + (f", GPU memory capped at {memory_cap_gb:g} GB" if memory_cap_gb is not None else ""))
    path = out_dir / (f"max_context-{quant}.json" if quant else RESULTS) if out_dir is not None else None
    table = json.loads(path.read_text())["results"] if path is not None and path.is_file() else []
    records = []
    for seq in seqs:
        for variant in variants:
            if isolate or variant in UNSLOTH_VARIANTS:
                argv = ["--case", variant, str(seq), "--device", str(device), "--shape", json.dumps(shape),
                        "--steps", str(steps), "--warmup", str(warmup)]
                argv += (["--quant", quant] if quant else []) + (
                    ["--memory-cap", str(memory_cap_gb)] if memory_cap_gb is not None else [])
                record = run_isolated("tigon.bench.max_context", argv, {"variant": variant, "seq": seq})
            else:
                record = run_length(variant, seq, device, steps=steps, warmup=warmup, shape=shape, quant=quant,
                                    memory_cap_gb=memory_cap_gb, log=log)
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
    parser.add_argument("--variants", nargs="+", choices=[*VARIANTS, *UNSLOTH_VARIANTS], default=list(DEFAULT_VARIANTS))
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--shape", type=shape_arg, default=LLAMA_1B, help="1b (default) or 8b: the Llama shape")
    parser.add_argument("--quant", choices=["nf4"], help="QLoRA: the base's linear layers in NF4 (double quantisation)")
    parser.add_argument("--memory-cap", type=float, metavar="GB",
                        help="allow the process at most GB GB of GPU memory (torch.cuda.set_per_process_memory_fraction)")
    parser.add_argument("--isolate", action="store_true", help="each (variant, length) in a fresh process")
    parser.add_argument("--out", metavar="DIR", help=f"merge results into DIR/{RESULTS} (max_context-nf4.json with --quant)")
    # one (variant, length) in this process, its record written as JSON to FILE (how --isolate runs each)
    parser.add_argument("--case", nargs=2, metavar=("VARIANT", "TOKENS"), help=argparse.SUPPRESS)
    parser.add_argument("--record", metavar="FILE", help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = torch.device(args.device) if args.device else None
    if args.case:
        record = run_length(args.case[0], int(args.case[1]), device or current_cuda_device("the max-context benchmark"),
                            steps=args.steps, warmup=args.warmup, shape=args.shape, quant=args.quant,
                            memory_cap_gb=args.memory_cap, log=lambda line: None)
        Path(args.record).write_text(json.dumps(record))
        return 0
    records = run_max_context(
        args.seq, args.variants, steps=args.steps, warmup=args.warmup, quant=args.quant, memory_cap_gb=args.memory_cap,
        isolate=args.isolate, shape=args.shape, device=device, out_dir=Path(args.out) if args.out else None,
    )
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    from tigon.bench.e2e import exit_status

    raise SystemExit(exit_status(main, "python -m tigon.bench.max_context"))
