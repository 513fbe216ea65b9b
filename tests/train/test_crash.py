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

# One worker sets up its finished runs (module fixtures) once, rather than each worker its own.
pytestmark = pytest.mark.xdist_group("train-crash")

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


def attempt(argv: list[str], capsys, caplog) -> tuple[int | str, list[str], str]:
    """`tigon ARGV` in this process: its exit status ("traceback" when it raised), stderr's lines
    and stdout."""
    capsys.readouterr()
    caplog.clear()
    try:
        code: int | str = main(argv)
    except BaseException as err:  # noqa: BLE001 - a traceback is the failure this test looks for
        return "traceback", [f"{type(err).__name__}: {err}"], ""
    out, err = capsys.readouterr()
    return code, [line for line in err.replace("\r", "\n").splitlines() if line.strip()], out


def warned_once(caplog) -> str:
    """What the table adds for the warnings of a command that went on: that it warned, once at most."""
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    return "" if not warnings else ", said once" if len(warnings) == 1 else f" {FAILED}: said {len(warnings)} times"


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
    """Whether `out` ended as the uncut run `whole` did: its final model (and its sft stage's, for
    rlhf's default), the losses of the steps it trained again (`new_steps`), and every loss it kept."""
    got, want = losses(out), losses(whole)
    stage = Path("sft") / "final" / "model.safetensors"
    return (same_model(whole / "final", out / "final", weights) and new_steps <= got.keys() <= want.keys()
            and (not (whole / stage).exists() or same_model(whole, out, str(stage)))
            and all(got[s] == pytest.approx(want[s], rel=1e-6, abs=1e-7) for s in got))


def print_table(title: str, rows: list[tuple[str, str, str, str]], capsys) -> None:
    """`rows` (file, cut, outcome, plain rerun's outcome) on the terminal, then fail on any that failed."""
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    with capsys.disabled():
        print(f"\n{title}")
        for row in rows:
            print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3])
    failed = [r for r in rows if FAILED in r[2] or FAILED in r[3]]
    assert not failed, failed


def files(out: Path, *folders: str) -> list[str]:
    """The files under `folders` of `out`, as paths relative to it."""
    return [p.relative_to(out).as_posix() for folder in folders for p in sorted((out / folder).rglob("*"))
            if p.is_file()]


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
            code, lines, _ = attempt([command, *rerun, "--output-dir", str(out)], capsys, caplog)
            plain = stopped(code, lines, command, path, before, out) or f"{FAILED}: {code} {lines[-3:]}"
            code, lines, _ = attempt([command, *rerun, "--output-dir", str(out), "--resume"], capsys, caplog)
            resumed = stopped(code, lines, command, path, before, out)
            if resumed is None and code == 0:
                kept = {k: v for k, v in before.items() if k.startswith("checkpoint-")
                        and int(k.split("/")[0].split("-")[1]) <= resumed_at and (out / k).parent != path.parent}
                after = stamps(out)
                untouched = all(after.get(k) == v for k, v in kept.items())
                if untouched and ends_like(whole, out, weights, set(range(resumed_at + 1, max(losses(whole)) + 1))):
                    resumed = "goes on = uncut" + warned_once(caplog)
            shutil.rmtree(out)
            rows.append((relative, cut, resumed or f"{FAILED}: {code} {lines[-3:]}", plain))
    return rows


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """The built-in model's LoRA run, checkpointed at 3 and 6, finished (final/, samples.json)."""
    whole = tmp_path_factory.mktemp("crash") / "whole"
    assert main(["sft", *SFT, "--output-dir", str(whole)]) == 0
    return whole


def killed_in_step(step: int, whole: Path, to: Path, newest: str) -> Path:
    """`whole` as a kill during `step` left it: no later checkpoint than `newest`, no final/, and
    metrics up to the step before (the records after `newest` are dropped by --resume)."""
    shutil.copytree(whole, to)
    for later in [p for p in to.glob("checkpoint-*") if p.name != newest] + [to / "final"]:
        shutil.rmtree(later)
    (to / "samples.json").unlink()
    lines = (to / "metrics.jsonl").read_text().splitlines(keepends=True)
    (to / "metrics.jsonl").write_text("".join(line for line in lines if json.loads(line)["step"] < step))
    return to


def test_sft_stopped_run_cut_anywhere(sft_run, tmp_path, capsys, caplog):
    """What --resume reads of a run stopped in step 5: its newest checkpoint, the LoRA base, metrics."""
    caplog.set_level(logging.INFO)
    stage = killed_in_step(5, sft_run, tmp_path / "stage", "checkpoint-3")
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


