"""Host time of one rope forward + backward call with the Triton launch stubbed out, on the CPU:
the Python path from ``tigon.functional.rope`` to the launch, tigon's against Liger-Kernel's (when
importable), at the `tigon bench --host` size. Not a GPU measurement: a way to see on a machine
without one what the host path costs, and where.

    PYTHONPATH=src python scripts/host_rope_cpu.py [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

os.environ["TRITON_INTERPRET"] = "1"  # tigon's kernel path on CPU tensors (the launch itself is stubbed)

import torch  # noqa: E402

import tigon.functional as F  # noqa: E402
import tigon.ops.rope as tigon_rope


class _NoLaunch:
    """Stands for a @triton.jit kernel: ``kernel[grid](*args)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _per_call_us(step, calls: int = 3000, rounds: int = 5) -> float:
    for _ in range(200):
        step()
    best = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        best.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(best)[len(best) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", action="store_true", help="print cProfile's top entries for tigon's call")
    args = parser.parse_args()
    q = torch.randn(1, 4, 16, 64, requires_grad=True)
    k = torch.randn(1, 2, 16, 64, requires_grad=True)
    cos, sin = torch.randn(1, 16, 64), torch.randn(1, 16, 64)
    grads = (torch.randn(1, 4, 16, 64), torch.randn(1, 2, 16, 64))
    tigon_rope._rope_kernel = _NoLaunch()

    def tigon_step():
        torch.autograd.backward(F.rope(q, k, cos, sin), grads)

    print(f"tigon  {_per_call_us(tigon_step):7.1f} us per fwd+bwd call")
    try:
        import liger_kernel.ops.rope as liger_rope
    except ImportError:
        liger_rope = None
    if liger_rope is not None:
        liger_rope._triton_rope = _NoLaunch()

        def liger_step():
            torch.autograd.backward(liger_rope.LigerRopeFunction.apply(q, k, cos, sin), grads)

        print(f"peer   {_per_call_us(liger_step):7.1f} us per fwd+bwd call")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(3000):
            tigon_step()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
