import argparse
import dataclasses
import json
import re
import sys

import pytest
import torch

from tigon import ops
from tigon.cli import build_parser, main
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
    assert set(impls) == {"tigon", "eager", "compile", "peer"}
    peer = impls.pop("peer")  # Liger-Kernel's rms_norm, or that it is not installed here
    assert "error" not in peer and ("fwd_bwd_ms" in peer or peer["skipped"] == "liger_kernel is not installed"), peer
    for record in impls.values():
        assert "error" not in record, record
        assert record["fwd_bwd_ms"] > 0
        # The roofline is a GPU's floor; a CPU run has none.
        assert (record["roofline_pct"] > 0) if torch.cuda.is_available() else "roofline_pct" not in record
    assert impls["eager"]["vs_eager"] == 1.0
    assert (tmp_path / "rms_norm.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "vs comp" in out and "launch ms" in out
    # One table for one (op, size); no ratio to a missing measurement, no failure for a missing peer.
    assert out.count("launch ms") == 1 and "nan" not in out and "failed" not in out, out
    if "skipped" in peer:
        assert "peer: not measured, liger_kernel is not installed" in out
    if not torch.cuda.is_available():
        assert "the benchmarks are for CUDA GPUs" in out


def test_bench_rejects_unknown_op(capsys):
    assert main(["bench", "--ops", "nope"]) == 2
    assert "unknown op(s) nope" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs them for real")
@pytest.mark.parametrize("mode, bench", [("--ppo", "the PPO step benchmark"), ("--e2e", "the end-to-end benchmark"),
                                         ("--reward", "tigon bench --reward"), ("--max-context", "the max-context benchmark")])
def test_gpu_benches_without_a_gpu_say_so_in_one_line(capsys, tmp_path, mode, bench):
    assert main(["bench", mode, "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"tigon bench: error: {bench} needs a CUDA GPU\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the benchmarks run on a GPU here")
@pytest.mark.parametrize("module", ["e2e", "max_context", "ppo", "moe_e2e", "vlm_e2e", "embed_e2e", "reward"])
def test_gpu_bench_modules_without_a_gpu_say_so_in_one_line(module, capsys, monkeypatch, tmp_path):
    """`python -m tigon.bench.<module>` (the README's commands) on a machine without a GPU: one
    line and exit status 2, not a traceback."""
    import runpy
    import warnings

    monkeypatch.setattr(sys, "argv", [f"tigon.bench.{module}", "--out", str(tmp_path / "out")])
    with warnings.catch_warnings(), pytest.raises(SystemExit) as stop:
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy's note when the module was imported before
        runpy.run_module(f"tigon.bench.{module}", run_name="__main__")
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m tigon.bench.{module}: error: ") and err.endswith("needs a CUDA GPU\n"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


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


@pytest.mark.parametrize("command", sorted(set(next(
    a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices) - {"sft", "rlhf"}))
def test_other_commands_show_their_defaults(capsys, command):
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    entries = help_entries(capsys, [command])
    for action in sub._actions:
        if action.option_strings[-1:] != ["--help"] and action.default not in (None, False, argparse.SUPPRESS):
            assert "default" in entries[action.option_strings[-1]], entries[action.option_strings[-1]]


def test_a_refused_option_is_the_only_line_a_fresh_process_prints(tmp_path):
    """In a fresh process (where PEFT first imports bitsandbytes, whose CPU backend warns at import
    on CPUs with AVX-512 bf16 about an optional kernel package) a bad option is one line."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "tigon.cli", "sft", "--recompute-mlp", "--no-kernels", "--output-dir", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("tigon sft: error: --recompute-mlp: applied by tigon.patch") and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("argv, line", [
    (["sft", "--lr", "abc"], "tigon sft: error: argument --lr: invalid float value: 'abc' (tigon sft --help lists the options)"),
    (["export", "x"], "tigon export: error: the following arguments are required: --to, --output "
                      "(tigon export --help lists the options)"),
    (["nosuch"], "tigon: error: argument command: invalid choice: 'nosuch' (choose from"),
])
def test_a_bad_argument_is_one_line_not_the_usage(capsys, argv, line):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith(line) and err.count("\n") == 1, err


def test_help_and_a_bad_argument_import_neither_torch_nor_transformers():
    """`tigon --help`, a subcommand's help and an argument error answer at once: the heavy stack
    (torch, Triton, transformers, PEFT) is imported by a command that runs, not by its parsing."""
    import subprocess
    import sys

    code = ("import sys\nfrom tigon.cli import main\n"
            "for argv in (['--help'], ['sft', '--help'], ['serve', '--help'], ['sft', '--lr', 'abc']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('imported:', [m for m in ('torch', 'triton', 'transformers', 'peft') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "imported: []", proc.stdout[-500:]
