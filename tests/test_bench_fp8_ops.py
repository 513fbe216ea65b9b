"""The fused FP8 op benchmarks compare like with like: on their CPU inputs every column returns the
same output and the same rowwise scales (the payload bytes are compared on the GPU, in
tests/ops/test_fp8_quant.py)."""

import pytest
import torch

pytest.importorskip("torchao.float8")
from tigon.bench.registry import BENCH_OPS  # noqa: E402
import tigon.bench.ops  # noqa: E402,F401  (registers the cases)


@pytest.mark.parametrize("name", ["rms_norm_fp8", "add_rms_norm_fp8", "swiglu_fp8"])
def test_columns_agree(name):
    op = BENCH_OPS[name]
    torch.manual_seed(0)
    args = op.make_inputs(op.cpu_sizes[0], torch.float32, torch.device("cpu"))
    out, rows = op.tigon(*args)[0], op.tigon(*args)[-1]
    for column in (op.eager, op.peer()):
        theirs = column(*args)
        torch.testing.assert_close(theirs[0], out, rtol=1e-6, atol=1e-6)
        assert torch.equal(theirs[2], rows.scale), f"{name}: the columns' scales differ"
