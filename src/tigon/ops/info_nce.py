"""InfoNCE with in-batch negatives over embeddings, without the similarity matrix.

    s_ij   = <q_i, d_j> / T                       q: (B, D) queries, d: (N, D) documents, N >= B
    loss_i = logsumexp_j s_ij - s_ii              row i's positive is document i; documents B..N-1
                                                  (hard negatives) are negatives of every row

(sentence-transformers' MultipleNegativesRankingLoss with ``scale = 1 / T``, per row). With
``symmetric`` each row also gets the document-to-query loss over the B x B block,
``logsumexp_i s_ij - s_jj`` for document j = i, and the two are averaged (its symmetric variant).

The caller normalises: this op takes the embeddings as they are, so cosine similarity is
``info_nce(F.normalize(q, dim=-1), F.normalize(d, dim=-1), ...)``. Normalising is cheap and
elementwise, autograd differentiates it, and Matryoshka training needs each truncation
renormalised anyway (``F.normalize(q[:, :k])``): inside the kernel it would be one more option
for no saving.

Two paths, chosen by the size of the ``B x N`` similarity matrix against `max_chunk_bytes` (the
most B x N-shaped memory the op may hold; 64 MiB by default):

* **scores** (the matrix in fp32 fits, ``B * N * 4 <= max_chunk_bytes``: B = N <= 4096 by default):
  one cuBLAS GEMM writes the fp32 similarities (a 16-bit GEMM accumulating in fp32), one row kernel
  takes each row's log-sum-exp and positive in one read, and backward's row kernel turns the
  saved matrix into ``dS = g_i (p_ij - [j == i]) / T`` for the two gradient GEMMs. Three GEMMs in
  all, as torch.compile of the reference does, and no recomputation: for these sizes the matrix
  is small beside the GEMMs over D (4096 x 4096 fp32 is 64 MiB; D is 2048..4096 for LLM embedders).
* **fused** (larger matrices, or a smaller `max_chunk_bytes`): never the B x N matrix in forward.
  One program per block of query rows (and split of the documents, for batches of few blocks)
  walks the documents in column tiles, forms each
  ``BLOCK_M x BLOCK_N`` tile of similarities in registers (fp32 ``tl.dot`` over D in slices) and
  keeps an online softmax (running max and sum) and the positive as its tile passes: it writes
  the fp32 log-sum-exp and positive of each row, O(B). Backward recomputes the tiles from q, d and
  the saved log-sum-exp and writes dS for one chunk of rows at a time (at most `max_chunk_bytes`),
  which two cuBLAS GEMMs turn into ``dq = dS d`` and ``dd += dS^T q``. A backward that kept dq's
  ``BLOCK_M x D`` accumulator in registers, as flash attention does for heads of 64..256, cannot
  hold D = 2048..4096: it would recompute each tile D / BLOCK_D times, where the chunk costs
  memory only.

The fused path does four GEMMs' work (the recomputation is the fourth) against the scores path's
three, so at sizes where the matrix fits it is the slower one: it pays in memory, for batches
whose B x N matrix would be large (tens of thousands of rows, cached negatives).
"""

from __future__ import annotations

import torch

from tigon.ops._checks import check_device, check_float
from tigon.ops._dispatch import Op, backward_fallback, tl, triton
from tigon.ops._launch import cdiv, multiprocessor_count

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64  # tl.dot takes 16 rows at least
NUM_WARPS = 4
DEFAULT_MAX_CHUNK_BYTES = 64 << 20


