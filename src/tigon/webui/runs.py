"""Runs as the web UI sees them: each one is a `tigon sft` / `tigon rlhf` process of the command
line, started with ``--output-dir RUNS/NAME``, and everything shown about it is read back from
that directory (metrics.jsonl, checkpoints, the process's log) or from the process itself.

Nothing here imports gradio: the UI (tigon.webui.app) only lays these functions out.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tigon
from tigon.train.checkpoint import list_checkpoints, written_atomically
from tigon.train.config import METHODS, RLHFConfig, SFTConfig, add_sft_arguments
from tigon.train.rewards import BUILTIN, builtin_names
from tigon.train.run import finished
from tigon.train.vision_data import MEDIA_ROOT_ENV

RUN_FILE = "tigon-webui.json"  # the command, pid and exit of a run the UI started
LOG_FILE = "tigon-webui.log"  # the process's stdout and stderr, interleaved as written
METRICS_FILE = "metrics.jsonl"  # as tigon.train.callbacks writes it
FINAL_DIR = "final"
UPLOADS_DIR = "uploads"
EXPORT_PREFIX = "export-"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# A Hugging Face hub id: NAME or OWNER/NAME (the hub itself refuses "..", as this does).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
DATASET_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")  # what tigon.train.data reads
EXPORT_DTYPES = ("auto", "bf16", "f16", "f32", "q8_0")  # what `tigon export --dtype` takes
# tqdm's "12/20 [" (steps done / planned), the last one on a line being what a terminal shows.
_PROGRESS = re.compile(r"(\d+)/(\d+) \[")

RUNNING, FINISHED, FAILED, STOPPED = "running", "finished", "failed", "stopped"
# A run the UI did not start (or whose exit it did not see) that has no final model: it may have
# crashed, been stopped, or be running elsewhere; nothing on disk says which.
INCOMPLETE = "incomplete"


class WebUIError(ValueError):
    """A problem with what was asked in the UI, shown there as one line."""


@dataclass
class TrainSettings:
    """What the Train tab asks for. ``None`` (or an empty string) leaves the option to the
    command's own default, so the command line shown is the shortest that does the same."""

    method: str = "sft"
    model: str = ""
    dataset: str = ""  # paths separated by spaces (shell quoting for paths with spaces)
    tuner: str = "full"
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lr: float | None = None
    max_steps: int | None = None
    max_length: int | None = None
    save_steps: int | None = None
    packing: bool = False
    kernels: bool = True
    extra: str = ""  # further options, as typed on a command line
    name: str = ""


def _num(value: float | None) -> str:
    return format(value, ".15g") if isinstance(value, float) else str(value)


def _option(flag: str, value: str) -> list[str]:
    """`flag` and its value as two arguments, or as one (``--flag=-x``) where the value starts with
    a dash and would read as an option."""
    return [f"{flag}={value}"] if value.startswith("-") else [flag, value]


# The Train tab's tasks besides sft and `tigon rlhf`'s methods: the command each starts (rm, ppo
# and rloo are rlhf methods). Each runs its embedded default with no model and no data.
OTHER_TASKS = {
    "classification": ["sft", "--task", "classification"],  # also a reranker, on {query, document, label} rows
    "embed": ["embed"],
}


def available_methods() -> list[str]:
    """``sft``, the other tasks of `OTHER_TASKS` and, when TRL (which `tigon rlhf` runs on) is
    installed, the methods `tigon rlhf --method` takes (reward models, PPO and RLOO among them)."""
    return ["sft", *OTHER_TASKS, *(METHODS if importlib.util.find_spec("trl") is not None else ())]


def task_command(method: str) -> list[str]:
    """The `tigon` command (and its fixed options) a Train-tab method starts."""
    if method == "sft" or method in OTHER_TASKS:
        return list(OTHER_TASKS.get(method, ["sft"]))
    return ["rlhf", "--method", method]


