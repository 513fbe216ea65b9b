"""Op benchmarks: tigon against PyTorch eager and torch.compile, measured in the same run."""

from tigon.bench.harness import run_benchmarks
from tigon.bench.registry import BENCH_OPS, BenchOp

__all__ = ["BENCH_OPS", "BenchOp", "run_benchmarks"]
