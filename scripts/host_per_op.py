"""Host cost (microseconds per call) of tigon's ops, each call issued on an idle GPU so that a full
launch queue never holds the host up: what each costs the CPU to issue, next to the PyTorch calls
it replaces (scripts/host_time.py does the same for a whole training step). Where a training step's host time exceeds its GPU time (a slow host, a small model) this
is what sets the step time.

Usage (GPU): PYTHONPATH=src python3 scripts/host_per_op.py [real] [--profile SUBSTRING ...]
--profile also prints, for each case whose name contains a SUBSTRING, the Python functions with the
most own time over 200 calls.
"""

import argparse
import cProfile
import pstats
import statistics
import time

import torch
import triton
import triton.language as tl

from tigon import functional as F

device = torch.device("cuda")
dtype = torch.bfloat16


def host_us(fn, calls: int = 200) -> float:
    """Median host time of one call issued on an idle GPU (so a full launch queue never blocks it)."""
    fn()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


# Tiny shapes by default; "real" gives tigon bench --e2e's (Llama-3.2-1B, 4 x 2048 tokens).
parser = argparse.ArgumentParser()
parser.add_argument("shapes", nargs="?", choices=("tiny", "real"), default="tiny")
parser.add_argument("--profile", nargs="+", default=[], metavar="SUBSTRING")
args = parser.parse_args()
REAL = args.shapes == "real"
rows, hidden, inter, kv = (8192, 2048, 8192, 512) if REAL else (64, 256, 512, 64)
x = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
res = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
w = torch.randn(hidden, device=device, dtype=dtype, requires_grad=True)
W = torch.randn(hidden, hidden, device=device, dtype=dtype, requires_grad=True)
Wk = torch.randn(kv, hidden, device=device, dtype=dtype, requires_grad=True)
Wg, Wu = (torch.randn(inter, hidden, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
Wd = torch.randn(hidden, inter, device=device, dtype=dtype, requires_grad=True)
q = torch.randn(1, hidden // 64, rows, 64, device=device, dtype=dtype, requires_grad=True)
k = torch.randn(1, kv // 64, rows, 64, device=device, dtype=dtype, requires_grad=True)
cos, sin = torch.randn(1, rows, 64, device=device, dtype=dtype), torch.randn(1, rows, 64, device=device, dtype=dtype)
flat, out = torch.randn(4096, device=device), torch.empty(4096, device=device)

cases = {
    "torch add": lambda: x + res,
    "torch.empty like x": lambda: torch.empty_like(x),
    "torch F.linear": lambda: torch.nn.functional.linear(x, W),
    "torch 3 x F.linear (q/k/v)": lambda: [torch.nn.functional.linear(x, m) for m in (W, Wk, Wk)],
    "empty autograd Function": lambda: _Identity.apply(x),
    "bare Triton launch (4 args)": lambda: _copy_kernel[(4,)](flat, out, 4096, BLOCK=1024),
    "tigon rms_norm": lambda: F.rms_norm(x, w),
    "tigon add_rms_norm": lambda: F.add_rms_norm(x, res, w),
    "tigon rope": lambda: F.rope(q, k, cos, sin),
    "tigon linear_group (q/k/v)": lambda: F.linear_group(x, [W, Wk, Wk]),
    "tigon glu_mlp": lambda: F.glu_mlp(x, Wg, Wu, Wd),
    "torch MLP (3 linears, silu, mul)": lambda: torch.nn.functional.linear(
        torch.nn.functional.silu(torch.nn.functional.linear(x, Wg)) * torch.nn.functional.linear(x, Wu), Wd),
}
for name, fn in cases.items():
    print(f"{name:<36}{host_us(fn):8.1f} us")
with torch.no_grad():
    print(f"{'tigon rms_norm, no grad':<36}{host_us(lambda: F.rms_norm(x, w)):8.1f} us")
for name, fn in cases.items():
    if not any(part in name for part in args.profile):
        continue
    profiler = cProfile.Profile()
    for _ in range(200):
        torch.cuda.synchronize()
        profiler.enable()
        fn()
        profiler.disable()
    print(f"-- {name}: 200 calls, by own time")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(15)