def _config_class(method: str) -> type:
    from tigon.train.embed_config import EmbedConfig

    return {"embed": EmbedConfig}.get(method, SFTConfig if method in ("sft", *OTHER_TASKS) else RLHFConfig)


# The options of "more options", by what they may be given. The form's own fields, and what the
# UI decides itself, come from the form only; files are checked to lie in the runs folder; free
# text is taken only where it names no file and no code. Options not listed here are refused.
_FROM_THE_FORM = {"model": "model", "dataset": "dataset", "tuner": "tuner", "lora_rank": "LoRA rank",
                  "lora_alpha": "LoRA alpha", "lr": "learning rate", "max_steps": "steps",
                  "max_length": "max length", "save_steps": "checkpoint every", "packing": "packing",
                  "kernels": "tigon kernels", "method": "method", "task": "method"}
_NOT_FROM_THE_UI = {"config": "a settings file", "output_dir": "the run's folder, RUNS/NAME, is the UI's",
                    "resume": "the UI starts new runs", "overwrite": "the UI starts new runs in new folders"}
_FREE_TEXT = ("target_modules", "kernels_off", "format_regex", "labels", "matryoshka_dims")


class _OptionParser(argparse.ArgumentParser):
    """The options of `tigon sft` / `tigon rlhf`, whose errors are a WebUIError instead of an exit."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise WebUIError(f"more options: {message}")


def _ended_line(lines: list[str], code: int) -> str:
    """What a process that exited with `code` said last, leaving out its progress bar (which tqdm
    redraws once more at exit): its error, how it stopped, or where it wrote its result."""
    last = next((line for line in reversed(lines) if line.strip() and not _PROGRESS.search(line)), "")
    if code >= 0:
        return last or f"exited with status {code}"
    ended = f"ended by {signal.Signals(-code).name}"
    return f"{ended}: {last}" if last else ended


def _terminal_lines(text: str) -> list[str]:
    """`text` as a terminal shows it: a line redrawn with carriage returns is its last state."""
    return [shown for line in text.split("\n") if (shown := line.split("\r")[-1].rstrip()).strip()]


def log_tail(path: Path, lines: int = 40, max_bytes: int = 65536) -> list[str]:
    """The last `lines` lines of a log, as a terminal shows them."""
    if not path.is_file():
        return []
    with path.open("rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
        return _terminal_lines(f.read().decode("utf-8", errors="replace"))[-lines:]


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The lines of a run's metrics.jsonl. The run may be appending while we read: a last line
    without its newline is not complete yet and is left for the next read."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return []
    complete = path.read_text(encoding="utf-8").split("\n")[:-1]
    records = []
    for line in complete:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # not written by tigon: show the rest
    return records


@dataclass
class RunInfo:
    """What the UI shows about one run."""

    name: str
    path: str
    status: str
    method: str = ""
    step: int | None = None
    total_steps: int | None = None
    final_loss: float | None = None
    tokens_per_s: float | None = None
    peak_memory: str = ""
    started: str = ""
    message: str = ""  # the process's last line once it has ended (its error, or how it stopped)
    checkpoint: str = ""  # newest complete checkpoint
    command: str = ""
    exit_code: int | None = None
    log: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pid_runs(pid: int, run_dir: Path) -> bool:
    """Whether process `pid` is alive and is this run (its command line names the run's
    directory), so that a reused pid is not mistaken for the run."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not cmdline.is_file():
        return True  # no /proc: trust the pid
    try:
        return str(run_dir) in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False


