"""The serving benchmark's command line (its measurement runs on the GPU machine)."""

from __future__ import annotations

import pytest

from tigon.serve import bench


@pytest.mark.parametrize("flag", ["--clients", "--rounds", "--sequential", "--max-tokens", "--prompt-tokens"])
def test_a_count_below_one_is_refused_in_one_line(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main([flag, "0"])
    assert exit_info.value.code == 2
    assert f"{flag} must be at least 1, got 0" in capsys.readouterr().err


def test_report_writes_the_ratio_of_the_two_phases(tmp_path, capsys):
    import argparse
    import json

    phase = dict(clients=1, requests=2, tokens=64, wall_s=2.0, latency_p50_s=1.0, latency_p99_s=1.1,
                 ttft_p50_s=0.1, ttft_p99_s=0.2)
    phases = {"one at a time": dict(phase, tokens_per_s=32.0), "concurrent": dict(phase, clients=8, tokens_per_s=320.0)}
    bench.report(argparse.Namespace(model=None, shape="tiny", max_tokens=16, prompt_tokens=8), phases, tmp_path)
    record = json.loads((tmp_path / "serve_bench.json").read_text())
    assert record["speedup"] == 10.0 and record["meets_target"] and record["phases"] == phases
    assert "10.00x tokens/s (target >= 8x)" in capsys.readouterr().out
