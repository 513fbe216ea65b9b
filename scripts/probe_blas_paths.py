"""Do cuBLAS's two front ends run the GEMMs under the open targets at the same rate? (GPU only)

torch sends a plain `mm` to cuBLAS and an `addmm` with a bias vector to cuBLASLt's bias epilogue;
`torch.backends.cuda.preferred_blas_library("cublaslt")` sends every GEMM to cuBLASLt. Each picks
its kernel by its own heuristic, so at one shape they can differ. This times the frozen-base GEMMs
of lora_linear (issue #5), the gated MLP's, and the linear + cross-entropy GEMMs whole and in the
128 MiB budget's 512-row chunks (issue #4), each way, CUDA-graph timed, and prints TFLOP/s.

    PYTHONPATH=src python3 scripts/probe_blas_paths.py [--out DIR]   (writes blas_paths.json)
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from triton.testing import do_bench_cudagraph

DEVICE, DTYPE = "cuda", torch.bfloat16


def operands(m: int, n: int, k: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A (m, k) and B (k, n) for ``A @ B``, B stored as (n, k) for layout "nt" (x Wᵀ), as (k, n)
    for "nn" (dy W) and A stored as (k, m) for "tn" (Gᵀ h)."""
    a = torch.randn(k, m, device=DEVICE, dtype=DTYPE).t() if layout == "tn" else torch.randn(m, k, device=DEVICE, dtype=DTYPE)
    b = torch.randn(n, k, device=DEVICE, dtype=DTYPE).t() if layout == "nt" else torch.randn(k, n, device=DEVICE, dtype=DTYPE)
    return a, b


def time_paths(m: int, n: int, k: int, layout: str) -> dict[str, float]:
    a, b = operands(m, n, k, layout)
    out = torch.empty(m, n, device=DEVICE, dtype=DTYPE)
    zero_bias = torch.zeros(n, device=DEVICE, dtype=DTYPE)
    times = {}
    preferred = torch.backends.cuda.preferred_blas_library()
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        times[f"mm via {library}"] = do_bench_cudagraph(lambda: torch.mm(a, b, out=out), rep=200)
    torch.backends.cuda.preferred_blas_library(preferred)
    times["addmm with bias vector (cuBLASLt epilogue)"] = do_bench_cudagraph(
        lambda: torch.addmm(zero_bias, a, b, out=out), rep=200)
    times["mm accumulating (beta=1)"] = do_bench_cudagraph(lambda: out.addmm_(a, b), rep=200)
    return times


SHAPES = [
    ("lora_linear forward x Wᵀ", 16384, 4096, 4096, "nt"),
    ("lora_linear backward dy W", 16384, 4096, 4096, "nn"),
    ("gated MLP gate/up x Wᵀ", 8192, 14336, 4096, "nt"),
    ("gated MLP down h Wᵀ", 8192, 4096, 14336, "nt"),
    ("gated MLP down backward dy W", 8192, 14336, 4096, "nn"),
    ("gated MLP gate/up backward dy W", 8192, 4096, 14336, "nn"),
    ("LCE logits h Wᵀ, 8192 rows", 8192, 128256, 4096, "nt"),
    ("LCE dh = G W, 8192 rows", 8192, 4096, 128256, "nn"),
    ("LCE dW = Gᵀ h, 8192 rows", 128256, 4096, 8192, "tn"),
    ("LCE logits h Wᵀ, 512-row chunk", 512, 128256, 4096, "nt"),
    ("LCE dh = G W, 512-row chunk", 512, 4096, 128256, "nn"),
    ("LCE dW = Gᵀ h, 512-row chunk", 128256, 4096, 512, "tn"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "cuda", torch.version.cuda)
    rows = []
    for name, m, n, k, layout in SHAPES:
        times = time_paths(m, n, k, layout)
        torch.cuda.empty_cache()
        tflop = 2 * m * n * k / 1e12
        best = min(times, key=times.get)
        print(f"{name} ({m}x{n}x{k} {layout}):")
        for path, t in times.items():
            print(f"    {path:45s} {t:8.3f} ms  {tflop / t * 1e3:6.0f} TFLOP/s{'  <- fastest' if path == best else ''}")
        rows.append(dict(name=name, m=m, n=n, k=k, layout=layout, ms=times))
    with open(os.path.join(args.out, "blas_paths.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