def test_a_metrics_line_damaged_before_the_last_is_one_line(sft_run, tmp_path, capsys):
    """Not a torn tail (a cut is always at the end): said as the file and line, to be mended by hand."""
    out = killed_in_step(5, sft_run, tmp_path / "out", "checkpoint-3")
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join([lines[0], "{\"step\": 2, \"lo\n", *lines[1:]]))
    before = stamps(out)
    assert main(["sft", *SFT, "--output-dir", str(out), "--resume"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"tigon sft: error: {out / 'metrics.jsonl'} line 2: not a metrics record: delete that line (or the file, "
        "and with it the run's loss curve), then rerun")
    assert stamps(out) == before


RLHF = ["--max-steps", "4", "--batch-size", "4", "--save-steps", "2", "--samples", "0", "--no-kernels"]


@pytest.fixture(scope="module")
def rlhf_stage(tmp_path_factory):
    """`tigon rlhf`'s default (DPO of the built-in model after its sft stage, 3 steps here, into
    OUTPUT_DIR/sft), checkpointed at 2 and 4, finished; kept in place while the module's tests run."""
    root = tmp_path_factory.mktemp("crash-rlhf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(builtin, "SFT_STAGE_STEPS", 3)
        patch.setattr(builtin, "DEMO_SFT", root / "no-demo" / "final")
        whole = root / "whole"
        assert main(["rlhf", *RLHF, "--output-dir", str(whole)]) == 0
        yield whole


def test_rlhf_finished_run_cut_anywhere(rlhf_stage, tmp_path, capsys, caplog):
    """What --resume of a finished `tigon rlhf` run reads: its newest checkpoint, and the model of
    its sft stage (sft/final), which it starts from: a damaged one is completed again from that
    stage's checkpoint, as `tigon sft --resume` does. (What a stopped run reads besides, its
    metrics, is read by the code the sft tables try.)"""
    caplog.set_level(logging.INFO)
    rows = cut_runs(rlhf_stage, rlhf_stage, files(rlhf_stage, "checkpoint-4", "sft/final"), RLHF, "rlhf",
                    "model.safetensors", 4, tmp_path, capsys, caplog)
    print_table("tigon rlhf, finished (file, cut, --resume, plain rerun):", rows, capsys)


@pytest.fixture(scope="module")
def merged(sft_run, tmp_path_factory):
    """`tigon merge` of the sft run's adapter, and what `tigon infer` answers with the merged model."""
    out = tmp_path_factory.mktemp("crash-merge") / "merged"
    assert main(["merge", str(sft_run / "final"), "--output", str(out)]) == 0
    return out


INFER = ["--prompt", "What is 2+2?", "--max-new-tokens", "4"]


def read_back(source: Path, relatives: list[str], argv, same, tmp_path, capsys, caplog) -> list[tuple[str, str, str, str]]:
    """The table of cutting each of `relatives` in the folder `source` at each of `offsets`, then
    running `tigon argv(copy)`: it must stop as `stopped` says, or go on with `same(copy, stdout)`."""
    rows = []
    for relative in relatives:
        for cut, at in offsets(source / relative).items():
            copy = tmp_path / "cut"
            path = damaged_copy(source, copy, relative, at)
            before = stamps(copy)
            command = argv(copy)
            code, lines, stdout = attempt(command, capsys, caplog)
            outcome = stopped(code, lines, command[0], path, before, copy)
            if outcome is None and code == 0 and same(copy, stdout):
                outcome = "goes on = uncut" + warned_once(caplog)
            shutil.rmtree(copy)
            rows.append((relative, cut, outcome or f"{FAILED}: {code} {lines[-3:]}", ""))
    return rows


def test_merge_and_infer_read_back_cut_outputs(sft_run, merged, tmp_path, capsys, caplog):
    """`tigon merge` of a cut adapter (or of its cut base) and `tigon infer` of a cut merged model:
    the damaged file named in one line, never a traceback or an output that looks finished."""
    code, _, answer = attempt(["infer", str(merged), *INFER], capsys, caplog)
    assert code == 0 and answer.strip()

    def merge(run: Path) -> list[str]:  # the adapter names the uncut run's base: --base names the copy's
        return ["merge", str(run / "final"), "--base", str(run / "base"), "--output", str(run / "merged")]

    def merged_as_uncut(run: Path, stdout: str) -> bool:
        return same_model(merged, run / "merged", "model.safetensors")

    rows = read_back(sft_run, files(sft_run, "final", "base"), merge, merged_as_uncut, tmp_path, capsys, caplog)
    print_table("tigon merge RUN/final (file, cut, outcome):", rows, capsys)
    rows = read_back(merged, files(merged, "."), lambda out: ["infer", str(out), *INFER],
                     lambda out, stdout: stdout == answer, tmp_path, capsys, caplog)
    print_table("tigon infer MERGED (file, cut, outcome):", rows, capsys)


def test_a_checkpoint_deleted_halfway_is_not_left_under_its_name(sft_run, tmp_path, monkeypatch):
    """An old checkpoint rotated out by --save-limit (or cleared by --overwrite) as the run is
    killed: what is left of it must not pass for a checkpoint without a manifest (an older
    tigon's), which --resume would take as it is."""
    from tigon.train import checkpoint

    out = tmp_path / "out"
    shutil.copytree(sft_run, out)

    def killed_halfway(path, ignore_errors=False):
        (Path(path) / MANIFEST_FILE).unlink()  # the first file gone, and then the kill
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.remove_path(out / "checkpoint-3")
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["checkpoint-6"]
    assert (out / ".tmp-old-checkpoint-3").is_dir()  # cleared by the next run, as staging is
