"""`python -m tigon.bench.seqpar` without a GPU: one line saying it needs one, not a traceback."""

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs it for real")
def test_seqpar_bench_says_it_needs_a_gpu(capsys, tmp_path):
    from tigon.bench import seqpar

    assert seqpar.main(["--seq", "64", "--variant", "long", "--out", str(tmp_path)]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["tigon.bench.seqpar: tigon.bench.seqpar needs a CUDA GPU"]
    assert not list(tmp_path.iterdir())
