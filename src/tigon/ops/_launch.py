"""Launch shapes shared by the kernels."""

from __future__ import annotations

import functools

import torch


# Host-side integer helpers for launch shapes. triton.cdiv / triton.next_power_of_2 are constexpr
# functions whose wrapper costs microseconds per call (4 us on a 2026 CPU), several times per op.
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= `n` (n >= 1)."""
    return 1 << (int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)  # called on every launch; a pure function of the width
def row_block_config(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_COLS, num_warps) for a kernel that holds whole rows in registers.

    Narrow rows are batched so each program moves at least ~2K elements; warps grow with the tile
    so each thread keeps a few 16-byte vectors in flight. On the H200 (2026-11-29 sweep,
    scripts/tune_norm_backward.py) 16 warps beat 32 up to 16K-wide rows; only wider rows need 32
    to keep the row in registers.
    """
    block_cols = next_power_of_2(n_cols)
    block_rows = max(1, 2048 // block_cols)
    max_warps = 16 if block_cols <= 16384 else 32
    num_warps = min(max_warps, max(1, block_rows * block_cols // 512))
    return block_rows, block_cols, num_warps


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors on `device`; a small number on CPU so persistent kernels still
    run several programs under the interpreter."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def persistent_programs(n_blocks: int, device: torch.device) -> int:
    """Programs for a persistent kernel over `n_blocks` row blocks: two per multiprocessor at most."""
    return max(1, min(n_blocks, 2 * multiprocessor_count(device)))
