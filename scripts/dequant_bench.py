"""tigon's NF4 dequantisation against bitsandbytes' on the Llama-3-8B MLP weight (14336 x 4096,
double quantisation, bf16 out): µs per call and the fraction of the copy roofline (read the packed
codes and absmax codes, write the bf16 weight), over a few tile sizes and warp counts.

    PYTHONPATH=src python3 scripts/dequant_bench.py
"""

import bitsandbytes.functional as bnbf
import torch
import triton.testing

from tigon.ops import dequantize as dq
from tigon.patch.quantized import from_4bit

COPY_BYTES_PER_S = 4.2e12


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("dequant_bench.py: times CUDA kernels: run it on a machine with a GPU")
    torch.manual_seed(0)
    weight = torch.randn(14336, 4096, dtype=torch.bfloat16, device="cuda") * 0.02
    data, state = bnbf.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    q = from_4bit(data, state)
    out = torch.empty_like(weight)
    moved = data.numel() + state.absmax.numel() + 2 * weight.numel()
    floor_us = moved / COPY_BYTES_PER_S * 1e6
    want = bnbf.dequantize_4bit(data, state)
    us = triton.testing.do_bench(lambda: bnbf.dequantize_4bit(data, state)) * 1e3
    print(f"bitsandbytes: {us:7.1f} us ({floor_us / us:.0%} of the {floor_us:.1f} us floor)")
    for bytes_per_program in (512, 1024, 2048, 4096):
        for warps in (4, 8):
            dq.BYTES_PER_PROGRAM, dq.NUM_WARPS = bytes_per_program, warps
            dq.dequantize(q, torch.bfloat16, out=out)
            assert torch.equal(out, want), "not bit for bit"
            us = triton.testing.do_bench(lambda: dq.dequantize(q, torch.bfloat16, out=out)) * 1e3
            print(f"tigon {bytes_per_program:5d} bytes/program, {warps} warps: {us:7.1f} us ({floor_us / us:.0%})")


if __name__ == "__main__":
    main()
