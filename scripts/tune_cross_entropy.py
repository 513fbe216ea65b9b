"""Sweep launch configs of the cross-entropy kernels on the GPU (one device call).

For the TARGETS.md logits (8192 x 128256, bf16) and for one 512-row chunk of the fused linear-CE
(the in-place pass), prints the CUDA-graph time of each (BLOCK, num_warps): the forward (loss and
lse), the backward (gradient from the lse), and the forward that also writes the gradient in the
same pass (into a fresh buffer, and in place), with the bandwidth floor of each.

Usage: PYTHONPATH=src python3 scripts/tune_cross_entropy.py
"""

import torch
from triton.testing import do_bench_cudagraph

from tigon.ops import cross_entropy as ce

BANDWIDTH = 4.3e12
CONFIGS = [(2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]


def ms(fn):
    return do_bench_cudagraph(fn, rep=100)


def launch(kernel_args, block, warps, write_grad, grad, rows, scale, x, t, loss, lse):
    ce._ce_fwd_kernel[(rows,)](
        x, t, loss, lse, grad, scale,
        x.shape[1], x.stride(0), grad.stride(0), 0,
        WRITE_GRAD=write_grad, BLOCK=block, num_warps=warps, **kernel_args,
    )


def sweep(rows, vocab=128256):
    torch.manual_seed(0)
    x = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 4
    t = torch.randint(0, vocab, (rows,), device="cuda")
    loss = torch.empty(rows, device="cuda")
    lse = torch.empty(rows, device="cuda")
    scale = torch.full((), 1.0 / rows, device="cuda")
    grad = torch.empty_like(x)
    kernel_args = ce._kernel_options(ce.LossOptions(), vocab, False)
    for key in ("BLOCK", "num_warps"):
        kernel_args.pop(key)
    nbytes = x.numel() * 2
    print(f"rows {rows} x {vocab}: floors fwd {nbytes / BANDWIDTH * 1e3:.3f} ms, "
          f"bwd / fused {2 * nbytes / BANDWIDTH * 1e3:.3f} ms")
    for block, warps in CONFIGS:
        fwd = ms(lambda: launch(kernel_args, block, warps, False, x, rows, lse, x, t, loss, lse))
        bwd = ms(lambda: ce._ce_bwd_kernel[(rows,)](
            x, t, lse, grad, scale, vocab, x.stride(0), grad.stride(0), 0,
            BLOCK=block, num_warps=warps, **kernel_args))
        fused = ms(lambda: launch(kernel_args, block, warps, True, grad, rows, scale, x, t, loss, lse))
        in_place = ms(lambda: launch(kernel_args, block, warps, True, x, rows, scale, x, t, loss, lse))
        print(f"  BLOCK {block:5d} warps {warps:2d}: fwd {fwd:.3f}  bwd {bwd:.3f}  fwd+bwd {fwd + bwd:.3f}  "
              f"fused {fused:.3f}  fused in place {in_place:.3f}")


sweep(8192)
sweep(512)
sweep(1024)
