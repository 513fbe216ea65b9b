"""Crash at any byte: each file of tigon's output that a later command reads is cut at a spread of
offsets (and deleted), and the command that reads it must either go on exactly as it would with the
file whole, or stop with one line naming the file (and what to do) having changed nothing: never a
traceback, never training on from damaged state, never deleting an intact checkpoint. Each test
prints its table, file x cut -> outcome (pytest -s shows them; they are also in the report)."""

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.train.test_sft import RESUMABLE, SHORT
from tigon.cli import main
from tigon.train import builtin
from tigon.train.checkpoint import MANIFEST_FILE

pytest.importorskip("peft")

TEXT = {".json", ".jsonl", ".md", ".jinja"}
SFT = [*SHORT, *RESUMABLE, "--save-steps", "3"]
FAILED = "FAIL"


def offsets(path: Path) -> dict[str, int | None]:
    """Where `path` is cut (None: deleted), by name; offsets that coincide are tried once."""
    data = path.read_bytes()
    size = len(data)
    if path.suffix in TEXT:
        body = data.rstrip(b"\n")
        inside_last = (body.rfind(b"\n") + 1 + len(body)) // 2  # the middle of the last line
    else:
        inside_last = size - 11  # in a zip's (torch.save's) end record, in a safetensors' last tensor
    cuts: dict[str, int | None] = {}
    for name, at in (("0", 0), ("1", 1), ("middle", size // 2), ("last byte", size - 1), ("last record", inside_last)):
        if 0 <= at < size and at not in cuts.values():
            cuts[name] = at
    cuts["missing"] = None
    return cuts


def damaged_copy(source: Path, to: Path, relative: str, at: int | None) -> Path:
    """A copy of the output `source` at `to` with its file `relative` cut at `at` (None: deleted)."""
    shutil.copytree(source, to)
    path = to / relative
    if at is None:
        path.unlink()
    else:
        os.truncate(path, at)
    return path


def stamps(out: Path) -> dict[str, tuple[int, int]]:
    """Every file under `out`, with its size and modification time: what shows any write or deletion."""
    return {p.relative_to(out).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(out.rglob("*")) if p.is_file()}


def attempt(argv: list[str], capsys, caplog) -> tuple[int | str, list[str]]:
    """`tigon ARGV` in this process: its exit status ("traceback" when it raised) and stderr's lines."""
    capsys.readouterr()
    caplog.clear()
    try:
        code: int | str = main(argv)
    except BaseException as err:  # noqa: BLE001 - a traceback is the failure this test looks for
        return "traceback", [f"{type(err).__name__}: {err}"]
    err = capsys.readouterr().err
    return code, [line for line in err.replace("\r", "\n").splitlines() if line.strip()]


def stopped(code: int | str, lines: list[str], command: str, path: Path, before: dict, out: Path) -> str | None:
    """The outcome of a run that stopped, or None when it did not stop as it must: one line, naming
    the damaged file, nothing written or deleted."""
    if code != 2 or len(lines) != 1 or not lines[0].startswith(f"tigon {command}: error: "):
        return None
    if stamps(out) != before:
        return None
    return "stops: names the file" if str(path) in lines[0] else "stops"


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def same_model(a: Path, b: Path, name: str) -> bool:
    x, y = load_file(a / name), load_file(b / name)
    return x.keys() == y.keys() and all(torch.allclose(x[k], y[k], rtol=1e-6, atol=1e-7) for k in x)


def ends_like(whole: Path, out: Path, weights: str, new_steps: set[int]) -> bool:
    """Whether `out` ended as the uncut run `whole` did: its final model, the losses of the steps it
    trained again (`new_steps`), and every loss it kept."""
    got, want = losses(out), losses(whole)
    return (same_model(whole / "final", out / "final", weights) and new_steps <= got.keys() <= want.keys()
            and all(got[s] == pytest.approx(want[s], rel=1e-6, abs=1e-7) for s in got))


def print_table(title: str, rows: list[tuple[str, str, str, str]], capsys) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    with capsys.disabled():
        print(f"\n{title}")
        for row in rows:
            print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3])
    failed = [r for r in rows if FAILED in r[2] or FAILED in r[3]]
    assert not failed, failed


