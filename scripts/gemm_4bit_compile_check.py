"""Compile every tunable tile of the fused 4-bit GEMM for Hopper (sm_90) on a machine without a
GPU: Triton compiles to a cubin from a target alone. Catches tiles the GPU's Triton cannot
compile (Triton 3.6 refused the interleaved plain tiles) before a device call is spent on them.
Run it under the GPU's Triton version, e.g. a wheel unpacked with pip install --target:

    PYTHONPATH=/tmp/triton36:src python scripts/gemm_4bit_compile_check.py [--gather]
"""

from __future__ import annotations

import argparse
import time

import triton
from triton.backends.compiler import GPUTarget

from tigon.ops import gemm_4bit

# bitsandbytes' NF4 code values (any 16 values exercise the lookup's PTX the same way)
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gather", action="store_true", help="the codes' values from memory, not the register lookup")
    args = parser.parse_args()
    if not gemm_4bit.CONFIGS:
        print("gemm_4bit_compile_check.py: no tiles to compile (TRITON_INTERPRET is set, or Triton is missing)")
        return 1
    lookup = "" if args.gather else gemm_4bit.code_lookup_ptx(NF4)
    print(f"triton {triton.__version__}: {len(gemm_4bit.CONFIGS)} tiles x forward / input gradient for sm_90")
    failures = 0
    for config in gemm_4bit.CONFIGS:
        for backward in (False, True):
            start = time.perf_counter()
            try:
                gemm_4bit.compile_tile(config, backward, GPUTarget("cuda", 90, 32), lookup)
            except Exception as error:  # a tile this Triton cannot compile: say which, go on
                failures += 1
                print(f"FAILED {'input grad' if backward else 'forward'} {config}: {str(error).splitlines()[0]}")
                continue
            print(f"ok {'input grad' if backward else 'forward'} {config} ({time.perf_counter() - start:.1f} s)")
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
