"""Timing on whatever device a tensor lives on, for the benchmarks (`tigon.bench`) and for the MFU
that training reports (`tigon.train`): the median time of a step, and the device rates measured
with it (dense matmul FLOP/s, copy bandwidth), and how busy the GPU was while a loop ran. Imports
torch only (triton.testing on CUDA)."""

from __future__ import annotations

import statistics
import threading
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


def _gpu_utilisation() -> float | None:
    try:
        return float(torch.cuda.utilization())
    except Exception:  # needs pynvml (or amdsmi); utilisation is a nicety, not a requirement
        return None


class BusyMeter:
    """The fraction of wall time the GPU was running a kernel, from a thread that samples the
    driver's utilisation counter (NVML: the share of its last sample period, 1/6 s to 1 s, in which
    any kernel ran) every `interval` seconds. Nothing in the training loop waits for it or for the
    GPU: after the probe in `start`, every read happens on the meter's thread (one read can take
    tens of milliseconds: torch initialises NVML on each call). CUDA events cannot give this: an
    event pair times the span between two points of a stream, idle gaps included, so a step whose
    GPU waits for the host between kernels would read as busy. `read` returns a percentage or None
    (no NVML: the meter never starts)."""

    def __init__(self, read=_gpu_utilisation, interval: float = 0.2):
        self.read, self.interval = read, interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._window = [0.0, 0]  # sum and count of samples since the last `window()`
        self._total = [0.0, 0]
        self._latest: float | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Start sampling; False (and nothing started) where utilisation cannot be read."""
        if self.read() is None:
            return False
        self._thread = threading.Thread(target=self._sample, name="tigon-gpu-busy", daemon=True)
        self._thread.start()
        return True

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            value = self.read()
            if value is None:
                continue
            with self._lock:
                self._latest = value
                for acc in (self._window, self._total):
                    acc[0] += value
                    acc[1] += 1

    def window(self) -> float | None:
        """Mean busy % since the last call. A window shorter than the interval, with no sample of
        its own, repeats the latest sample (the counter's sample period spans the recent past);
        None before the first sample and once stopped."""
        with self._lock:
            total, n = self._window
            self._window = [0.0, 0]
            latest = self._latest
        if n:
            return total / n
        return latest if self._thread is not None and not self._stop.is_set() else None

    def overall(self) -> float | None:
        """Mean busy % since `start`."""
        with self._lock:
            total, n = self._total
        return total / n if n else None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)
