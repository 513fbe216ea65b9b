"""Timing on whatever device a tensor lives on, for the benchmarks (`tigon.bench`) and for the MFU
that training reports (`tigon.train`): the median time of a step, and the device rates measured
with it (dense matmul FLOP/s, copy bandwidth). Imports torch only (triton.testing on CUDA)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch


def time_ms(step: Callable[[], None], device: torch.device, leaves: Sequence[torch.Tensor] = (),
            graph: bool = False) -> float:
    """Median ms of `step`; the `.grad` of `leaves` is dropped before each call. On CUDA with
    `graph`, the calls are captured in a CUDA graph and replayed, so the time is the GPU's alone:
    what the work costs in a training step whose host runs ahead, rather than the Python and
    launch overhead that dominates a lone call of a small op. On a CPU, a wall-clock median."""
    leaves = list(leaves)
    if device.type == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph

        if graph:
            # Gradients are dropped inside the step: do_bench_cudagraph's own grad_to_none detaches
            # the leaves in place, which a leaf that is a view (a transposed q, say) refuses.
            def fresh_step() -> None:
                for leaf in leaves:
                    leaf.grad = None
                step()

            return float(do_bench_cudagraph(fresh_step, rep=100, return_mode="median"))
        return float(do_bench(step, warmup=25, rep=100, grad_to_none=leaves, return_mode="median"))
    for _ in range(2):
        step()
    samples = []
    for _ in range(5):
        for leaf in leaves:
            leaf.grad = None
        start = time.perf_counter()
        step()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def measure_bandwidth(device: torch.device) -> float:
    """Copy bandwidth in bytes/s (bytes read + written), measured now on `device`."""
    n = 2**28 if device.type == "cuda" else 2**24
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() * 4 / (ms * 1e-3)


def measure_matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """Dense matmul FLOP/s for `dtype` on `device`, measured now on random data."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    ms = time_ms(lambda: a @ b, device)
    return 2 * n**3 / (ms * 1e-3)