def files(out: Path, *folders: str) -> list[str]:
    return [p.relative_to(out).as_posix() for folder in folders for p in sorted((out / folder).rglob("*"))
            if p.is_file()] if folders else []


def cut_runs(whole: Path, stage: Path, relatives: list[str], rerun: list[str], command: str, weights: str,
             resumed_at: int, tmp_path: Path, capsys, caplog) -> list[tuple[str, str, str, str]]:
    """The table of cutting each of `relatives` in the output `stage` (`whole` run and then stopped,
    or whole itself) at each of `offsets`: `--resume` and a plain rerun of `rerun` on the copy.
    A resume must stop as `stopped` says or end as the uncut run did (`ends_like`), from step
    `resumed_at` on, with the checkpoints it did not train over unchanged."""
    rows = []
    for relative in relatives:
        for cut, at in offsets(stage / relative).items():
            out = tmp_path / "cut"
            path = damaged_copy(stage, out, relative, at)
            before = stamps(out)
            code, lines = attempt([command, *rerun, "--output-dir", str(out)], capsys, caplog)
            plain = stopped(code, lines, command, path, before, out) or f"{FAILED}: {code} {lines[-3:]}"
            code, lines = attempt([command, *rerun, "--output-dir", str(out), "--resume"], capsys, caplog)
            resumed = stopped(code, lines, command, path, before, out)
            if resumed is None and code == 0:
                kept = {k: v for k, v in before.items() if k.startswith("checkpoint-")
                        and int(k.split("/")[0].split("-")[1]) <= resumed_at and not (out / k).parent == path.parent}
                after = stamps(out)
                untouched = all(after.get(k) == v for k, v in kept.items())
                if untouched and ends_like(whole, out, weights, set(range(resumed_at + 1, max(losses(whole)) + 1))):
                    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
                    resumed = "goes on = uncut" + (f" (warns: {said[0][:60]}...)" if said else "")
            shutil.rmtree(out)
            rows.append((relative, cut, resumed or f"{FAILED}: {code} {lines[-3:]}", plain))
    return rows


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """The built-in model's LoRA run, checkpointed at 3 and 6, finished (final/, samples.json)."""
    whole = tmp_path_factory.mktemp("crash") / "whole"
    assert main(["sft", *SFT, "--output-dir", str(whole)]) == 0
    return whole


def stopped_in_step_5(whole: Path, to: Path, newest: str) -> Path:
    """`whole` as a kill during step 5 left it: no later checkpoint than `newest`, no final/, and
    metrics up to step 4 (that run's records of steps 4 and 5 are dropped by --resume)."""
    shutil.copytree(whole, to)
    for later in [p for p in to.glob("checkpoint-*") if p.name != newest] + [to / "final"]:
        shutil.rmtree(later)
    (to / "samples.json").unlink()
    lines = (to / "metrics.jsonl").read_text().splitlines(keepends=True)
    (to / "metrics.jsonl").write_text("".join(line for line in lines if json.loads(line)["step"] <= 4))
    return to


def test_sft_stopped_run_cut_anywhere(sft_run, tmp_path, capsys, caplog):
    """What --resume reads of a run stopped in step 5: its newest checkpoint, the LoRA base, metrics."""
    caplog.set_level(logging.INFO)
    stage = stopped_in_step_5(sft_run, tmp_path / "stage", "checkpoint-3")
    rows = cut_runs(sft_run, stage, [*files(stage, "checkpoint-3", "base"), "metrics.jsonl"], SFT, "sft",
                    "adapter_model.safetensors", 3, tmp_path, capsys, caplog)
    print_table("tigon sft, stopped in step 5 (file, cut, --resume, plain rerun):", rows, capsys)


def test_sft_finished_run_cut_anywhere(sft_run, tmp_path, capsys, caplog):
    """What --resume reads of a finished run: its newest checkpoint and final/ (and samples.json,
    which nothing reads back: cut, it changes nothing)."""
    caplog.set_level(logging.INFO)
    rows = cut_runs(sft_run, sft_run, [*files(sft_run, "checkpoint-6", "final"), "samples.json"], SFT, "sft",
                    "adapter_model.safetensors", 6, tmp_path, capsys, caplog)
    print_table("tigon sft, finished (file, cut, --resume, plain rerun):", rows, capsys)
