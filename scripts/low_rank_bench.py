"""The LoRA term added onto an FP8 base GEMM's output (`tigon.ops.low_rank.add_low_rank_`) against
cuBLAS's ``out.addmm_(a, b.t())``, at the Llama-3-8B shapes of a 4 x 2048 batch, with a few tile
sizes: ms (CUDA events, median), GB/s (out read and written) and the largest difference from addmm.

`a` is a column slice of a wider product, as the LoRA group passes it (``x [A_gate; A_up]ᵀ``).

Usage (GPU): PYTHONPATH=src python3 scripts/low_rank_bench.py
"""

import sys

import torch

from tigon.ops import low_rank
from tigon.timing import time_ms

# (rows, out columns, rank, columns of the product `a` is sliced from): gate/up forward (r 16, 64),
# q/o and the input gradient (4096 wide), k/v (1024)
SHAPES = [(8192, 14336, 16, 32), (8192, 14336, 64, 128), (8192, 4096, 16, 48), (8192, 4096, 32, 32),
          (8192, 1024, 16, 48)]
CONFIGS = [(64, 128, 4), (128, 128, 8), (64, 256, 8), (32, 256, 4)]  # (rows, columns, warps)


def main() -> None:
    device = torch.device("cuda")
    default = (low_rank.BLOCK_ROWS, low_rank.BLOCK_COLS, low_rank.NUM_WARPS)
    print(f"{'shape':<22}{'addmm ms':>10}{'GB/s':>7}" + "".join(f"{f'{r}x{c}/{w}w ms':>15}{'GB/s':>7}{'diff':>9}"
                                                             for r, c, w in CONFIGS))
    for rows, cols, rank, wide in SHAPES:
        out = torch.randn(rows, cols, device=device, dtype=torch.bfloat16)
        a = torch.randn(rows, wide, device=device, dtype=torch.bfloat16)[:, :rank]
        b = torch.randn(cols, rank, device=device, dtype=torch.bfloat16) * 0.05
        base = out.clone()  # the timed calls keep adding onto out
        want = base.clone().addmm_(a, b.t(), alpha=2.0)
        gb = 2 * out.numel() * out.element_size() / 1e9
        addmm_ms = time_ms(lambda: out.addmm_(a, b.t(), alpha=2.0), device)
        line = f"{rows}x{cols} r{rank:<8}{addmm_ms:>10.3f}{gb / addmm_ms * 1e3:>7.0f}"
        for block_rows, block_cols, warps in CONFIGS:
            low_rank.BLOCK_ROWS, low_rank.BLOCK_COLS, low_rank.NUM_WARPS = block_rows, block_cols, warps
            try:
                got = low_rank.add_low_rank_(base.clone(), a, b, 2.0)
                diff = (got.float() - want.float()).abs().max().item()
                ms = time_ms(lambda: low_rank.add_low_rank_(out, a, b, 2.0), device)
            finally:
                low_rank.BLOCK_ROWS, low_rank.BLOCK_COLS, low_rank.NUM_WARPS = default
            line += f"{ms:>15.3f}{gb / ms * 1e3:>7.0f}{diff:>9.2g}"
        print(line)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("low_rank_bench.py: needs a CUDA GPU (none is visible here)")
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
