"""A narrow product added onto a wide matrix, in place:

    add_low_rank_(out, a, b, alpha):  out += alpha · a bᵀ,   out (N × M), a (N × r), b (M × r), r small

The LoRA term of a projection whose base GEMM cannot accumulate (an FP8 GEMM writes its output
fresh) is added this way. The work is a read and a write of `out`; the product has r ≤ 128 terms
per element. cuBLAS's addmm with so short an inner dimension picks tiles made for long ones, and on
wide outputs (a gated MLP's gate and up, ~14K columns) it moves `out` at well under the memory's
bandwidth; here each program streams a tile of `out` through once, the product formed on chip
(BENCHMARKS.md has both, ``scripts/low_rank_bench.py``).

The sum is formed in fp32 and rounded once to out's dtype, as addmm's epilogue does; the product's
terms may be summed in another order than cuBLAS's, so results can differ from addmm's in the last
bit. NaN or inf anywhere propagates as in the product.
"""

from __future__ import annotations

import torch

from tigon.ops._dispatch import Op, tl, triton
from tigon.ops._launch import cdiv, launched, next_power_of_2

MAX_RANK = 128  # widest a (columns) the kernel takes in one tile; wider runs addmm
BLOCK_ROWS = 64
BLOCK_COLS = 128
NUM_WARPS = 4


@launched
@triton.jit
def _add_low_rank_kernel(out_ptr, a_ptr, b_ptr, n_rows, n_cols, rank, stride_out, stride_a, stride_b_col, stride_b_rank,
                         alpha, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_RANK: tl.constexpr,
                         IEEE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    ranks = tl.arange(0, BLOCK_RANK)
    row_mask, col_mask, rank_mask = rows < n_rows, cols < n_cols, ranks < rank
    a = tl.load(a_ptr + rows[:, None] * stride_a + ranks[None, :], mask=row_mask[:, None] & rank_mask[None, :],
                other=0.0)
    b = tl.load(b_ptr + cols[None, :] * stride_b_col + ranks[:, None] * stride_b_rank,
                mask=rank_mask[:, None] & col_mask[None, :], other=0.0)
    if IEEE:  # fp32 operands: full-precision products, as addmm's (not TF32)
        product = tl.dot(a, b, input_precision="ieee", out_dtype=tl.float32)
    else:
        product = tl.dot(a, b, out_dtype=tl.float32)
    mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows[:, None] * stride_out + cols[None, :]
    total = tl.load(out_ptr + offsets, mask=mask, other=0.0).to(tl.float32) + alpha * product
    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)


def add_low_rank_reference(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """``out.addmm_(a, bᵀ, alpha=alpha)``: the oracle and fallback of :func:`add_low_rank_`."""
    return out.addmm_(a, b.t(), alpha=alpha)


def _add_low_rank(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    n_rows, n_cols = out.shape
    rank = a.shape[1]
    # tl.dot takes an inner dimension of 16 or more: a narrower rank is padded with masked zeros.
    block_rank = max(16, next_power_of_2(rank))
    grid = (cdiv(n_rows, BLOCK_ROWS), cdiv(n_cols, BLOCK_COLS))
    _add_low_rank_kernel[grid](out, a, b, n_rows, n_cols, rank, out.stride(0), a.stride(0), b.stride(0), b.stride(1),
                               float(alpha), BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS, BLOCK_RANK=block_rank,
                               IEEE=out.dtype == torch.float32, num_warps=NUM_WARPS)
    return out


ADD_LOW_RANK = Op("add_low_rank", _add_low_rank, add_low_rank_reference)


def _unsupported(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> str | None:
    if a.shape[1] > MAX_RANK:
        return f"rank {a.shape[1]} is above {MAX_RANK}: addmm adds it"
    if out.stride(1) != 1 or a.stride(1) != 1 or a.dtype != out.dtype or b.dtype != out.dtype:
        return "operands that are not row-major (out, a) or not of out's dtype run addmm"
    return None


def add_low_rank_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``out += alpha · a bᵀ`` in place, and `out`. No autograd.

    Args:
        out: ``(N, M)``, unit stride along its columns.
        a: ``(N, r)``; r ≤ :data:`MAX_RANK` runs the kernel (wider: addmm).
        b: ``(M, r)``, any strides: a LoRA B matrix (``(out_features, r)``), or an A matrix
            transposed (``lora_a.t()``) for an input gradient.
        alpha: the product's multiplier (a LoRA scaling).
    """
    if out.dim() != 2 or a.dim() != 2 or b.dim() != 2 or a.shape[0] != out.shape[0] or b.shape[0] != out.shape[1] \
            or a.shape[1] != b.shape[1]:
        raise ValueError(f"add_low_rank_ takes out (N, M), a (N, r) and b (M, r), got out {tuple(out.shape)}, "
                         f"a {tuple(a.shape)} and b {tuple(b.shape)}")
    return ADD_LOW_RANK(_unsupported(out, a, b), out, a, b, alpha)
