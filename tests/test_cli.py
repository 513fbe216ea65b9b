import json

from tigon import ops
from tigon.cli import main
from tigon.ops import _dispatch


def _env_groups(out):
    """`tigon env`'s op listing: {heading: [op, ...]}."""
    groups, heading = {}, None
    for line in out.split("\nops on ")[1].splitlines()[1:]:
        if line.startswith("    "):
            groups[heading].append(line.strip())
        elif line.strip():
            heading = line.strip()
            groups[heading] = []
    return groups


def test_env_lists_every_op_once(capsys):
    assert main(["env"]) == 0
    groups = _env_groups(capsys.readouterr().out)
    assert sorted(op for names in groups.values() for op in names) == sorted(ops.op_names())
    assert "rms_norm" in groups["Triton kernels"]
    # linear_group has no Triton kernel: its fused backward runs wherever torch does.
    assert "linear_group" in groups["torch calls only (no Triton kernel), on any device"]


def test_env_says_each_fallback_reason_once(monkeypatch, capsys):
    monkeypatch.setattr(_dispatch, "INTERPRET", False)
    monkeypatch.setenv("TIGON_DISABLE", "linear_group,rope")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    groups = _env_groups(out)
    assert out.count("tensors are on cpu") == 1 and out.count("disabled by TIGON_DISABLE") == 1
    assert groups["PyTorch reference: disabled by TIGON_DISABLE"] == ["rope", "linear_group"]
    on_cpu = next(names for heading, names in groups.items() if "tensors are on cpu" in heading)
    assert "rms_norm" in on_cpu and "rope" not in on_cpu


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
