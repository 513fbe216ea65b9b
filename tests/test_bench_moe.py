"""The MoE op benchmarks' pipelines on CPU (their numbers mean nothing here)."""

import torch

from tigon.bench.moe_ops import bench_side_by_side, format_side_by_side
from tigon.bench.ops.moe import hf_expert_loop, hf_grouped_mm, make_inputs


def test_transformers_implementations_agree_on_the_bench_inputs():
    args = make_inputs((24, 32, 16, 6, 2), torch.float32, torch.device("cpu"))
    loop, grouped = hf_expert_loop(*args), hf_grouped_mm(*args)
    assert ((loop - grouped).norm() / loop.norm()).item() < 1e-5


def test_side_by_side_records_each_implementation(monkeypatch):
    import tigon.bench.moe_ops as moe_ops

    # One call per timing: the interpreter's kernels are slow, and the numbers are not the point.
    monkeypatch.setattr(moe_ops, "_time_ms", lambda step, device, leaves, graph=False: (step(), 1.0)[1])
    records = bench_side_by_side((24, 32, 16, 6, 2), torch.float32, torch.device("cpu"),
                                 ["tigon-grouped_mm", "hf-loop", "hf-grouped_mm"])
    assert [r["impl"] for r in records] == ["tigon-grouped_mm", "hf-loop", "hf-grouped_mm"]
    assert not [r["error"] for r in records if "error" in r]
    assert records[0]["error_vs_loop"] < 1e-5 and records[1]["vs_hf-loop"] == 1.0
    assert all(r["fwd_bwd_host_ms"] > 0 and r.get("graph_ms") is None for r in records)
    assert len(format_side_by_side(records).splitlines()) == 4


def test_the_grouped_gemm_floor_is_timed_beside_the_loop(monkeypatch):
    """The block's six grouped GEMMs alone get a fwd+bwd time and a ratio to the loop, and no
    error or output comparison."""
    import tigon.bench.moe_ops as moe_ops

    calls = []
    monkeypatch.setattr(moe_ops, "_time_ms", lambda step, device, leaves, graph=False: (calls.append(step()), 2.0)[1])
    floor, loop = bench_side_by_side((24, 32, 16, 6, 2), torch.float32, torch.device("cpu"), ["grouped-gemms", "hf-loop"])
    assert "error" not in floor and "error_vs_loop" not in floor
    assert floor["fwd_bwd_host_ms"] == 2.0 and floor["vs_hf-loop"] == 1.0 and loop["impl"] == "hf-loop"
    assert len(calls) == 1 + 2  # the floor's one timing; the loop's fwd and fwd+bwd
