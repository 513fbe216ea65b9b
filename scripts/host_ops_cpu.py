"""Host time of one forward + backward call of each op with every Triton launch stubbed out, on
the CPU: the Python path from the public function to the launches, tigon's against Liger-Kernel's
(when importable) and eager PyTorch's, at `tigon bench --host`'s sizes, the implementations taken
in turn round by round. Not a GPU measurement (no CUDA allocations or launches): a way to see on a
machine without one what the Python costs, and where.

    PYTHONPATH=src python scripts/host_ops_cpu.py [rope swiglu ...] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import os
import pkgutil
import pstats
import statistics
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # tigon's kernel path on CPU tensors (the launches are stubbed)

import torch  # noqa: E402

import tigon.bench.ops  # noqa: E402,F401  (registers the bench ops)
import tigon.ops  # noqa: E402
from tigon.bench.harness import differentiable_outputs, fwd_bwd_step  # noqa: E402
from tigon.bench.host import HOST_SIZES  # noqa: E402
from tigon.bench.registry import BENCH_OPS  # noqa: E402

_KERNEL_TYPES = ("JITFunction", "InterpretedFunction", "PreboundKernel", "Autotuner", "Heuristics")


class _NoLaunch:
    """Stands for a launched Triton kernel: ``kernel[grid](*args)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_launches(package) -> int:
    """Replace every Triton kernel that a module of `package` holds by a no-op; how many."""
    modules = [package] + [importlib.import_module(f"{package.__name__}.{info.name}")
                           for info in pkgutil.walk_packages(package.__path__) if not info.ispkg]
    count = 0
    for module in modules:
        for name, value in list(vars(module).items()):
            if type(value).__name__ in _KERNEL_TYPES:
                setattr(module, name, _NoLaunch())
                count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ops", nargs="*", default=list(HOST_SIZES))
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="cProfile's top entries for tigon's call")
    args = parser.parse_args()
    stub_launches(tigon.ops)
    try:
        import liger_kernel.ops
    except ImportError:
        print("Liger-Kernel is not importable: no peer column", file=sys.stderr)
    else:
        stub_launches(liger_kernel.ops)
    print(f"{'op':<16}{'tigon us':>10}{'peer us':>10}{'eager us':>10}{'tigon/peer':>12}")
    for name in args.ops:
        op = BENCH_OPS[name]
        torch.manual_seed(0)
        inputs = op.make_inputs(HOST_SIZES[name], torch.float32, torch.device("cpu"))
        leaves = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
        grads = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in differentiable_outputs(op.eager(*inputs))]
        steps = {"tigon": fwd_bwd_step(op.tigon, inputs, grads), "eager": fwd_bwd_step(op.eager, inputs, grads)}
        if op.peer is not None and "liger_kernel" in sys.modules:
            steps["peer"] = fwd_bwd_step(op.peer(), inputs, grads)
        samples: dict[str, list[float]] = {impl: [] for impl in steps}
        for round_ in range(args.rounds + 1):
            for impl, step in steps.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    for leaf in leaves:
                        leaf.grad = None
                    step()
                if round_:  # the first round warms caches
                    samples[impl].append((time.perf_counter() - start) / args.calls * 1e6)
        us = {impl: statistics.median(s) for impl, s in samples.items()}
        peer = us.get("peer", float("nan"))
        print(f"{name:<16}{us['tigon']:>10.1f}{peer:>10.1f}{us['eager']:>10.1f}{us['tigon'] / peer:>11.2f}x")
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.calls):
                steps["tigon"]()
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
