"""Rates of the GEMMs and attention calls in one decoder layer of the e2e benchmark's full
fine-tune (hidden 2048, 8 of 32 heads for k/v, intermediate 8192, 4 x 2048 tokens, bf16), each as
tigon issues it and in the other layouts cuBLAS offers for the same product (GPU only).

The profile of a full step puts 72% of its GPU time in cuBLAS, at rates from ~600 to ~800 TFLOP/s
depending on the kernel cuBLAS picks; a layout it runs faster is time taken off every step.

Usage: PYTHONPATH=src python3 scripts/gemm_e2e.py
"""

import torch
import torch.nn.functional as F
from triton.testing import do_bench

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
tokens, hidden, kv, inter = 8192, 2048, 512, 8192


def ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=150)


def report(name: str, t: float, flop: float) -> None:
    print(f"  {name:<52} {t:7.3f} ms {flop / t / 1e9:6.0f} TFLOP/s")


def rand(*shape):
    return torch.randn(*shape, device=dev, dtype=dt)


print("GEMMs (M x K @ K x N), per call:")
for name, n_out, n_in in (("q/o", hidden, hidden), ("k/v", kv, hidden), ("gate/up", inter, hidden), ("down", hidden, inter)):
    x, w, dy = rand(tokens, n_in), rand(n_out, n_in) * 0.02, rand(tokens, n_out)
    out, dx, dw, dwt = rand(tokens, n_out), rand(tokens, n_in), rand(n_out, n_in), rand(n_in, n_out)
    flop = 2 * tokens * n_in * n_out
    print(f"{name}: {tokens}x{n_in} -> {n_out}")
    report("forward  x @ W.T (F.linear)", ms(lambda: F.linear(x, w)), flop)
    report("forward  x @ W.T into out", ms(lambda: torch.mm(x, w.t(), out=out)), flop)
    report("dx = dy @ W", ms(lambda: torch.mm(dy, w, out=dx)), flop)
    report("dx += dy @ W (addmm_)", ms(lambda: dx.addmm_(dy, w)), flop)
    report("dW = dy.T @ x", ms(lambda: torch.mm(dy.t(), x, out=dw)), flop)
    report("dW.T = x.T @ dy", ms(lambda: torch.mm(x.t(), dy, out=dwt)), flop)
    report("dW.T = x.T @ dy, then contiguous dW", ms(lambda: torch.mm(x.t(), dy, out=dwt).t().contiguous()), flop)

print("Attention (SDPA, causal, 4 x 32 heads x 2048 x 64, 8 KV heads), fwd and fwd+bwd:")
q = rand(4, 32, 2048, 64).requires_grad_()
k, v = rand(4, 8, 2048, 64).requires_grad_(), rand(4, 8, 2048, 64).requires_grad_()
do = rand(4, 32, 2048, 64)
flop_fwd = 4 * 4 * 32 * 2048 * 2048 * 64 / 2
backends = {
    "cudnn": torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
    "flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION,
    "efficient": torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
}
for kv_layout in ("enable_gqa", "repeat_kv"):
    for name, backend in backends.items():
        try:
            with torch.nn.attention.sdpa_kernel(backend):
                if kv_layout == "enable_gqa":
                    def attn():
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                else:
                    def attn():
                        return F.scaled_dot_product_attention(
                            q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), is_causal=True)
                fwd = ms(attn)
                both = ms(lambda: torch.autograd.backward(attn(), do))
            report(f"{kv_layout} {name} fwd", fwd, flop_fwd)
            report(f"{kv_layout} {name} fwd+bwd", both, 3.5 * flop_fwd)
        except RuntimeError as err:
            print(f"  {kv_layout} {name}: not available ({str(err).splitlines()[0][:80]})")
