"""Benchmark cases for moe_experts: the routed experts of a mixture-of-experts block, fwd+bwd, at
Qwen3-30B-A3B's widths first (4 × 2048 tokens, hidden 2048, expert intermediate 768, 128 experts,
top-8), against transformers' own code run on the same tensors.

Registered for ``tigon bench`` (their eager column is transformers' ``grouped_mm_experts_forward``,
``experts_implementation="grouped_mm"``, its default where torch has grouped_mm, which CUDA graphs
can capture):

* ``moe_experts``: tigon as it runs by default;
* ``moe_gemm_triton`` / ``moe_gemm_grouped_mm`` / ``moe_gemm_hybrid``: tigon on one GEMM back end
  each, to pick :data:`tigon.ops.moe.PREFERRED_GEMM`.

Transformers' expert loop (``experts_implementation="eager"``) syncs with the host once per call
(``nonzero``), so no CUDA graph can capture it: :mod:`tigon.bench.moe_ops` times every
implementation side by side as launched.

Router weights are in the hidden dtype, as Qwen3-MoE's router returns them; all weights train.
"""

from __future__ import annotations

import types
from typing import Callable

import torch

import tigon.functional as F
from tigon.bench.registry import BenchOp, register

SIZES = [(8192, 2048, 768, 128, 8), (8192, 2048, 1408, 64, 6), (8192, 4096, 14336, 8, 2), (32768, 2048, 768, 128, 8)]
CPU_SIZES = [(64, 64, 32, 8, 2)]
SIZE_NAMES = "tokens x hidden x intermediate x experts x top_k"


def make_inputs(size, dtype, device):
    """(x, top_k_index, top_k_weights, gate_up, down) of `size`, the routing from random logits."""
    tokens, hidden, inter, experts, top_k = size
    x = torch.randn(tokens, hidden, dtype=dtype, device=device, requires_grad=True)
    probs = torch.randn(tokens, experts, device=device).softmax(-1)
    weights, index = torch.topk(probs, top_k)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype).requires_grad_()
    gate_up = (torch.randn(experts, 2 * inter, hidden, dtype=dtype, device=device) * hidden**-0.5).requires_grad_()
    down = (torch.randn(experts, hidden, inter, dtype=dtype, device=device) * inter**-0.5).requires_grad_()
    return x, index, weights, gate_up, down


def _experts_module(gate_up, down):
    """What transformers' experts code reads of its module (Qwen3MoeExperts' attributes and the
    flags `use_experts_implementation` sets), over these tensors."""
    from transformers.integrations.moe import _default_apply_gate

    module = types.SimpleNamespace(
        num_experts=gate_up.shape[0], gate_up_proj=gate_up, down_proj=down, act_fn=torch.nn.functional.silu,
        has_gate=True, has_bias=False, is_transposed=False, is_concatenated=True, has_post_expert_norm=False,
        _is_expert_parallel=False,
    )
    module._apply_gate = lambda gate_up_out: _default_apply_gate(module, gate_up_out)
    return module


def hf_expert_loop(x, index, weights, gate_up, down):
    """transformers' expert loop (Qwen3MoeExperts' own forward)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    return Qwen3MoeExperts.forward.__wrapped__(_experts_module(gate_up, down), x, index, weights)


def hf_grouped_mm(x, index, weights, gate_up, down):
    """transformers' grouped_mm experts implementation."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward(_experts_module(gate_up, down), x, index, weights)


def grouped_gemms(x, index, weights, gate_up, down) -> Callable[[], None]:
    """A call of the six grouped GEMMs of the experts block's forward and backward alone, on rows
    routed to the experts as `index` routes them: no routing, gathers, activation or combine. No
    implementation built on these GEMMs runs the block faster than they do."""
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    experts, hidden, inter = down.shape
    rows = index.numel()
    # The routed rows as the GEMMs see them: sorted by expert, each expert's last row + 1 as int32.
    ends = torch.bincount(index.flatten(), minlength=experts).cumsum(0).to(torch.int32)
    xs, h, dy, dgu = (torch.randn(rows, width, dtype=x.dtype, device=x.device)
                      for width in (hidden, inter, hidden, 2 * inter))
    w1, w2 = gate_up.detach(), down.detach()  # (E, 2I, H), (E, H, I)

    def step() -> None:
        grouped_mm(xs, w1.transpose(-2, -1), offs=ends)  # gate/up: (S, H) x (E, H, 2I)
        grouped_mm(h, w2.transpose(-2, -1), offs=ends)  # down: (S, I) x (E, I, H)
        grouped_mm(dy, w2, offs=ends)  # dh: (S, H) x (E, H, I)
        grouped_mm(dy.t(), h, offs=ends)  # dW2: (H, S) x (S, I) per expert
        grouped_mm(dgu, w1, offs=ends)  # dx: (S, 2I) x (E, 2I, H)
        grouped_mm(dgu.t(), xs, offs=ends)  # dW1: (2I, S) x (S, H) per expert

    return step


def _bytes(size, dtype):
    tokens, hidden, inter, experts, _ = size
    # x, dy, out and dx; both weights read and their gradients written.
    return (4 * tokens * hidden + 6 * experts * inter * hidden) * dtype.itemsize


def _flops(size):
    tokens, hidden, inter, _, top_k = size
    # gate/up (2I wide) and down per routed token, forward, and twice that backward.
    return 3 * 6 * tokens * top_k * hidden * inter


def _case(name, tigon):
    register(BenchOp(
        name=name, make_inputs=make_inputs, tigon=tigon, eager=hf_grouped_mm, bytes_moved=_bytes, flops=_flops,
        sizes=SIZES, cpu_sizes=CPU_SIZES, size_names=SIZE_NAMES,
    ))


def on_gemm(gemm: str) -> Callable:
    """tigon's op on the GEMM back end `gemm`."""
    return lambda *args: F.moe_experts(*args, gemm=gemm)


_case("moe_experts", F.moe_experts)
for _gemm in ("triton", "grouped_mm", "hybrid"):
    _case(f"moe_gemm_{_gemm}", on_gemm(_gemm))
