"""The VLM end-to-end benchmark's pipeline on the CPU (speed is the GPU's): eager, tigon, same losses."""

from __future__ import annotations

import pytest
import torch

from tigon.bench.vlm_e2e import run_vlm_e2e


def test_vlm_bench_runs_eager_and_tigon_to_the_same_losses():
    records = run_vlm_e2e(["lora"], ["eager", "tigon"], batch=1, seq=300, steps=1, warmup=0, shape="tiny",
                          device=torch.device("cpu"), log=lambda line: None)
    assert [r.get("error") for r in records] == [None, None]
    eager, tigon = records
    assert "linear_cross_entropy" in tigon["applied"]
    assert tigon["losses"] == pytest.approx(eager["losses"], rel=1e-4)
    assert eager["losses"][0] == pytest.approx(torch.log(torch.tensor(152064.0)).item(), rel=0.1)
