"""Benchmark cases for info_nce: in-batch-negatives InfoNCE of B queries against B documents
(rows x dim), tigon against the whole similarity matrix and its log-softmax in eager and
torch.compile. The inputs are normalised embeddings, as the op takes them."""

from __future__ import annotations

import torch
import torch.nn.functional as TF

import tigon.functional as F
from tigon.bench.registry import BenchOp, register

TEMPERATURE = 0.05


def _inputs(size, dtype, device):
    rows, dim = size
    q = TF.normalize(torch.randn(rows, dim, device=device), dim=-1).to(dtype).requires_grad_()
    d = TF.normalize(torch.randn(rows, dim, device=device), dim=-1).to(dtype).requires_grad_()
    return q, d


def _tigon(q, d):
    return F.info_nce(q, d, temperature=TEMPERATURE).mean()


def _eager(q, d):
    scores = (q @ d.T).float() / TEMPERATURE
    return TF.cross_entropy(scores, torch.arange(q.shape[0], device=q.device))


register(BenchOp(
    name="info_nce",
    make_inputs=_inputs,
    tigon=_tigon,
    eager=_eager,
    # Read q and d, write their gradients.
    bytes_moved=lambda size, dtype: 4 * size[0] * size[1] * dtype.itemsize,
    # Forward scores, their recomputation in backward, and the two gradient GEMMs.
    flops=lambda size: 4 * 2 * size[0] * size[0] * size[1],
    sizes=[(4096, 2048), (16384, 1024), (1024, 4096)],
    cpu_sizes=[(96, 40)],
    size_names="rows x dim",
))
