"""Importing this package registers every op's benchmark cases (one module per op family)."""

from tigon.bench.ops import norms  # noqa: F401
