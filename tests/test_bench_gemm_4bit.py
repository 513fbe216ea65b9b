"""python -m tigon.bench.gemm_4bit on the CPU (the interpreter's fused kernel): the records and
table it prints. float16 here, as the interpreter's bfloat16 dot is broken; the GPU times bf16."""

import pytest
import torch

from tigon.bench import gemm_4bit as bench

pytest.importorskip("bitsandbytes.functional")


def test_records_ratios_and_table(capsys):
    impls = ["fused", "bnb-dequant", "bf16-gemm"]
    records = bench.bench_shape((24, 64), [5], impls, torch.device("cpu"), torch.float16)
    assert [(r["tokens"], r["pass"], r["rule"]) for r in records] == [(5, "forward", "dequant"), (5, "input-grad", "dequant")]
    for r in records:
        assert not any(key.endswith("_failed") for key in r), r
        assert r["fused_rel_err"] < 1e-2
        assert r["fused_vs_bnb-dequant_graph"] == pytest.approx(r["fused_graph_ms"] / r["bnb-dequant_graph_ms"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("24x64") and "input-grad" in lines[1]
    assert bench.header(impls).split()[4:7] == impls


def test_bad_shapes_and_no_gpu(monkeypatch, capsys):
    assert bench._shapes(["8b", "100x64"]) == bench.SHAPES["8b"] + [(100, 64)]
    with pytest.raises(SystemExit, match="--shapes takes 8b, 70b or OUTxIN"):
        bench._shapes(["4096"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--tokens", "16"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().out