def _peak_rss_gib(pid: int) -> float | None:
    """A running process's peak resident memory so far (Linux's VmHWM), None where unknown."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    return round(int(match.group(1)) / 2**20, 2) if match else None


def _median_speed(records: list[dict[str, Any]]) -> float | None:
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    if len(rates) > 2:
        rates = rates[1:]  # the first interval carries start-up (as tigon sft's summary leaves it out)
    return round(statistics.median(rates), 1) if rates else None


def _child_env(root: Path) -> dict[str, str]:
    """The UI's environment, so that the child runs this same tigon (a source checkout on
    PYTHONPATH or the installed one) and writes its log as it goes (Python block-buffers output
    to a file otherwise), reading the images and frames its data files name only from inside the
    runs folder `root`."""
    env = dict(os.environ)
    env[MEDIA_ROOT_ENV] = str(root)
    package_root = str(Path(tigon.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    return env


class RunStore:
    """The runs under one directory: starts, watches and stops their processes. Every path it is
    given (a run's name, a dataset, a model) is resolved, symbolic links followed, and taken only
    when it lies in that directory; besides it, a run reads only the bundled data and hub models."""

    def __init__(self, root: str | Path, max_running: int = 4):
        self.root = Path(root).resolve()
        self.methods = available_methods()
        self.max_running = max_running  # runs this UI has going at once: each takes a machine's memory
        self._procs: dict[str, subprocess.Popen] = {}
        self._lock = threading.Lock()

    # --- files ------------------------------------------------------------------------------

    def inside(self, path: str | Path, what: str) -> Path:
        """`path` (relative to the runs folder, or absolute) resolved; a WebUIError naming `what`
        when it lies outside the runs folder."""
        if "\0" in str(path):
            raise WebUIError(f"{what} {str(path)!r}: a path cannot hold a NUL character")
        full = (self.root / path).resolve()
        if not full.is_relative_to(self.root):
            raise WebUIError(f"{what} {str(path)!r}: outside the runs folder {self.root}")
        return full

    def run_dir(self, name: str) -> Path:
        if not name or not _NAME.fullmatch(name) or name == UPLOADS_DIR:
            raise WebUIError(f"run name {name!r}: use letters, digits, '.', '_' and '-' (not starting with . or -)")
        run_dir = self.root / name
        self.inside(name, "run")  # not a link out of the folder
        return run_dir

    def data_files(self, specs: str | list[str], option: str = "dataset") -> list[str]:
        """The data files `specs` names (a dataset field's text: paths separated by spaces, shell
        quoting for paths with spaces; ``PATH#N`` for N random rows), each resolved in the runs
        folder (``uploads/x.jsonl``) and returned absolute; empty: none given."""
        if isinstance(specs, str):
            try:
                specs = shlex.split(specs)
            except ValueError as err:
                raise WebUIError(f"{option}: {err}") from None
        files = []
        for spec in specs:
            path, sep, count = spec.rpartition("#")
            if not (sep and count.isdigit()):
                path, sep, count = spec, "", ""
            full = self.inside(path, option)
            if full.suffix.lower() not in DATASET_SUFFIXES:
                raise WebUIError(f"{option} {spec!r}: not a data file ({' '.join(DATASET_SUFFIXES)})")
            if not full.is_file():
                raise WebUIError(f"{option} {spec!r}: no such file in the runs folder {self.root}")
            files.append(str(full) + sep + count)
        return files

    def model_dir(self, text: str) -> Path:
        """The model directory `text` names in the runs folder (a run's final/, a checkpoint, a
        merged export, as labelled ``RUN/final`` or as a path), resolved."""
        full = self.inside(text, "model")
        if full == self.root or full.is_relative_to(self.root / UPLOADS_DIR) or not full.is_dir():
            raise WebUIError(f"model {text!r}: no model directory in the runs folder {self.root}: pick a finished "
                             "run or a checkpoint")
        return full

    def model_source(self, text: str, option: str = "model") -> str:
        """What `tigon sft --model` (or --teacher) is given for `text`: a model directory in the
        runs folder, resolved, or a hub id that names no local path; empty: none given."""
        text = text.strip()
        if not text:
            return ""
        try:
            return str(self.model_dir(text))
        except WebUIError:
            # A hub id that is also a path where it is loaded (the UI's own working directory, for
            # the preview's tokenizer) would be read from that path.
            if _HUB_ID.fullmatch(text) and ".." not in text and not (self.root / text).exists() \
                    and not Path(text).exists():
                return text
        raise WebUIError(f"{option} {text!r}: not a model directory in the runs folder {self.root} (a finished run "
                         "or a checkpoint) nor a hub id")

    def keep_upload(self, file: str | Path) -> str:
        """Copy an uploaded data file (Gradio keeps its own copy only for a while, and a run may
        read it for hours) into RUNS/uploads/, under a new name where the name is taken; returns
        its path in the runs folder."""
        source = Path(file)
        stem = re.sub(r"[^A-Za-z0-9._-]", "_", source.stem).lstrip("._-") or "data"
        suffix = source.suffix.lower()
        if suffix not in DATASET_SUFFIXES:
            raise WebUIError(f"upload {source.name!r}: not a data file ({' '.join(DATASET_SUFFIXES)})")
        folder = self.inside(UPLOADS_DIR, "uploads folder")
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(1, 1000):
            target = folder / (stem + (f"-{i}" if i > 1 else "") + suffix)
            try:
                with source.open("rb") as src, target.open("xb") as dst:  # never over an earlier upload
                    shutil.copyfileobj(src, dst)
            except FileExistsError:
                continue
            return str(target.relative_to(self.root))
        raise WebUIError(f"upload {source.name!r}: a thousand uploads of that name already: rename the file")

    def command_arguments(self, settings: TrainSettings, output_dir: Path) -> list[str]:
        """The `tigon` arguments that start this run: ``sft ...`` or ``rlhf --method M ...``, every
        path in them resolved in the runs folder."""
        if settings.method not in self.methods:
            raise WebUIError(f"method {settings.method!r}: this tigon offers {', '.join(self.methods)}")
        if settings.tuner not in ("lora", "full"):
            raise WebUIError(f"tuner {settings.tuner!r}: expected lora or full")
        args = task_command(settings.method)
        model = self.model_source(settings.model)
        if model:
            args += ["--model", model]
        datasets = self.data_files(settings.dataset)
        if datasets:
            args += ["--dataset", *datasets]
        args += ["--tuner", settings.tuner]
        lora = {"--lora-rank": settings.lora_rank, "--lora-alpha": settings.lora_alpha}
        numbers = {"--lr": settings.lr, "--max-steps": settings.max_steps, "--max-length": settings.max_length,
                   "--save-steps": settings.save_steps}
        if settings.tuner == "lora":
            numbers = {**lora, **numbers}
        for flag, value in numbers.items():
            if value is not None:
                if not math.isfinite(value):
                    raise WebUIError(f"{flag}: {value} is not a number")
                args += _option(flag, _num(value))
        if settings.packing:
            if "packing" in _config_class(settings.method).LEFT_OUT:
                raise WebUIError(f"packing: `tigon {shlex.join(task_command(settings.method))}` packs no rows: "
                                 "leave it off")
            args.append("--packing")
        if not settings.kernels:
            args.append("--no-kernels")
        return args + self.extra_arguments(settings.extra, settings.method) + ["--output-dir", str(output_dir)]

    def extra_arguments(self, extra: str, method: str) -> list[str]:
        """The form's "more options", parsed as `tigon sft` / `tigon rlhf` parse them and written
        anew from what was parsed, so that the process gets exactly what was checked: the form's
        own settings, files outside the runs folder and Python files (``--reward-funcs x.py:f``)
        are refused, each in one line."""
        cls = _config_class(method)
        # No -h (it exits), no @FILE arguments (argparse reads no files unless told to), no
        # abbreviations (--out for --output-dir): what is checked is what the option says.
        parser = _OptionParser(prog=f"tigon {method}", add_help=False, allow_abbrev=False)
        add_sft_arguments(parser, cls)
        try:
            given = vars(parser.parse_args(shlex.split(extra or "")))
        except ValueError as err:
            raise WebUIError(f"more options: {err}") from None
        fields = {f.name: f for f in dataclasses.fields(cls)}
        args = []
        for name, value in given.items():  # in the order given
            flag = "--" + name.replace("_", "-")
            if name in _FROM_THE_FORM:
                raise WebUIError(f"more options: {flag}: set it in the form's field \"{_FROM_THE_FORM[name]}\"")
            if name in _NOT_FROM_THE_UI:
                raise WebUIError(f"more options: {flag}: {_NOT_FROM_THE_UI[name]}; not taken from the web UI")
            f = fields[name]
            if name == "reward_funcs":
                args += [flag, *self._builtin_rewards(value)]
            elif name == "eval_dataset":
                args += [flag, *self.data_files(value, flag)]
            elif name in ("teacher", "reward_model"):
                args += _option(flag, self.model_source(value, flag))
            elif isinstance(value, bool):
                args.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, (int, float)) or f.metadata.get("choices") or name in _FREE_TEXT:
                if isinstance(value, float) and not math.isfinite(value):
                    raise WebUIError(f"more options: {flag}: {value} is not a number")
                args += _option(flag, ",".join(value) if isinstance(value, list) else _num(value))
            else:
                raise WebUIError(f"more options: {flag}: not taken from the web UI (use the command line)")
        return args

    @staticmethod
    def _builtin_rewards(specs: list[str]) -> list[str]:
        names = builtin_names()
        items = [item.strip() for spec in specs for item in spec.split(",") if item.strip()]
        for item in items:
            source, _, name = item.rpartition(":")
            if source != BUILTIN or name not in names:
                raise WebUIError(f"more options: --reward-funcs {item}: the web UI takes only the built-in rewards "
                                 f"({', '.join(f'{BUILTIN}:{n}' for n in names)}); Python files are for the command "
                                 "line")
        return [",".join(items)]

    def _record(self, name: str) -> dict[str, Any]:
        path = self.run_dir(name) / RUN_FILE
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def _update(self, name: str, **changes: Any) -> None:
        with self._lock:
            record = {**self._record(name), **changes}
            # Staged and renamed, as tigon writes its checkpoints: a reader never sees half a record.
            with written_atomically(self.run_dir(name) / RUN_FILE, directory=False) as staging:
                staging.write_text(json.dumps(record, indent=1) + "\n")

    def names(self) -> list[str]:
        """Runs under the root, newest first: directories the UI started a run in, or that hold
        what `tigon sft` writes (so runs started on the command line show too)."""
        if not self.root.is_dir():
            return []
        found = []
        for d in self.root.iterdir():
            if not d.is_dir() or not _NAME.fullmatch(d.name) or d.name == UPLOADS_DIR \
                    or not d.resolve().is_relative_to(self.root):  # a link out of the folder
                continue
            marks = [d / RUN_FILE, d / METRICS_FILE, d / FINAL_DIR]
            if any(p.exists() for p in marks) or list_checkpoints(d):
                started = self._record(d.name).get("started_at") or d.stat().st_mtime
                found.append((started, d.name))
        return [name for _, name in sorted(found, reverse=True)]

    # --- processes ----------------------------------------------------------------------------

    def start(self, settings: TrainSettings) -> str:
        """Start `settings` as a `python -m tigon.cli` process in RUNS/NAME; returns NAME."""
        name = settings.name.strip()
        if not name:
            stamp = time.strftime("%Y%m%d-%H%M%S-") + settings.method
            name = next(n for i in range(1, 1000) if not (self.root / (n := stamp + (f"-{i}" if i > 1 else ""))).exists())
        run_dir = self.run_dir(name)
        if run_dir.exists():
            raise WebUIError(f"run {name!r} already exists in {self.root}: choose another name")
        argv = self.command_arguments(settings, run_dir)
        if len(self._procs) >= self.max_running:
            raise WebUIError(f"already {len(self._procs)} run(s) going, the most this UI starts at once (tigon webui "
                             f"--max-running {self.max_running}): wait for one to end, or stop one")
        command = [sys.executable, "-m", "tigon.cli", *argv]
        run_dir.mkdir(parents=True)
        self._update(name, method=settings.method, settings=asdict(settings), command=command,
                     started_at=time.time(), started=time.strftime("%Y-%m-%d %H:%M:%S"))
        with (run_dir / LOG_FILE).open("wb") as log:
            log.write(("$ tigon " + shlex.join(argv) + "\n").encode())
            log.flush()
            # A session of its own: the run outlives the UI and a Ctrl-C meant for the UI's
            # terminal; it is stopped from the UI (or by its pid). It works in its own folder, so
            # that what a library writes to the working directory (mlflow's mlruns/) stays there.
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=_child_env(self.root), start_new_session=True, cwd=run_dir)
        self._procs[name] = proc
        self._update(name, pid=proc.pid)
        threading.Thread(target=self._wait, args=(name, proc), daemon=True, name=f"tigon-webui-{name}").start()
        return name

    def _wait(self, name: str, proc: subprocess.Popen) -> None:
        peak_rss = None
        if hasattr(os, "wait4"):
            _, status, usage = os.wait4(proc.pid, 0)
            code = os.waitstatus_to_exitcode(status)
            proc.returncode = code  # reaped here: Popen must not wait for it again
            peak_rss = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # bytes on macOS, KiB on Linux
        else:
            code = proc.wait()
        self._update(name, exit_code=code, ended=time.strftime("%Y-%m-%d %H:%M:%S"),
                     peak_rss_gib=None if peak_rss is None else round(peak_rss / 2**30, 2))
        self._procs.pop(name, None)

    def stop(self, name: str) -> str:
        """Send the run SIGINT, as Ctrl-C would: `tigon sft` finishes its step, saves a
        checkpoint and exits with one line. Asked again, it quits without saving."""
        info = self.info(name)
        if info.status != RUNNING:
            raise WebUIError(f"run {name!r} is not running ({info.status})")
        pid = self._record(name).get("pid")
        again = bool(self._record(name).get("stop_requested"))
        try:
            os.kill(pid, signal.SIGINT)
        except ProcessLookupError:
            return f"{name}: already ended"
        self._update(name, stop_requested=True)
        if again:
            return f"{name}: asked again to stop: quitting without saving"
        return f"{name}: stopping (SIGINT): the step in progress finishes and a checkpoint is saved"

    def wait(self, name: str, timeout: float) -> RunInfo:
        """The run's info once it is no longer running, or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (info := self.info(name)).status == RUNNING and time.monotonic() < deadline:
            time.sleep(0.2)
        return info

    # --- what is shown ------------------------------------------------------------------------

    def _status(self, name: str, run_dir: Path, record: dict[str, Any]) -> str:
        if "exit_code" in record:
            code = record["exit_code"]
            if code == 0:  # and its final/ still as it wrote it
                return FINISHED if finished(run_dir) else INCOMPLETE
            if record.get("stop_requested") or code in (130, -signal.SIGINT):
                return STOPPED
            return FAILED
        proc = self._procs.get(name)
        if proc is not None or (record.get("pid") and _pid_runs(record["pid"], run_dir)):
            return RUNNING
        return FINISHED if finished(run_dir) else INCOMPLETE

    def info(self, name: str, log_lines: int = 0) -> RunInfo:
        """Status, progress and figures of one run, from its files and its process."""
        run_dir = self.run_dir(name)
        if not run_dir.is_dir():
            raise WebUIError(f"no run {name!r} in {self.root}")
        record = self._record(name)
        status = self._status(name, run_dir, record)
        records = read_records(run_dir)
        losses = [r for r in records if "loss" in r]
        tail = log_tail(run_dir / LOG_FILE, max(log_lines, 12))
        progress = next((m for line in reversed(tail) if (m := list(_PROGRESS.finditer(line)))), None)
        step, total = (int(progress[-1].group(1)), int(progress[-1].group(2))) if progress else (None, None)
        if losses and (step is None or losses[-1]["step"] > step):
            step = losses[-1]["step"]
        gpu = [r["gpu_mem_gib"] for r in records if "gpu_mem_gib" in r]
        host = record.get("peak_rss_gib")
        if host is None and status == RUNNING and record.get("pid"):
            host = _peak_rss_gib(record["pid"])
        if gpu:
            memory = f"{max(gpu):.2f} GiB GPU"
        else:
            memory = "" if host is None else f"{host:.2f} GiB host"
        ckpts = list_checkpoints(run_dir)
        command = record.get("command", [])
        return RunInfo(
            name=name, path=str(run_dir), status=status, method=record.get("method", ""),
            step=step, total_steps=total, final_loss=losses[-1]["loss"] if losses else None,
            tokens_per_s=_median_speed(records), peak_memory=memory, started=record.get("started", ""),
            message=_ended_line(tail, record["exit_code"]) if "exit_code" in record else "",
            checkpoint=ckpts[-1].name if ckpts else "", exit_code=record.get("exit_code"),
            command=("tigon " + shlex.join(command[3:])) if command else "",
            log=tail[-log_lines:] if log_lines else [],
        )

    def loss_points(self, names: list[str]) -> list[tuple[str, int, float]]:
        """(run, step, loss) of every logged training step of the runs `names`."""
        return [(name, r["step"], r["loss"]) for name in names for r in read_records(self.run_dir(name))
                if "loss" in r and isinstance(r["loss"], (int, float))]

    def model_paths(self) -> list[tuple[str, str]]:
        """(label, path) of every model the runs left: final models and merged exports (newest
        run first), then step checkpoints."""
        models, steps = [], []
        for name in self.names():
            run_dir = self.run_dir(name)
            dirs = [run_dir / FINAL_DIR] if finished(run_dir) else []  # not a damaged final/
            dirs += sorted((p for p in run_dir.glob(EXPORT_PREFIX + "merged*") if p.is_dir()), key=lambda p: p.name)
            models += [(f"{name}/{d.name}", str(d)) for d in dirs]
            steps += [(f"{name}/{d.name}", str(d)) for d in reversed(list_checkpoints(run_dir))]
        return models + steps

    def export(self, path: str, to: str, dtype: str = "auto", timeout: float | None = None) -> tuple[bool, str]:
        """`tigon export PATH --to merged|gguf` as a process, into the ``export-...`` directory
        next to the model (both in the runs folder); (whether it worked, its last line: where it
        wrote, or its error)."""
        if to not in ("merged", "gguf"):
            raise WebUIError(f"export to {to!r}: expected merged or gguf")
        if dtype not in EXPORT_DTYPES:
            raise WebUIError(f"export dtype {dtype!r}: expected one of {', '.join(EXPORT_DTYPES)}")
        model = self.model_dir(path)
        suffix = "" if model.name == FINAL_DIR else "-" + model.name
        name = f"{EXPORT_PREFIX}{to}{suffix}" + ("" if dtype == "auto" else f"-{dtype}")
        out = self.inside(model.parent / name, "export")  # not a link out of the folder
        # The export folder is the UI's own, named by it: exporting again replaces it.
        argv = ["export", str(model), "--to", to, "--output", str(out), "--dtype", dtype, "--overwrite"]
        done = subprocess.run([sys.executable, "-m", "tigon.cli", *argv], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, env=_child_env(self.root), timeout=timeout)
        line = _ended_line(_terminal_lines(done.stdout + "\n" + done.stderr), done.returncode)
        return done.returncode == 0, line
