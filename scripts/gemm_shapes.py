"""cuBLAS times of the GEMMs behind two open questions, at the benchmark shapes (GPU only).

1. Full fine-tuning of the e2e Llama (hidden 2048, 8 KV heads, intermediate 8192, 8192 tokens):
   what q/k/v (and gate/up) as one concatenated projection would save over separate ones, fwd+bwd
   with the weights and the input requiring grad, the concatenation and the split included.
2. The linear + cross-entropy GEMMs (h 8192x4096, W 128256x4096): each GEMM's rate whole and in
   the 512-row chunks of the 128 MiB budget, the weight-gradient GEMM accumulating into bf16.

Usage: PYTHONPATH=src python3 scripts/gemm_shapes.py
"""

import torch
import torch.nn.functional as F
from triton.testing import do_bench

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16


def ms(fn):
    return do_bench(fn, warmup=25, rep=200)


def fwd_bwd(weights, concat):
    x = torch.randn(8192, 2048, device=dev, dtype=dt, requires_grad=True)
    grads = [torch.randn(8192, w.shape[0], device=dev, dtype=dt) for w in weights]

    def run():
        if concat:
            outs = F.linear(x, torch.cat(weights)).split([w.shape[0] for w in weights], dim=-1)
        else:
            outs = [F.linear(x, w) for w in weights]
        torch.autograd.backward(outs, grads)
        x.grad = None
        for w in weights:
            w.grad = None

    return ms(run)


def weights(*rows):
    return [(torch.randn(r, 2048, device=dev, dtype=dt) * 0.02).requires_grad_() for r in rows]


for name, rows in (("q/k/v", (2048, 512, 512)), ("gate/up", (8192, 8192))):
    ws = weights(*rows)
    separate, concat = fwd_bwd(ws, False), fwd_bwd(ws, True)
    print(f"{name}: separate {separate:.3f} ms, concatenated {concat:.3f} ms, x16 layers saves {16 * (separate - concat):.2f} ms")

h = torch.randn(8192, 4096, device=dev, dtype=dt)
W = torch.randn(128256, 4096, device=dev, dtype=dt) * 0.02
flop = 2 * 8192 * 4096 * 128256
logits = h @ W.t()
gw = torch.empty_like(W)
whole = {
    "logits = h @ W.T": lambda: torch.mm(h, W.t(), out=logits),
    "grad_h = dlogits @ W": lambda: torch.mm(logits, W),
    "grad_W = dlogits.T @ h": lambda: torch.mm(logits.t(), h, out=gw),
}
for name, fn in whole.items():
    t = ms(fn)
    print(f"LCE whole {name}: {t:.3f} ms, {flop / t / 1e9:.0f} TFLOP/s")
chunk = 512
lc = logits[:chunk].contiguous()
hc = h[:chunk]
gh = torch.empty_like(h)
chunked = {
    "logits chunk": lambda: torch.mm(hc, W.t(), out=lc),
    "grad_h chunk": lambda: torch.mm(lc, W, out=gh[:chunk]),
    "grad_W += chunk": lambda: gw.addmm_(lc.t(), hc),
    "grad_W = chunk (no accumulate)": lambda: torch.mm(lc.t(), hc, out=gw),
}
for name, fn in chunked.items():
    t = ms(fn) * 8192 / chunk
    print(f"LCE 512-row {name} x16: {t:.3f} ms, {flop / t / 1e9:.0f} TFLOP/s")
