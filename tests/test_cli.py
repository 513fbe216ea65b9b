import json

from tigon.cli import main


def test_env_lists_every_op(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for op in ("rms_norm", "add_rms_norm", "layer_norm"):
        assert op in out
    assert "torch" in out and "triton" in out
    # linear_group has no Triton kernel: its fused backward runs wherever torch does.
    assert "linear_group           torch (no Triton kernel needed)" in out


def test_env_reports_a_disabled_torch_op(monkeypatch, capsys):
    monkeypatch.setenv("TIGON_DISABLE", "linear_group")
    assert main(["env"]) == 0
    assert "linear_group           reference: disabled by TIGON_DISABLE" in capsys.readouterr().out


def test_bench_writes_json_and_plot(tmp_path, capsys):
    assert main(["bench", "--ops", "rms_norm", "--sizes", "64x100", "--dtype", "fp32", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "bench.json").read_text())
    impls = {r["impl"]: r for r in payload["results"]}
    assert set(impls) == {"tigon", "eager", "compile"}
    for record in impls.values():
        assert "error" not in record, record
        assert record["fwd_bwd_ms"] > 0 and record["roofline_pct"] > 0
    assert impls["eager"]["vs_eager"] == 1.0
    assert (tmp_path / "rms_norm.png").stat().st_size > 0
    header = capsys.readouterr().out
    assert "vs comp" in header and "launch ms" in header


def test_bench_rejects_unknown_op(capsys):
    assert main(["bench", "--ops", "nope"]) == 2
    assert "unknown op(s) nope" in capsys.readouterr().err
