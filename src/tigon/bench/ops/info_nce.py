"""Benchmark cases for info_nce: in-batch-negatives InfoNCE of B queries against B documents
(rows x dim), tigon against the whole similarity matrix and its log-softmax in eager and
torch.compile. The inputs are normalised embeddings, as the op takes them.

``info_nce`` is the op as it dispatches (for these sizes: cuBLAS similarities and the row
kernels); ``info_nce_fused`` forces the fused kernel (the similarity matrix never formed in
forward), so that one run shows where each path pays:

    tigon bench --ops info_nce info_nce_fused --sizes 64x2048 512x2048 4096x2048 4096x4096
"""

from __future__ import annotations

import torch
import torch.nn.functional as TF

import tigon.functional as F
from tigon.bench.registry import BenchOp, register

TEMPERATURE = 0.05
SIZES = [(4096, 2048), (64, 2048), (512, 2048), (4096, 4096), (16384, 1024), (1024, 4096)]


def _inputs(size, dtype, device):
    rows, dim = size
    q = TF.normalize(torch.randn(rows, dim, device=device), dim=-1).to(dtype).requires_grad_()
    d = TF.normalize(torch.randn(rows, dim, device=device), dim=-1).to(dtype).requires_grad_()
    return q, d


def _tigon(q, d):
    return F.info_nce(q, d, temperature=TEMPERATURE).mean()


def _fused(q, d):
    # Just below the fp32 matrix: the fused path, its backward's dS in one chunk.
    return F.info_nce(q, d, temperature=TEMPERATURE, max_chunk_bytes=4 * q.shape[0] * d.shape[0] - 1).mean()


def _eager(q, d):
    scores = (q @ d.T).float() / TEMPERATURE
    return TF.cross_entropy(scores, torch.arange(q.shape[0], device=q.device))


for _name, _impl, _flops in (
    # Forward scores, the two gradient GEMMs, and (fused) the scores' recomputation in backward.
    ("info_nce", _tigon, 3), ("info_nce_fused", _fused, 4),
):
    register(BenchOp(
        name=_name,
        make_inputs=_inputs,
        tigon=_impl,
        eager=_eager,
        # Read q and d, write their gradients.
        bytes_moved=lambda size, dtype: 4 * size[0] * size[1] * dtype.itemsize,
        flops=lambda size, n=_flops: n * 2 * size[0] * size[0] * size[1],
        sizes=SIZES,
        cpu_sizes=[(96, 40)],
        size_names="rows x dim",
    ))