@triton.jit
def _similarity_tile(q_ptr, d_ptr, rows, cols, n_q, n_d, dim, q_stride, d_stride, scale,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRECISION: tl.constexpr):
    """fp32 ``q[rows] . d[cols]^T * scale`` (-inf in columns past the documents)."""
    row_mask, col_mask = rows < n_q, cols < n_d
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < dim
        a = tl.load(q_ptr + rows[:, None] * q_stride + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        # Rows of d read along D (coalesced), transposed in registers for the product.
        b = tl.load(d_ptr + cols[:, None] * d_stride + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    return tl.where(col_mask[None, :], acc * scale, float("-inf"))


@triton.jit
def _info_nce_fwd_kernel(
    q_ptr, d_ptr, lse_ptr, pos_ptr,
    n_q, n_d, dim, q_stride, d_stride, scale, split_cols,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """Rows' log-sum-exp and positive over the documents of split ``program_id(1)`` (`split_cols`
    columns, a multiple of BLOCK_N), written to that split's row of lse and positive."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1).to(tl.int64)
    first = split * split_cols
    running_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    positive = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n0 in range(first, tl.minimum(first + split_cols, n_d), BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        s = _similarity_tile(q_ptr, d_ptr, rows, cols, n_q, n_d, dim, q_stride, d_stride, scale,
                             BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        positive += tl.sum(tl.where(cols[None, :] == rows[:, None], s, 0.0), axis=1)
        # A NaN similarity makes the sum NaN whether or not the max skips it (and stays there).
        new_max = tl.maximum(running_max, tl.max(s, axis=1))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(s - new_max[:, None]), axis=1)
        running_max = new_max
    row_mask = rows < n_q
    tl.store(lse_ptr + split * n_q + rows, running_max + tl.log(running_sum), mask=row_mask)
    tl.store(pos_ptr + split * n_q + rows, positive, mask=row_mask)


@triton.jit
def _info_nce_bwd_kernel(
    q_ptr, d_ptr, lse_ptr, grad_ptr, ds_ptr,
    first_row, n_q, n_d, dim, q_stride, d_stride, ds_stride, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """dS for rows ``first_row + [0, n_q)`` (q_ptr, lse_ptr, grad_ptr point at the chunk's first
    row; ds_ptr at its own buffer)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_q
    s = _similarity_tile(q_ptr, d_ptr, rows, cols, n_q, n_d, dim, q_stride, d_stride, scale,
                         BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    grad = tl.load(grad_ptr + rows, mask=row_mask, other=0.0)
    p = tl.exp(s - lse[:, None])
    ds = grad[:, None] * (p - tl.where(cols[None, :] == (rows + first_row)[:, None], 1.0, 0.0)) * scale
    tl.store(ds_ptr + rows[:, None] * ds_stride + cols[None, :], ds.to(ds_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (cols < n_d)[None, :])


@triton.jit
def _scores_fwd_kernel(s_ptr, lse_ptr, pos_ptr, n_d, s_stride, scale, BLOCK_N: tl.constexpr):
    """Row ``i`` of the fp32 similarities (unscaled): its log-sum-exp and positive, scaled."""
    row = tl.program_id(0).to(tl.int64)
    base = s_ptr + row * s_stride
    # Two reads of the row (the second from cache): an online softmax per lane would meet exp(-inf - -inf)
    # in a lane whose columns all score -inf.
    lane_max = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    for n0 in range(0, n_d, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        lane_max = tl.maximum(lane_max, tl.load(base + cols, mask=cols < n_d, other=float("-inf")) * scale)
    row_max = tl.max(lane_max, axis=0)
    lane_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for n0 in range(0, n_d, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        # A NaN similarity makes the sum NaN whether or not the max skipped it.
        lane_sum += tl.exp(tl.load(base + cols, mask=cols < n_d, other=float("-inf")) * scale - row_max)
    total = tl.sum(lane_sum, axis=0)
    tl.store(lse_ptr + row, row_max + tl.log(total))
    tl.store(pos_ptr + row, tl.load(base + row) * scale)


@triton.jit
def _scores_bwd_kernel(s_ptr, lse_ptr, grad_ptr, ds_ptr, n_d, s_stride, ds_stride, scale, BLOCK_N: tl.constexpr):
    """dS of row ``i`` from its saved similarities and log-sum-exp, in dS's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_d
    s = tl.load(s_ptr + row * s_stride + cols, mask=mask, other=0.0) * scale
    p = tl.exp(s - tl.load(lse_ptr + row))
    ds = tl.load(grad_ptr + row) * (p - tl.where(cols == row, 1.0, 0.0)) * scale
    tl.store(ds_ptr + row * ds_stride + cols, ds.to(ds_ptr.dtype.element_ty), mask=mask)


def _one_way_reference(q: torch.Tensor, d: torch.Tensor, temperature: float) -> torch.Tensor:
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = q.to(wide) @ d.to(wide).T / temperature
    return torch.logsumexp(scores, dim=-1) - scores.diagonal()


def info_nce_reference(q: torch.Tensor, d: torch.Tensor, temperature: float = 0.05,
                       symmetric: bool = False, max_chunk_bytes: int | None = None) -> torch.Tensor:
    """The op with the whole (B, N) similarity matrix in memory, by PyTorch: oracle and fallback."""
    loss = _one_way_reference(q, d, temperature)
    if symmetric:
        loss = (loss + _one_way_reference(d[: q.shape[0]], q, temperature)) / 2
    return loss


def _precision(dtype: torch.dtype) -> str:
    # fp32 embeddings get fp32 products (TF32 would lose ~1e-3 of each similarity).
    return "ieee" if dtype == torch.float32 else "tf32"


ROW_BLOCK = 1024  # the scores path's row kernels: columns per step


def _fused_forward(q: torch.Tensor, d: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    n_q, dim = q.shape
    n_d = d.shape[0]
    # Few row blocks (a batch of hundreds) would leave most multiprocessors idle: the documents are
    # split among programs too, each split's log-sum-exp merged after.
    row_blocks, tiles = cdiv(n_q, BLOCK_M), cdiv(n_d, BLOCK_N)
    per_split = cdiv(tiles, max(1, min(tiles, cdiv(2 * multiprocessor_count(q.device), row_blocks))))
    splits = cdiv(tiles, per_split)
    lse = torch.empty((splits, n_q), dtype=torch.float32, device=q.device)
    positive = torch.empty_like(lse)
    _info_nce_fwd_kernel[(row_blocks, splits)](
        q, d, lse, positive, n_q, n_d, dim, q.stride(0), d.stride(0), scale, per_split * BLOCK_N,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=_precision(q.dtype), num_warps=NUM_WARPS,
    )
    if splits == 1:
        return lse[0], positive[0]
    return torch.logsumexp(lse, 0), positive.sum(0)  # the positive is in one split, 0 in the others


def _gradients(q, d, needs, chunks, ds_of):
    """(dq, dd) from dS in row `chunks` ((start, stop) pairs); ``ds_of(start, stop)`` gives the chunk's
    dS in q's dtype. None where `needs` says so."""
    grad_q = torch.empty_like(q) if needs[0] else None
    grad_d, chunked = None, len(chunks) > 1
    if needs[1]:
        # Chunks add their parts in fp32; one chunk writes the gradient directly.
        grad_d = torch.zeros(d.shape, dtype=torch.float32, device=d.device) if chunked else torch.empty_like(d)
    for start, stop in chunks:
        ds = ds_of(start, stop)
        if grad_q is not None:
            torch.mm(ds, d, out=grad_q[start:stop])
        if grad_d is not None:
            if chunked:
                grad_d += (ds.T @ q[start:stop]).float()
            else:
                torch.mm(ds.T, q, out=grad_d)
    return grad_q, (None if grad_d is None else grad_d.to(d.dtype))


def _fused_backward(q, d, lse, grad, scale, max_chunk_bytes, needs):
    """The fused path's (dq, dd) for the upstream per-row gradient `grad` (fp32)."""
    n_q, n_d = q.shape[0], d.shape[0]
    rows = max(1, min(n_q, max_chunk_bytes // max(1, n_d * q.element_size())))
    ds = torch.empty((rows, n_d), dtype=q.dtype, device=q.device)

    def ds_of(start, stop):
        chunk = ds[: stop - start]
        _info_nce_bwd_kernel[(cdiv(stop - start, BLOCK_M), cdiv(n_d, BLOCK_N))](
            q[start:stop], d, lse[start:stop], grad[start:stop], chunk,
            start, stop - start, n_d, q.shape[1], q.stride(0), d.stride(0), chunk.stride(0), scale,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=_precision(q.dtype), num_warps=NUM_WARPS,
        )
        return chunk

    return _gradients(q, d, needs, [(i, min(n_q, i + rows)) for i in range(0, n_q, rows)], ds_of)


def _similarities(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``q d^T`` in fp32, by cuBLAS: 16-bit operands accumulate in fp32 and are written so."""
    if q.dtype != torch.float32 and q.device.type == "cuda":
        return torch.mm(q, d.T, out_dtype=torch.float32)
    return q.float() @ d.float().T


def _scores_forward(q, d, scale):
    scores = _similarities(q, d)
    lse = torch.empty(q.shape[0], dtype=torch.float32, device=q.device)
    positive = torch.empty_like(lse)
    _scores_fwd_kernel[(q.shape[0],)](scores, lse, positive, d.shape[0], scores.stride(0), scale, BLOCK_N=ROW_BLOCK)
    return scores, lse, positive


def _scores_backward(q, d, scores, lse, grad, scale, needs):
    """The scores path's (dq, dd): dS from the saved similarities, then two GEMMs."""
    n_q, n_d = scores.shape
    ds = torch.empty((n_q, n_d), dtype=q.dtype, device=q.device)
    _scores_bwd_kernel[(n_q, cdiv(n_d, ROW_BLOCK))](scores, lse, grad, ds, n_d, scores.stride(0), ds.stride(0),
                                                     scale, BLOCK_N=ROW_BLOCK)
    return _gradients(q, d, needs, [(0, n_q)], lambda start, stop: ds)


def _reference_point(ctx, saved):
    q, d = saved[:2]
    return INFO_NCE, lambda q, d, *_: _one_way_reference(q, d, 1.0 / ctx.scale), (q, d, None, None)


class _InfoNCEFunction(torch.autograd.Function):
    """One direction's per-row loss (fp32) by either path; the symmetric loss is two of them."""

    @staticmethod
    def forward(ctx, q, d, scale, max_chunk_bytes):
        if _holds_scores(q.shape[0], d.shape[0], max_chunk_bytes):
            scores, lse, positive = _scores_forward(q, d, scale)
            ctx.save_for_backward(q, d, lse, scores)
        else:
            lse, positive = _fused_forward(q, d, scale)
            ctx.save_for_backward(q, d, lse)
        ctx.scale, ctx.max_chunk_bytes = scale, max_chunk_bytes
        return lse - positive

    @staticmethod
    @torch.autograd.function.once_differentiable
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad):
        q, d, lse = saved[:3]
        grad, needs = grad.float().contiguous(), ctx.needs_input_grad[:2]
        if len(saved) == 4:
            grad_q, grad_d = _scores_backward(q, d, saved[3], lse, grad, ctx.scale, needs)
        else:
            grad_q, grad_d = _fused_backward(q, d, lse, grad, ctx.scale, ctx.max_chunk_bytes, needs)
        return grad_q, grad_d, None, None


def _holds_scores(n_q: int, n_d: int, max_chunk_bytes: int) -> bool:
    """Whether the scores path runs: the fp32 (n_q, n_d) similarities fit `max_chunk_bytes`."""
    return n_q * n_d * 4 <= max_chunk_bytes


def _kernel(q, d, temperature, symmetric, max_chunk_bytes):
    q, d = q.contiguous(), d.contiguous()
    loss = _InfoNCEFunction.apply(q, d, 1.0 / temperature, max_chunk_bytes)
    if symmetric:
        loss = (loss + _InfoNCEFunction.apply(d[: q.shape[0]], q, 1.0 / temperature, max_chunk_bytes)) / 2
    return loss


INFO_NCE = Op("info_nce", _kernel, info_nce_reference)


def _check(q, d, temperature, symmetric, max_chunk_bytes) -> None:
    check_float("q", q)
    check_float("d", d)
    if q.dim() != 2 or d.dim() != 2:
        raise ValueError(f"q and d must be 2-D (rows, dim), got shapes {tuple(q.shape)} and {tuple(d.shape)}")
    if q.shape[1] != d.shape[1]:
        raise ValueError(f"q and d must have the same dim, got {q.shape[1]} and {d.shape[1]}")
    if d.shape[0] < q.shape[0]:
        raise ValueError(
            f"d must hold at least one document per query (row i of d is query i's positive), got {d.shape[0]} "
            f"documents for {q.shape[0]} queries"
        )
    if d.dtype != q.dtype:
        raise ValueError(f"d must have q's dtype {q.dtype}, got {d.dtype}")
    check_device("d", d, q.device)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a positive float, got {temperature!r}")
    if not isinstance(symmetric, bool):
        raise ValueError(f"symmetric must be a bool, got {symmetric!r}")
    if isinstance(max_chunk_bytes, bool) or not isinstance(max_chunk_bytes, int) or max_chunk_bytes < 1:
        raise ValueError(f"max_chunk_bytes must be a positive int, got {max_chunk_bytes!r}")


def info_nce(
    q: torch.Tensor,
    d: torch.Tensor,
    *,
    temperature: float = 0.05,
    symmetric: bool = False,
    max_chunk_bytes: int | None = None,
) -> torch.Tensor:
    """Per-query InfoNCE loss with in-batch negatives, ``logsumexp_j(q_i . d_j / T) - q_i . d_i / T``;
    for large batches without the (B, N) similarity matrix in forward (see `max_chunk_bytes`).

    Args:
        q: ``(B, D)`` query embeddings, float16/bfloat16/float32 (float64 runs the reference).
            Normalise first (``F.normalize``) for cosine similarity: the op does not.
        d: ``(N, D)`` document embeddings, N >= B, q's dtype and device: rows ``0..B-1`` are the
            queries' positives, the rest (hard negatives) negatives of every query.
        temperature: similarities are divided by it (sentence-transformers' ``scale`` is 1 / T).
        symmetric: average in the document-to-query loss of document i against the B queries.
        max_chunk_bytes: the budget for ``B x N``-shaped memory; default
            ``DEFAULT_MAX_CHUNK_BYTES`` (64 MiB). Where the fp32 similarity matrix fits
            (``B * N * 4`` bytes) it is computed by one GEMM and kept for backward (which adds its
            gradient in q's dtype beside it); otherwise the fused kernel never forms it in forward
            and backward holds the gradient of the similarities in chunks of rows of at most this
            many bytes (one row at least).

    Returns:
        ``(B,)`` fp32 losses (float64 for float64 inputs), differentiable in q and d; take
        ``.mean()`` for sentence-transformers' loss. NaN in an embedding gives NaN in every loss
        it enters. No host sync. Inside torch.compile it runs its reference (the loss is a few
        GEMMs over embeddings, which the compiler fuses well enough; no library op yet).
    """
    if max_chunk_bytes is None:
        max_chunk_bytes = DEFAULT_MAX_CHUNK_BYTES
    _check(q, d, temperature, symmetric, max_chunk_bytes)
    return INFO_NCE(None, q, d, float(temperature), symmetric, max_chunk_bytes)
