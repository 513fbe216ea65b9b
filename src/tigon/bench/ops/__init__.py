"""Importing this package registers every op's benchmark cases (one module per op family)."""

from tigon.bench.ops import cross_entropy  # noqa: F401
from tigon.bench.ops import fp8  # noqa: F401
from tigon.bench.ops import gemm_4bit  # noqa: F401
from tigon.bench.ops import glu  # noqa: F401
from tigon.bench.ops import info_nce  # noqa: F401
from tigon.bench.ops import lora  # noqa: F401
from tigon.bench.ops import moe  # noqa: F401
from tigon.bench.ops import norms  # noqa: F401
from tigon.bench.ops import preference  # noqa: F401
from tigon.bench.ops import rl  # noqa: F401
from tigon.bench.ops import rope  # noqa: F401
from tigon.bench.ops import vision  # noqa: F401
