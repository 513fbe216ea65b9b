"""The VLM end-to-end benchmark's pipeline on the CPU (speed is the GPU's): eager, tigon, same losses."""

from __future__ import annotations

import math

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
    from tigon.bench.vlm_e2e import SHAPES

    assert eager["losses"][0] == pytest.approx(math.log(SHAPES["tiny"]["text"]["vocab_size"]), rel=0.1)  # random weights


def test_vlm_bench_full_mode_is_qwen2_vl_times_the_vision_tower_and_compares_losses(tmp_path):
    import json

    lines = []
    records = run_vlm_e2e(["full"], ["eager", "tigon"], batch=1, seq=300, steps=1, warmup=0, shape="tiny-2b",
                          loss_steps=3, vision_reps=1, device=torch.device("cpu"), log=lines.append, out_dir=tmp_path)
    assert [r.get("error") for r in records] == [None, None]
    eager, tigon = records
    assert "Qwen2VLForConditionalGeneration" in tigon["applied"]
    assert "layer_norm" in tigon["applied"] and "gelu_mlp" in tigon["applied"]  # its tower's kernels
    assert len(eager["losses"]) == len(tigon["losses"]) == 3
    assert tigon["losses"] == pytest.approx(eager["losses"], rel=1e-4)
    assert eager["vision_ms"] > 0 and tigon["vision_vs_eager"] == pytest.approx(tigon["vision_ms"] / eager["vision_ms"])
    printed = "\n".join(lines).splitlines()
    assert any(line.startswith("vision tower fwd+bwd  full  tigon") for line in printed)
    assert any(line.startswith("losses over 3 steps  full  tigon") for line in printed)
    saved = json.loads((tmp_path / "vlm_e2e.json").read_text())
    assert saved["results"][1]["vision_vs_eager"] == tigon["vision_vs_eager"]
    assert saved["results"][0]["losses"] == eager["losses"]
    pytest.importorskip("matplotlib")
    assert (tmp_path / "vlm_losses.png").stat().st_size > 0


def test_vlm_bench_2b_shape_is_qwen2_vl_2b():
    from tigon.bench.vlm_e2e import SHAPES

    two_b = SHAPES["2b"]
    assert two_b["family"] == "qwen2_vl"
    assert two_b["vision"] | {"hidden_size": 0} == dict(
        depth=32, embed_dim=1280, mlp_ratio=4, num_heads=16, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
        in_channels=3, hidden_act="quick_gelu", hidden_size=0)
    assert two_b["vision"]["hidden_size"] == two_b["text"]["hidden_size"] == 1536


def test_vlm_bench_compile_column_runs_the_step_and_the_tower_through_torch_compile(monkeypatch):
    """The compile column trains through torch.compile of the whole model and times the compiled
    tower (compiled for real on the GPU; here torch.compile is recorded and handed back as is,
    the CPU compile being minutes)."""
    compiled = []

    class Compiled(torch.nn.Module):  # as torch.compile's wrapper, it answers len() from the module it wraps
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

        def __len__(self):
            return len(self.module)

    def record(module, **kwargs):
        compiled.append(type(module).__name__)
        return Compiled(module)

    monkeypatch.setattr(torch, "compile", record)
    records = run_vlm_e2e(["full"], ["eager", "compile"], batch=1, seq=300, steps=1, warmup=0, shape="tiny-2b",
                          vision_reps=1, device=torch.device("cpu"), log=lambda line: None)
    assert [r.get("error") for r in records] == [None, None]
    assert compiled == ["Qwen2VLForConditionalGeneration", "Qwen2VisionTransformerPretrainedModel"]
    eager, comp = records
    assert comp["impl"] == "compile" and comp["losses"] == pytest.approx(eager["losses"], rel=1e-6)
    assert comp["vision_ms"] > 0
