"""The floor under the MoE expert block's speed-up: the six grouped GEMMs of its forward and
backward alone (torch._grouped_mm, nothing else: no routing, gathers, activation or combine),
beside tigon's whole op and transformers' expert loop, on the same routed tokens, in one run.

No implementation built on these GEMMs beats the loop by more than loop / GEMMs. Qwen3-30B-A3B's
expert widths by default (8192 tokens, hidden 2048, expert intermediate 768, 128 experts, top-8).

    PYTHONPATH=src python3 scripts/moe_gemm_floor.py          # on the GPU
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench, do_bench_cudagraph

import tigon.functional as F
from tigon.bench.ops.moe import hf_expert_loop, make_inputs

grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="8192,2048,768,128,8", help="tokens,hidden,intermediate,experts,top_k")
    args = parser.parse_args()
    size = tuple(int(v) for v in args.size.split(","))
    tokens, hidden, inter, experts, top_k = size
    x, index, weights, gate_up, down = make_inputs(size, torch.bfloat16, torch.device("cuda"))

    # The routed rows as the GEMMs see them: sorted by expert, int32 row ends per expert.
    counts = torch.bincount(index.flatten(), minlength=experts)
    ends = counts.cumsum(0).to(torch.int32)
    rows = tokens * top_k
    xs = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
    h = torch.randn(rows, inter, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
    dgu = torch.randn(rows, 2 * inter, dtype=torch.bfloat16, device="cuda")
    w1, w2 = gate_up.detach(), down.detach()  # (E, 2I, H), (E, H, I)

    def gemms() -> None:
        grouped_mm(xs, w1.transpose(-2, -1), offs=ends)  # gate/up: (S, H) x (E, H, 2I)
        grouped_mm(h, w2.transpose(-2, -1), offs=ends)  # down: (S, I) x (E, I, H)
        grouped_mm(dy, w2, offs=ends)  # dh: (S, H) x (E, H, I)
        grouped_mm(dy.t(), h, offs=ends)  # dW2: (H, S) x (S, I) per expert
        grouped_mm(dgu, w1, offs=ends)  # dx: (S, 2I) x (E, 2I, H)
        grouped_mm(dgu.t(), xs, offs=ends)  # dW1: (2I, S) x (S, H) per expert

    leaves = [x, weights, gate_up, down]

    def tigon_step() -> None:
        F.moe_experts(x, index, weights, gate_up, down).sum().backward()

    def loop_step() -> None:
        hf_expert_loop(x, index, weights, gate_up, down).sum().backward()

    gemm_ms = do_bench_cudagraph(gemms, rep=200, return_mode="median")
    tigon_ms = do_bench_cudagraph(tigon_step, rep=200, return_mode="median")
    tigon_launched = do_bench(tigon_step, rep=200, grad_to_none=leaves, return_mode="median")
    loop_ms = do_bench(loop_step, rep=200, grad_to_none=leaves, return_mode="median")
    flops = 3 * 6 * rows * hidden * inter
    print(f"size {args.size} (tokens,hidden,intermediate,experts,top_k); rows per expert {counts.min().item()}.."
          f"{counts.max().item()}")
    print(f"six grouped GEMMs alone (graph-replayed): {gemm_ms:.3f} ms, {flops / gemm_ms / 1e9:.0f} TFLOP/s")
    print(f"tigon moe_experts fwd+bwd: {tigon_ms:.3f} ms graph-replayed, {tigon_launched:.3f} ms launched")
    print(f"transformers' expert loop fwd+bwd (launched): {loop_ms:.3f} ms")
    print(f"loop / tigon: {loop_ms / tigon_launched:.2f}x launched; loop / GEMMs alone: {loop_ms / gemm_ms:.2f}x "
          f"(the most any implementation on these GEMMs can reach)")


if __name__ == "__main__":
    main()
