"""GeGLU (tanh) in bf16 against float64: tigon's fused kernel and Hugging Face's
``gelu_pytorch_tanh(gate) * up``, forward and backward, at several magnitudes of the output.

HF's eager code rounds gelu(gate) to bf16 and then the product again (and, in backward,
``grad_out * up`` and ``grad_out * gelu(gate)`` before the activation's derivative); tigon's kernel
computes in fp32 and rounds each output once. This prints, per magnitude, each one's error against
the float64 value of the same bf16 inputs, in units of the bf16 spacing (ulp) at that value: the mean,
the largest, and the share of elements that are the float64 value correctly rounded to bf16.

    python scripts/geglu_rounding.py                # on the GPU
    python scripts/geglu_rounding.py --rows 4096

Run it on a GPU: Triton's CPU interpreter truncates fp32 to bf16 on a store where the GPU rounds to
nearest, so its figures for the kernel are half an ulp worse than the GPU's.
"""

from __future__ import annotations

import argparse

import torch
from transformers.activations import ACT2FN

import tigon.functional as F

# (gate scale, up scale): gate around 1e5 (gelu(gate) == gate there) and products around 1e5.
SCALES = ((1.0, 1.0), (30.0, 30.0), (300.0, 300.0), (1e5, 1.0), (1e5, 1e-2))


def ulps(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in units of the bf16 spacing at `exact` (float64); below the smallest normal
    bf16 (2**-126, which the GPU's fp32 arithmetic flushes to 0 anyway), in units of that."""
    spacing = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(2.0**-126))) - 7).clamp_min(2.0**-126)
    return (got.double() - exact).abs() / spacing


def gelu_tanh_float64(gate: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") as ``gate * sigmoid(2 z)``: the same function as torch's
    ``0.5 gate (1 + tanh(z))``, whose float64 form cancels to 0 below gate ~ -8 where the value is
    still ~1e-37 (bf16 holds it)."""
    inner = (2.0 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)
    return gate * torch.sigmoid(2.0 * inner)


def errors(fn, gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """Per output (out, grad gate, grad up) the error of `fn` on the bf16 inputs, in ulps."""
    exact_inputs = [t.detach().double().requires_grad_() for t in (gate, up)]
    exact = gelu_tanh_float64(exact_inputs[0]) * exact_inputs[1]
    exact.backward(grad.double())
    inputs = [t.detach().clone().requires_grad_() for t in (gate, up)]
    out = fn(*inputs)
    out.backward(grad)
    return [ulps(o, e) for o, e in zip((out, inputs[0].grad, inputs[1].grad),
                                        (exact, exact_inputs[0].grad, exact_inputs[1].grad))]


def table(rows: int, width: int, device: torch.device) -> list[str]:
    torch.manual_seed(0)
    lines = [f"{'gate':>8} {'up':>8} {'output':>10} {'tigon mean/max ulp, exact %':>30} {'HF mean/max ulp, exact %':>30}"]
    for gate_scale, up_scale in SCALES:
        gate = (torch.randn(rows, width, device=device) * gate_scale).bfloat16()
        up = (torch.randn(rows, width, device=device) * up_scale).bfloat16()
        grad = torch.randn(rows, width, device=device).bfloat16()
        ours = errors(lambda g, u: F.geglu(g, u, approximate="tanh"), gate, up, grad)
        hf = errors(lambda g, u: ACT2FN["gelu_pytorch_tanh"](g) * u, gate, up, grad)
        for name, a, b in zip(("out", "grad gate", "grad up"), ours, hf):
            cells = [f"{e.mean():.3f}/{e.max():.2f}, {100 * (e <= 0.5).double().mean():.1f}%" for e in (a, b)]
            lines.append(f"{gate_scale:8.0e} {up_scale:8.0e} {name:>10} {cells[0]:>30} {cells[1]:>30}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--width", type=int, default=4096)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"GeGLU (tanh) bf16 vs float64 on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"{args.rows} x {args.width} per magnitude")
    print("\n".join(table(args.rows, args.width, device)))


if __name__ == "__main__":
    main()
