"""Benchmark cases for cross_entropy and linear_cross_entropy (the headline shape first: 8192
tokens, hidden 4096, Llama 3's 128256-entry vocabulary; then the token sweep 1K..32K), the
linear_cross_entropy chunk-budget sweep (32 MiB..2 GiB), and linear_cross_entropy with every option
of issue 25 on (class weights, token scaling, z-loss and argmax returned, fp32 weight-gradient
sum), to set beside the plain case's time."""

from __future__ import annotations

import torch

import tigon.functional as F
from tigon.bench.registry import BenchOp, liger, register

VOCAB, HIDDEN = 128256, 4096
TOKENS = [8192, 1024, 2048, 4096, 16384, 32768]
BUDGETS_MIB = [32, 64, 128, 256, 512, 1024, 2048]


def _ce_inputs(size, dtype, device):
    rows, vocab = size
    logits = torch.randn(rows, vocab, dtype=dtype, device=device, requires_grad=True)
    return logits, torch.randint(0, vocab, (rows,), device=device)


def _lce_inputs(size, dtype, device):
    rows, hidden, vocab = size[:3]
    h = torch.randn(rows, hidden, dtype=dtype, device=device, requires_grad=True)
    w = (torch.randn(vocab, hidden, dtype=dtype, device=device) * hidden**-0.5).requires_grad_()
    y = torch.randint(0, vocab, (rows,), device=device)
    if len(size) == 3:
        return h, w, y
    return h, w, y, size[3] * 2**20  # the chunk budget, in bytes


def _eager_lce(h, w, y, *budget):
    return torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w).float(), y)


def _lce_flops(size):
    rows, hidden, vocab = size[:3]
    return 3 * 2 * rows * hidden * vocab  # logits, grad of hidden, grad of weight


def _lce_bytes(size, dtype):
    rows, hidden, vocab = size[:3]
    return 2 * (rows + vocab) * hidden * dtype.itemsize  # read h and W, write their gradients


register(BenchOp(
    name="cross_entropy",
    make_inputs=_ce_inputs,
    tigon=F.cross_entropy,
    eager=lambda x, y: torch.nn.functional.cross_entropy(x.float(), y),
    # fwd reads the logits; bwd reads them again and writes their gradient
    bytes_moved=lambda size, dtype: 3 * size[0] * size[1] * dtype.itemsize,
    sizes=[(n, VOCAB) for n in TOKENS] + [(4096, 262144)],
    cpu_sizes=[(256, 4099)],
    size_names="tokens x vocab",
    peer=liger("liger_cross_entropy"),
))

register(BenchOp(
    name="linear_cross_entropy",
    make_inputs=_lce_inputs,
    tigon=F.linear_cross_entropy,
    eager=_eager_lce,
    bytes_moved=_lce_bytes,
    flops=_lce_flops,
    sizes=[(n, HIDDEN, VOCAB) for n in TOKENS],
    cpu_sizes=[(256, 256, 4099)],
    size_names="tokens x hidden x vocab",
    peer=liger("liger_fused_linear_cross_entropy"),
))

register(BenchOp(
    name="linear_cross_entropy_budget",
    make_inputs=_lce_inputs,
    tigon=lambda h, w, y, budget: F.linear_cross_entropy(h, w, y, max_chunk_bytes=budget),
    eager=_eager_lce,
    bytes_moved=_lce_bytes,
    flops=_lce_flops,
    sizes=[(8192, HIDDEN, VOCAB, mib) for mib in BUDGETS_MIB],
    cpu_sizes=[(256, 256, 4099, 1), (256, 256, 4099, 4)],
    size_names="tokens x hidden x vocab x chunk budget MiB",
))


def _lce_options_inputs(size, dtype, device):
    h, w, y = _lce_inputs(size, dtype, device)
    return h, w, y, torch.rand(size[2], device=device) + 0.5


def _tigon_lce_options(h, w, y, class_weight):
    return F.linear_cross_entropy(
        h, w, y, class_weight=class_weight, token_scaling=True, z_loss_scale=1e-4, return_z_loss=True,
        return_argmax=True, fp32_weight_grad=True,
    ).loss


def _eager_lce_options(h, w, y, class_weight):
    logits = torch.nn.functional.linear(h, w).float()
    lse = torch.logsumexp(logits, -1)
    rows = torch.nn.functional.cross_entropy(logits, y, weight=class_weight, reduction="none")
    rows = (rows + 1e-4 * class_weight[y] * lse**2) * (logits.gather(1, y[:, None])[:, 0] - lse).exp().detach()
    logits.argmax(-1)  # the accuracy's argmax, which tigon's pass gives
    return rows.sum() / class_weight[y].sum()


register(BenchOp(
    name="linear_cross_entropy_options",
    make_inputs=_lce_options_inputs,
    tigon=_tigon_lce_options,
    eager=_eager_lce_options,
    bytes_moved=_lce_bytes,
    flops=_lce_flops,
    sizes=[(8192, HIDDEN, VOCAB)],
    cpu_sizes=[(256, 256, 4099)],
    size_names="tokens x hidden x vocab",
))
