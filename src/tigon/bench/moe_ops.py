"""moe_experts side by side with every implementation transformers has, at Qwen3-30B-A3B's widths.

Transformers' expert loop (``experts_implementation="eager"``) syncs with the host once per call
(``nonzero``), so no CUDA graph can capture it and ``tigon bench`` (whose main columns are graph
replayed) cannot time it. This runs tigon (as it runs by default, and on each GEMM back end), the
loop, transformers' grouped_mm path and torch.compile of each on the same tensors, and the floor
under them all, the block's six grouped GEMMs alone (``grouped-gemms``: fwd+bwd only), and reports
fwd and fwd+bwd as launched (host time included: what the loop is made of), fwd+bwd graph
replayed where capturable, peak memory, the first call's seconds (torch.compile's compilation)
and each output's error against the loop:

    python -m tigon.bench.moe_ops --out bench-out/moe
    python -m tigon.bench.moe_ops --sizes 8192x2048x768x128x8 32768x2048x768x128x8 --impls tigon hf-loop hf-grouped_mm
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import tigon.functional as F
from tigon.bench.harness import environment, fwd_bwd_step, peak_mib
from tigon.timing import time_ms as _time_ms
from tigon.bench.ops.moe import SIZES, grouped_gemms, hf_expert_loop, hf_grouped_mm, make_inputs, on_gemm
from tigon.bench.registry import Size, parse_size


def implementations() -> dict[str, tuple[Callable, bool]]:
    """Every implementation, and whether a CUDA graph can capture it."""
    return {
        "tigon": (F.moe_experts, True),
        **{f"tigon-{gemm}": (on_gemm(gemm), True) for gemm in ("triton", "grouped_mm", "hybrid")},
        "hf-loop": (hf_expert_loop, False),
        "hf-grouped_mm": (hf_grouped_mm, True),
        "compile-loop": (torch.compile(hf_expert_loop, dynamic=False), False),
        "compile-grouped_mm": (torch.compile(hf_grouped_mm, dynamic=False), True),
    }


# The floor: the block's six grouped GEMMs alone (fwd+bwd only; no output to compare).
GEMM_FLOOR = "grouped-gemms"
IMPLS = ("tigon", "tigon-triton", "tigon-grouped_mm", "tigon-hybrid", "hf-loop", "hf-grouped_mm",
         "compile-loop", "compile-grouped_mm", GEMM_FLOOR)


def _relative_error(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.float() - want.float()).norm() / want.float().norm()).item()


def _measure(fn: Callable, graphable: bool, args: Sequence[Any], leaves: list[torch.Tensor],
             grads: list[torch.Tensor], want: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """One implementation's figures: the first call's seconds, its error against `want`, fwd and
    fwd+bwd (backward from `grads`) as launched, peak MiB, and fwd+bwd graph-replayed where capturable."""
    start = time.perf_counter()
    out = fn(*args)  # the first call: compilation for the compiled ones
    record: dict[str, Any] = {"first_call_s": time.perf_counter() - start}
    record["error_vs_loop"] = _relative_error(out, want)
    del out
    step = fwd_bwd_step(fn, args, grads)
    calls = {"fwd_host_ms": (lambda: fn(*args), []), "fwd_bwd_host_ms": (step, leaves)}
    record.update({key: _time_ms(call, device, grad_leaves) for key, (call, grad_leaves) in calls.items()})
    record["peak_mib"] = peak_mib(step, device, leaves)
    if graphable and device.type == "cuda":
        record["graph_ms"] = _time_ms(step, device, leaves, graph=True)
    return record


def _measure_gemm_floor(args: Sequence[Any], device: torch.device) -> dict[str, Any]:
    """The block's six grouped GEMMs alone: fwd+bwd as launched and graph-replayed."""
    step = grouped_gemms(*args)
    record = {"fwd_bwd_host_ms": _time_ms(step, device, [])}
    if device.type == "cuda":
        record["graph_ms"] = _time_ms(step, device, [], graph=True)
    return record


def bench_side_by_side(size: Size, dtype: torch.dtype, device: torch.device, impls: Sequence[str]) -> list[dict[str, Any]]:
    """One record per implementation at `size`: fwd and fwd+bwd ms as launched (``*_host_ms``)
    and graph-replayed where capturable, peak MiB, error against the loop, speed-ups."""
    torch.manual_seed(0)
    args = make_inputs(size, dtype, device)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    want = hf_expert_loop(*args).detach()
    fns = implementations()
    grads = [torch.randn_like(want)]
    records = []
    for impl in impls:
        record: dict[str, Any] = {"op": "moe_experts", "size": "x".join(map(str, size)), "impl": impl}
        try:
            if impl == GEMM_FLOOR:
                record.update(_measure_gemm_floor(args, device))
            else:
                record.update(_measure(*fns[impl], args, leaves, grads, want, device))
        except Exception as err:  # one failing implementation must not hide the others' numbers
            record["error"] = f"{type(err).__name__}: {err}"
        for leaf in leaves:
            leaf.grad = None
        records.append(record)
    bases = {r["impl"]: r["fwd_bwd_host_ms"] for r in records if "fwd_bwd_host_ms" in r}
    for record in records:
        for base in ("hf-loop", "hf-grouped_mm"):
            if "fwd_bwd_host_ms" in record and base in bases:
                record[f"vs_{base}"] = record["fwd_bwd_host_ms"] / bases[base]
    return records


COLUMNS = (  # (header, record key, format): times as launched unless "graph"
    ("fwd ms", "fwd_host_ms", ".2f"), ("fwd+bwd", "fwd_bwd_host_ms", ".2f"), ("graph", "graph_ms", ".2f"),
    ("peak MiB", "peak_mib", ".0f"), ("vs loop", "vs_hf-loop", ".3f"), ("vs gmm", "vs_hf-grouped_mm", ".3f"),
    ("err", "error_vs_loop", ".1e"), ("1st s", "first_call_s", ".1f"),
)


def format_side_by_side(records: list[dict[str, Any]]) -> str:
    """One line per record: the COLUMNS, "-" where a record has no value."""
    lines = [f"{'size':<22}{'impl':<20}" + "".join(f"{header:>10}" for header, _, _ in COLUMNS)]
    for r in records:
        if "error" in r:
            cells = [f"  failed: {r['error'][:90]}"]
        else:
            cells = [f"{'-' if r.get(key) is None else format(r[key], fmt):>10}" for _, key, fmt in COLUMNS]
        lines.append(f"{r['size']:<22}{r['impl']:<20}" + "".join(cells))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tigon.bench.moe_ops", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", metavar="NxHxIxExK", default=["x".join(map(str, SIZES[0]))])
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--out", metavar="DIR", help="write moe_bench.json here")
    args = parser.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device)
    print(f"moe_experts side by side on {env['device']} (torch {env['torch']}, triton {env['triton']}, {dtype}); "
          "times in ms, fwd and fwd+bwd as launched, graph = fwd+bwd CUDA-graph replayed; ratios as launched")
    records = []
    for text in args.sizes:
        records += bench_side_by_side(parse_size(text), dtype, device, args.impls)
        print(format_side_by_side([r for r in records if r["size"] == text]))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "moe_bench.json").write_text(json.dumps({"environment": env, "results": records}, indent=1))
        print(f"wrote {out / 'moe_bench.json'}")
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    raise SystemExit(main())
