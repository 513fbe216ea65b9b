"""The FP8 input gradient's weight transpose (`tigon.ops.fp8.transpose_bytes`) against torch's
``data.t().contiguous()``, at the Llama-3-8B projection shapes, with a few tile sizes and warp
counts: ms (CUDA events, median) and GB/s (bytes read + written).

Usage (GPU): PYTHONPATH=src python3 scripts/fp8_transpose_bench.py
"""

import sys

import torch

from tigon.ops import fp8
from tigon.timing import time_ms

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]  # (out, in): q/o, k/v, gate/up, down
CONFIGS = [(128, 8), (128, 4), (64, 4), (64, 2), (256, 8)]  # (tile side, warps)


def main() -> None:
    device = torch.device("cuda")
    default = (fp8.TRANSPOSE_TILE, fp8.TRANSPOSE_WARPS)
    print(f"{'shape':<14}{'torch ms':>10}{'GB/s':>8}" + "".join(f"{f'{t}x{t}/{w}w ms':>16}{'GB/s':>8}" for t, w in CONFIGS))
    for rows, cols in SHAPES:
        data = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
        out = torch.empty((cols, rows), dtype=data.dtype, device=device)
        want = data.view(torch.uint8).t().contiguous()
        gb = 2 * data.numel() / 1e9
        torch_ms = time_ms(lambda: out.copy_(data.t()), device)
        line = f"{rows}x{cols:<9}{torch_ms:>10.3f}{gb / torch_ms * 1e3:>8.0f}"
        for tile, warps in CONFIGS:
            fp8.TRANSPOSE_TILE, fp8.TRANSPOSE_WARPS = tile, warps
            try:
                fp8.transpose_bytes(data, out)
                assert torch.equal(out.view(torch.uint8), want), (tile, warps)
                ms = time_ms(lambda: fp8.transpose_bytes(data, out), device)
            finally:
                fp8.TRANSPOSE_TILE, fp8.TRANSPOSE_WARPS = default
            line += f"{ms:>16.3f}{gb / ms * 1e3:>8.0f}"
        print(line)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("fp8_transpose_bench.py: needs a CUDA GPU (none is visible here)")
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
