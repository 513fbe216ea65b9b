import argparse
import dataclasses
import json
import re

import pytest

from tigon.cli import build_parser, main


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


def help_entries(capsys, argv):
    """Each option's --help entry (flags, metavar and help text as one line), by its long flag."""
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    text = capsys.readouterr().out.split("options:", 1)[1]
    entries = {}
    for chunk in re.split(r"\n(?=  -)", text.strip("\n")):
        words = " ".join(chunk.split())
        flag = next(w.rstrip(",") for w in words.split() if w.startswith("--"))
        entries[flag] = words
    return entries


def test_sft_help_shows_every_default_and_choice(capsys):
    from tigon.train.config import SFTConfig

    entries = help_entries(capsys, ["sft"])
    for f in dataclasses.fields(SFTConfig):
        entry = entries["--" + f.name.replace("_", "-")]
        assert "default" in entry, entry
        if "choices" in f.metadata:
            assert "{" + ",".join(f.metadata["choices"]) + "}" in entry, entry
    assert "(default: 16)" in entries["--lora-rank"] and "(default: off)" in entries["--packing"]
    assert "(0: none, only final/; default: 500)" in entries["--save-steps"]
    assert "--report-to {none,tensorboard,wandb,mlflow,trackio}" in entries["--report-to"]


@pytest.mark.parametrize("command", [["merge", "adapter"], ["infer", "model"], ["chat", "model"], ["bench"]])
def test_other_commands_show_their_defaults(capsys, command):
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command[0]]
    entries = help_entries(capsys, command[:1])
    for action in sub._actions:
        if action.option_strings[-1:] != ["--help"] and action.default not in (None, False, argparse.SUPPRESS):
            assert "default" in entries[action.option_strings[-1]], entries[action.option_strings[-1]]
