"""The `tigon` command: thin argument parsing over tigon's library code."""

from __future__ import annotations

import argparse
import logging
import platform
import sys
from pathlib import Path
from typing import Callable

import torch

from tigon import _backend


def _cmd_env(args: argparse.Namespace) -> int:
    import tigon.functional  # noqa: F401  (imports every op, so each is registered)

    print(f"tigon      {__import__('tigon').__version__}")
    print(f"python     {platform.python_version()} ({platform.system()} {platform.machine()})")
    print(f"torch      {torch.__version__}")
    try:
        import triton

        print(f"triton     {triton.__version__}")
    except ImportError:
        print("triton     not installed")
    for name in ("transformers", "peft", "accelerate"):
        try:
            print(f"{name:<10} {__import__(name).__version__}")
        except ImportError:
            print(f"{name:<10} not installed")
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        major, minor = torch.cuda.get_device_capability(device)
        props = torch.cuda.get_device_properties(device)
        print(f"gpu        {props.name}, compute capability {major}.{minor}, "
              f"{props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs")
    else:
        device = torch.device("cpu")
        print("gpu        none (CUDA not available)")
    if _backend.INTERPRET:
        print("mode       TRITON_INTERPRET=1: kernels run in Triton's CPU interpreter (slow; for tests)")
    print(f"\nops on {device}:")
    for op in _backend.OPS:
        reason = _backend.why_not_triton(op, device)
        print(f"  {op:<22} {'triton' if reason is None else 'reference: ' + reason}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from tigon.bench import run_benchmarks
    from tigon.bench.registry import parse_size

    sizes = [parse_size(s) for s in args.sizes] if args.sizes else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    run_benchmarks(ops=args.ops, sizes=sizes, dtype=dtype, out_dir=Path(args.out) if args.out else None)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tigon", description="Fused Triton kernels for LLM fine-tuning.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)

    env = sub.add_parser("env", help="versions, GPU, and which ops run as Triton here (and why not)")
    env.set_defaults(run=_cmd_env)

    bench = sub.add_parser("bench", help="time ops against PyTorch eager and torch.compile")
    bench.add_argument("--ops", nargs="+", metavar="OP", help="ops to run (default: all registered)")
    bench.add_argument("--sizes", nargs="+", metavar="RxC", help="sizes such as 16384x4096 (default: each op's sweep)")
    bench.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    bench.add_argument("--out", metavar="DIR", help="write bench.json and one PNG plot per op here")
    bench.set_defaults(run=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as err:
        if args.debug:
            raise
        print(f"tigon {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
