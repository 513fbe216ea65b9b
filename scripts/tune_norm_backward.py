"""Sweep launch configs of the norm backward kernels on the GPU (one device call).

Prints the median backward time per (tile rows, warps, programs per SM) for a few shapes, and the
bandwidth-floor time, so the defaults in tigon/ops/_launch.py can be chosen from measurements.
Times are CUDA-graph replays (GPU time, no launch overhead).

Usage: PYTHONPATH=src python3 scripts/tune_norm_backward.py [ROWSxCOLS ...] [--rms-only]
"""

import itertools
import sys

import torch
from triton.testing import do_bench_cudagraph

from tigon.ops import layer_norm as ln
from tigon.ops import rms_norm as rn

SHAPES = [(16384, 4096), (4096, 16384), (16384, 1024)]
ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
if ARGS:
    SHAPES = [tuple(int(d) for d in a.split("x")) for a in ARGS]
BANDWIDTH = 4.3e12
# What rms_norm's backward picks today, printed after the best ones for comparison.
CURRENT = {(r, c): (rn._backward_block_config(c)[0], rn._backward_block_config(c)[2], 2) for r, c in SHAPES}


def sweep(module, run_backward, shapes):
    for rows, cols in shapes:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        floor_ms = 3 * x.numel() * 2 / BANDWIDTH * 1e3
        results = []
        block_cols = 1 << (cols - 1).bit_length()
        for tile_rows, warps, per_sm in itertools.product([1, 2, 4, 8], [4, 8, 16, 32], [1, 2, 4, 8, 16]):
            if tile_rows * block_cols > 65536 or tile_rows * block_cols < 32 * warps:
                continue
            # rms_norm's backward has its own tiles; layer_norm's are the forward's.
            config_name = "_backward_block_config" if hasattr(module, "_backward_block_config") else "row_block_config"
            setattr(module, config_name, lambda n, tr=tile_rows, w=warps: (tr, block_cols, w))
            module.persistent_programs = lambda nb, dev, p=per_sm: max(1, min(nb, p * 132))
            try:
                ms = do_bench_cudagraph(lambda: run_backward(x, dy), rep=40)
            except Exception as err:  # out of resources for this config
                print(f"  {tile_rows=} {warps=} {per_sm=}: {type(err).__name__}", file=sys.stderr)
                continue
            results.append((ms, tile_rows, warps, per_sm))
        results.sort()
        print(f"{run_backward.__name__} {rows}x{cols}: floor {floor_ms:.3f} ms; best:")
        for ms, tile_rows, warps, per_sm in results[:6] + [r for r in results if r[1:] == CURRENT.get((rows, cols))]:
            print(f"   {ms:.3f} ms ({100 * floor_ms / ms:.0f}% roofline)  tile_rows={tile_rows} warps={warps} per_sm={per_sm}")


def rms_backward(x, dy):
    w = torch.ones(x.shape[1], device="cuda", dtype=x.dtype)
    rstd = torch.ones(x.shape[0], device="cuda", dtype=torch.float32)
    rn.rms_norm_backward(dy, None, x, w, rstd, 0.0, "llama", True)


def ln_backward(x, dy):
    w = torch.ones(x.shape[1], device="cuda", dtype=x.dtype)
    stat = torch.ones(x.shape[0], device="cuda", dtype=torch.float32)
    ln.layer_norm_backward(dy, x, w, w, stat, stat, True, True)


def add_rms_backward(x, dy):
    w = torch.ones(x.shape[1], device="cuda", dtype=x.dtype)
    rstd = torch.ones(x.shape[0], device="cuda", dtype=torch.float32)
    rn.rms_norm_backward(dy, dy, x, w, rstd, 0.0, "llama", True)


if __name__ == "__main__":
    sweep(rn, rms_backward, SHAPES)
    if "--rms-only" in sys.argv:
        sweep(rn, add_rms_backward, SHAPES)
    else:
        sweep(ln, ln_backward, SHAPES[:1])
