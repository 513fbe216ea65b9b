"""Sweep the rope kernel's launch config on the GPU (one device call).

For each shape, the forward kernel's GPU time (CUDA-graph replay) per (tokens per program, warps),
the config tigon picks today, the peer's forward (Liger-Kernel, plainly launched, where installed)
and the copy-bandwidth floor, so `tigon/ops/rope.py`'s `_launch_config` can be chosen from
measurements. q and k are laid out as the bench and Hugging Face pass them: (B, T, H, D) memory
viewed as (B, H, T, D).

Usage: PYTHONPATH=src python3 scripts/tune_rope.py [BxHQxHKxTxD ...]
"""

import itertools
import sys

import torch
from triton.testing import do_bench, do_bench_cudagraph

from tigon.bench.ops.rope import _rope_inputs
from tigon.ops import rope

SHAPES = [(8, 32, 8, 2048, 128), (1, 32, 8, 1024, 64), (4, 32, 8, 2048, 64)]
if sys.argv[1:]:
    SHAPES = [tuple(int(d) for d in a.split("x")) for a in sys.argv[1:]]
BANDWIDTH = 4.3e12
current_config = rope._launch_config.__wrapped__

for size in SHAPES:
    q, k, cos, sin = (t.detach() for t in _rope_inputs(size, torch.bfloat16, torch.device("cuda")))
    q_out, k_out = rope._outputs(q, k, cos)
    floor_ms = 2 * (q.numel() + k.numel()) * 2 / BANDWIDTH * 1e3
    batch, n_q, n_k, tokens, head_dim = size
    now = current_config(head_dim // 2, head_dim, tokens, n_q, n_k)
    results = []
    for block_tokens, warps in itertools.product([1, 2, 4, 8, 16], [1, 2, 4, 8, 16]):
        config = (*now[:4], block_tokens, -(-tokens // block_tokens), warps)
        rope._launch_config = lambda *args, config=config: config
        try:
            ms = do_bench_cudagraph(lambda: rope._launch(q, k, cos, sin, q_out, k_out, False, False), rep=50)
        except Exception as err:  # out of resources for this config
            print(f"  {block_tokens=} {warps=}: {type(err).__name__}", file=sys.stderr)
            continue
        results.append((ms, block_tokens, warps))
    rope._launch_config = current_config
    results.sort()
    print(f"rope fwd {'x'.join(map(str, size))}: floor {floor_ms:.4f} ms; today (tokens {now[4]}, warps {now[6]}); best:")
    for ms, block_tokens, warps in results[:6] + [r for r in results if (r[1], r[2]) == (now[4], now[6])]:
        print(f"   {ms:.4f} ms ({100 * floor_ms / ms:.0f}% roofline)  tokens={block_tokens} warps={warps}")
    try:
        from liger_kernel.transformers.functional import liger_rope

        qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
        ms = do_bench(lambda: liger_rope(qg, kg, cos, sin), rep=50)
        print(f"   peer forward (plain launch): {ms:.4f} ms ({100 * floor_ms / ms:.0f}% roofline)")
    except ImportError:
        pass
