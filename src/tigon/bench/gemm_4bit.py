"""The fused 4-bit GEMM beside dequantise + cuBLAS, per projection shape and token count.

For a bitsandbytes NF4 weight (double quantisation, blocks of 64) and bf16 activations (or
--dtype fp16), the forward GEMM ``x · Wᵀ`` and the input gradient's ``dy · W``, each timed
graph-replayed (the GPU's time) and as launched (host included), by:

    fused          tigon's fused 4-bit GEMM (tiles dequantised in registers), whatever the rule says
    tigon-dequant  tigon's dequantisation into its reused buffer, then cuBLAS
    bnb-dequant    bitsandbytes' dequantize_4bit, then cuBLAS (what PEFT + bitsandbytes runs)
    eager          tigon's PyTorch reference (dequantise by torch ops, then cuBLAS)
    compile        torch.compile of the reference
    bf16-gemm      cuBLAS on a bf16 copy of W made beforehand: the floor no 4-bit path can beat

and prints, per row, fused / bnb-dequant and fused / tigon-dequant (graph-replayed; the issue's
target is fused <= 0.8 x bnb-dequant), the fused GEMM's time as a % of bf16-gemm's, and which path
:func:`tigon.ops.gemm_4bit.fused_4bit` picks now. The "fused/tigon" ratio is what
``FUSED_TOKENS_UP_TO`` in ``tigon/ops/gemm_4bit.py`` is filled from::

    python -m tigon.bench.gemm_4bit --shapes 4096x4096 --tokens 256 1024 2048 8192
    python -m tigon.bench.gemm_4bit --shapes 70b --impls fused tigon-dequant bnb-dequant bf16-gemm

The first call of each (shape, token bucket) autotunes the fused kernel (cached on disk after).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tigon.bench.harness import environment
from tigon.ops.dequantize import dequantize_reference
from tigon.ops.gemm_4bit import dequantized_gemm, fused_4bit, fused_gemm
from tigon.patch.quantized import from_4bit
from tigon.timing import time_ms

SHAPES = {  # (out, in) of each projection
    "8b": [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)],  # q/o, gate/up, down, k/v
    "70b": [(8192, 8192), (28672, 8192), (8192, 28672), (1024, 8192)],
}
TOKENS = (256, 1024, 2048, 8192)
IMPLS = ("fused", "tigon-dequant", "bnb-dequant", "eager", "compile", "bf16-gemm")
PASSES = ("forward", "input-grad")


def _implementations(weight, data, state, dense: torch.Tensor) -> dict[str, Callable]:
    """impl -> f(a, backward) giving ``a · Wᵀ`` (or ``a · W`` when `backward`)."""
    import bitsandbytes.functional as bnb

    def oriented(w: torch.Tensor, backward: bool) -> torch.Tensor:
        return w if backward else w.t()

    def reference(a: torch.Tensor, backward: bool) -> torch.Tensor:
        return a @ oriented(dequantize_reference(weight, a.dtype), backward)

    compiled = torch.compile(reference)
    return {
        "fused": lambda a, backward: fused_gemm(a, weight, backward),
        "tigon-dequant": lambda a, backward: dequantized_gemm(a, weight, backward),
        "bnb-dequant": lambda a, backward: a @ oriented(bnb.dequantize_4bit(data, state), backward),
        "eager": reference,
        "compile": compiled,
        "bf16-gemm": lambda a, backward: a @ oriented(dense, backward),
    }


def bench_shape(shape: tuple[int, int], tokens_list: Sequence[int], impls: Sequence[str],
                device: torch.device, dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Any]]:
    """One record per (token count, pass): each implementation's graph-replayed and launched ms,
    the ratios, and the fused output's relative error against the bf16-gemm path (bitsandbytes'
    dequantised weight, cuBLAS), with activations and weight of `dtype`."""
    import bitsandbytes.functional as bnb

    torch.manual_seed(0)
    out_features, in_features = shape
    master = torch.randn(out_features, in_features, device=device, dtype=dtype) * in_features**-0.5
    data, state = bnb.quantize_4bit(master, blocksize=64, quant_type="nf4", compress_statistics=True)
    del master
    weight = from_4bit(data, state)
    dense = bnb.dequantize_4bit(data, state)
    fns = _implementations(weight, data, state, dense)
    records = []
    for tokens in tokens_list:
        for backward in (False, True):
            a = torch.randn(tokens, out_features if backward else in_features, device=device, dtype=dtype)
            record: dict[str, Any] = {"shape": f"{out_features}x{in_features}", "tokens": tokens,
                                      "pass": PASSES[backward], "rule": "fused" if fused_4bit(tokens, *shape, backward)
                                      else "dequant"}
            for impl in impls:
                fn = fns[impl]
                try:
                    got = fn(a, backward)  # compiles, autotunes: before any capture
                    if impl == "fused":
                        want = fns["bf16-gemm"](a, backward).float()
                        record["fused_rel_err"] = ((got.float() - want).norm() / want.norm()).item()
                    step = lambda fn=fn: fn(a, backward)  # noqa: E731
                    record[f"{impl}_graph_ms"] = time_ms(step, device, graph=True)
                    record[f"{impl}_launch_ms"] = time_ms(step, device)
                except Exception as err:  # one failing implementation must not hide the others' numbers
                    record[f"{impl}_failed"] = f"{type(err).__name__}: {err}"[:200]
            for mode in ("graph", "launch"):
                fused = record.get(f"fused_{mode}_ms")
                for base in ("bnb-dequant", "tigon-dequant", "bf16-gemm"):
                    if fused is not None and record.get(f"{base}_{mode}_ms"):
                        record[f"fused_vs_{base}_{mode}"] = fused / record[f"{base}_{mode}_ms"]
            records.append(record)
            print(format_record(record, impls), flush=True)
            for impl in impls:
                if f"{impl}_failed" in record:
                    print(f"    {impl} failed: {record[f'{impl}_failed']}")
    return records


def header(impls: Sequence[str]) -> str:
    return (f"{'shape':<12}{'tokens':>7} {'pass':<11}{'rule':<8}" + "".join(f"{impl:>14}" for impl in impls)
            + f"{'f/bnb':>8}{'f/tigon':>8}{'%bf16':>7}{'f/bnb L':>9}{'err':>9}")


def format_record(r: dict[str, Any], impls: Sequence[str]) -> str:
    """Graph-replayed ms per implementation, then fused/bnb-dequant and fused/tigon-dequant
    (graph), fused as a % of the bf16 GEMM, fused/bnb-dequant as launched, the fused error."""
    def cell(key: str, fmt: str, width: int, scale: float = 1.0) -> str:
        value = r.get(key)
        return f"{'-' if value is None else format(value * scale, fmt):>{width}}"

    cells = "".join(f"{'failed':>14}" if f"{impl}_failed" in r else cell(f"{impl}_graph_ms", ".4f", 14) for impl in impls)
    return (f"{r['shape']:<12}{r['tokens']:>7} {r['pass']:<11}{r['rule']:<8}{cells}"
            + cell("fused_vs_bnb-dequant_graph", ".3f", 8) + cell("fused_vs_tigon-dequant_graph", ".3f", 8)
            + cell("fused_vs_bf16-gemm_graph", ".0f", 7, 100) + cell("fused_vs_bnb-dequant_launch", ".3f", 9)
            + cell("fused_rel_err", ".1e", 9))


def _shapes(texts: Sequence[str]) -> list[tuple[int, int]]:
    shapes = []
    for text in texts:
        if text in SHAPES:
            shapes += SHAPES[text]
            continue
        try:
            out_features, in_features = (int(part) for part in text.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--shapes takes 8b, 70b or OUTxIN such as 14336x4096, got {text!r}") from None
        shapes.append((out_features, in_features))
    return shapes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tigon.bench.gemm_4bit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["8b"], metavar="OUTxIN",
                        help="8b, 70b (each model's four projection shapes) or OUTxIN (default: 8b)")
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS), metavar="N")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="activations' dtype (default: bf16)")
    parser.add_argument("--out", metavar="DIR", help="write gemm_4bit_bench.json here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m tigon.bench.gemm_4bit needs a CUDA GPU (the fused kernel and bitsandbytes' CUDA path)")
        return 1
    if any(n < 1 for n in args.tokens):
        print(f"--tokens must be positive, got {args.tokens}")
        return 1
    device = torch.device("cuda")
    # One compiled reference per shape, each recompiled per pass and token count: more than
    # dynamo's default limit of recompilations for one function, past which it would run eagerly.
    torch._dynamo.config.recompile_limit = 64
    impls = list(dict.fromkeys(["fused", *args.impls]))
    env = environment(device)
    print(f"{env['device']}  torch {env['torch']}  triton {env['triton']}  (ms graph-replayed; "
          "f/bnb L: as launched)")
    print(header(impls))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    records = [r for shape in _shapes(args.shapes) for r in bench_shape(shape, args.tokens, impls, device, dtype)]
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gemm_4bit_bench.json").write_text(json.dumps({"environment": env, "results": records}, indent=1))
        print(f"wrote {out / 'gemm_4bit_bench.json'}")
    return 1 if any(key.endswith("_failed") for r in records for key in r) else 0


if __name__ == "__main__":
    raise SystemExit(main())
