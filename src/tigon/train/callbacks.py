"""What a run shows and records: a progress bar (loss, lr, tok/s, MFU, GPU memory and the
fraction of the time the GPU was busy, and any figures of the objective's own: reward margin and accuracy for `tigon
rlhf`), metrics.jsonl, a PNG of the loss curve (and of the reward margin) and a closing summary.
Only the main process reports."""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from tigon.timing import BusyMeter
from tigon.train.checkpoint import written_atomically
from tigon.train.config import SFTError

log = logging.getLogger("tigon.train")

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    """The records of metrics.jsonl. A last line cut short (the run was killed as it appended it)
    is left out, with a warning; any other line that is not a record is an SFTError naming it."""
    path = output_dir / METRICS_FILE
    if not path.is_file():
        return []
    lines = path.read_bytes().decode("utf-8", errors="replace").split("\n")
    last = lines.pop()  # after the newline that ends a complete file: ""
    records = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            record = _record(line)
            if record is None:
                raise SFTError(f"{path} line {number}: not a metrics record: delete that line (or the file, and with "
                               "it the run's loss curve), then rerun")
            records.append(record)
    if last.strip():
        record = _record(last)  # whole when only its newline was lost
        if record is None:
            log.warning("%s: its last line is cut short (the run was stopped as it was written): left out", path)
        else:
            records.append(record)
    return records


def _record(line: str) -> dict[str, Any] | None:
    """A line of metrics.jsonl as the record it holds, or None if it holds none."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


MARGIN = "rewards/margins"  # the preference trainers' reward margin (TRL's name)
ACCURACY = "rewards/accuracies"


def plot_loss(output_dir: Path, title: str = "tigon sft") -> Path | None:
    """loss.png from metrics.jsonl (training loss per step, evaluation loss as points), with a
    second panel for the reward margin (and accuracy) when the run logged one."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no %s (pip install matplotlib)", PLOT_FILE)
        return None
    records = read_metrics(output_dir)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    margins = [(r["step"], r[MARGIN]) for r in records if MARGIN in r]
    if not train and not evals:
        return None
    fig, axes = plt.subplots(1, 2 if margins else 1, figsize=(12 if margins else 7, 4), squeeze=False)
    ax = axes[0][0]
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1.2)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{title}: {output_dir.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    if margins:
        ax = axes[0][1]
        ax.plot(*zip(*margins), color="tab:green", linewidth=1.2, label="reward margin (chosen - rejected)")
        ax.set_xlabel("step")
        ax.set_ylabel("reward margin")
        ax.grid(alpha=0.3)
        accuracy = [(r["step"], r[ACCURACY]) for r in records if ACCURACY in r]
        if accuracy:
            twin = ax.twinx()
            twin.plot(*zip(*accuracy), color="tab:orange", linewidth=1.0, alpha=0.8, label="reward accuracy")
            twin.set_ylabel("reward accuracy")
            twin.set_ylim(-0.05, 1.05)
            twin.legend(loc="lower right")
        ax.legend(loc="upper left")
    fig.tight_layout()
    path = output_dir / PLOT_FILE
    with written_atomically(path, directory=False) as staging:
        fig.savefig(staging, dpi=110, format="png")
    plt.close(fig)
    return path


def _first_and_last(values: list[float]) -> tuple[float, float] | None:
    """The mean of the first and of the last tenth of `values`, when both are finite."""
    if not values:
        return None
    n = max(1, len(values) // 10)
    first, last = sum(values[:n]) / n, sum(values[-n:]) / n
    return (first, last) if math.isfinite(first) and math.isfinite(last) else None


class Reporter(TrainerCallback):
    """Progress bar, metrics.jsonl and summary. Speed is measured between logs from the
    tokens the Trainer counted (all processes), so MFU divides by every process's peak."""

    def __init__(self, output_dir: Path, flops_per_token: float, peak_flops: float, world_size: int,
                 command: str = "sft", metrics: dict[str, str] | None = None):
        """`metrics`: log keys of the objective's own to record in metrics.jsonl (and their
        evaluation values, prefixed ``eval_``), each with its label on the progress bar and in
        the summary ("": recorded only)."""
        self.output_dir = output_dir
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops * world_size
        self.title = f"tigon {command}"
        self.metrics = metrics or {}
        self.bar: Any = None
        self.window: tuple[float, int] | None = None
        self.start: tuple[float, int] | None = None
        self.first_step = 0  # the step a resumed run starts after
        self.losses: list[float] = []
        self.series: dict[str, list[float]] = {key: [] for key, label in self.metrics.items() if label}
        self.rates: list[float] = []
        self.postfix = ""
        self.busy = BusyMeter()

    def on_train_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            # The peak from here on: weights and optimizer state, not the MFU probe or sample generation.
            torch.cuda.reset_peak_memory_stats()
        if not state.is_world_process_zero:
            return
        from tqdm.auto import tqdm

        self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc=self.title,
                        dynamic_ncols=True, unit="step")
        now = (time.perf_counter(), state.num_input_tokens_seen)
        self.window = self.start = now
        self.first_step = state.global_step
        if torch.cuda.is_available():
            self.busy.start()

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def _speed(self, state) -> dict[str, float]:
        now = (time.perf_counter(), state.num_input_tokens_seen)
        seconds, tokens = now[0] - self.window[0], now[1] - self.window[1]
        self.window = now
        if seconds <= 0 or tokens <= 0:
            return {}
        rate = tokens / seconds
        self.rates.append(rate)
        speed = {"tokens_per_s": round(rate, 1)}
        if self.peak_flops > 0:
            speed["mfu"] = round(rate * self.flops_per_token / self.peak_flops, 5)
        if torch.cuda.is_available():
            speed["gpu_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            busy = self.busy.window()
            if busy is not None:
                speed["gpu_busy_pct"] = round(busy, 1)
        return speed

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        record: dict[str, Any] = {"step": state.global_step, "epoch": round(state.epoch or 0.0, 4)}
        if "loss" in logs:
            record.update(loss=logs["loss"], lr=logs.get("learning_rate"), grad_norm=logs.get("grad_norm"))
            record.update({key: logs[key] for key in self.metrics if key in logs})
            speed = self._speed(state)
            record.update(speed)
            logs.update(speed)  # for the trackers of --report-to, which run after this callback
            self.losses.append(logs["loss"])
            for key, values in self.series.items():
                if logs.get(key) is not None:  # None: nothing to measure this step (e.g. no row scored)
                    values.append(logs[key])
            self._show(record)
        elif "eval_loss" in logs:
            record["eval_loss"] = logs["eval_loss"]
            record.update({f"eval_{key}": logs[f"eval_{key}"] for key in self.metrics if f"eval_{key}" in logs})
            shown = [f"{label} {logs['eval_' + key]:.4f}" for key, label in self.metrics.items()
                     if label and logs.get(f"eval_{key}") is not None]
            log_line = ", ".join([f"step {state.global_step}: eval loss {logs['eval_loss']:.4f}", *shown])
            (self.bar.write if self.bar is not None else log.info)(log_line)
        else:
            return
        with (self.output_dir / METRICS_FILE).open("a") as f:
            f.write(json.dumps(record) + "\n")

    def _show(self, r: dict[str, Any]) -> None:
        parts = [f"loss {r['loss']:.4f}"]
        parts += [f"{label} {r[key]:.3f}" for key, label in self.metrics.items() if label and r.get(key) is not None]
        if r.get("lr") is not None:
            parts.append(f"lr {r['lr']:.2e}")
        if "tokens_per_s" in r:
            parts.append(f"{_si(r['tokens_per_s'])} tok/s")
        if "mfu" in r:
            parts.append(f"MFU {100 * r['mfu']:.1f}%")
        if "gpu_mem_gib" in r:
            parts.append(f"mem {r['gpu_mem_gib']:.1f} GiB")
        if "gpu_busy_pct" in r:
            parts.append(f"GPU busy {r['gpu_busy_pct']:.0f}%")
        self.postfix = " | ".join(parts)
        if self.bar is not None:
            # The Trainer logs after the step's end has advanced the bar: drawn now, or the bar
            # would show these figures only with the next step's.
            self.bar.set_postfix_str(self.postfix)

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            plot_loss(self.output_dir, self.title)

    def close(self) -> None:
        """End the progress bar's line, when training raised (and so never ends)."""
        self.busy.stop()
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def on_train_end(self, args, state, control, **kwargs):
        self.busy.stop()
        if self.bar is None:
            return
        self.bar.close()
        seconds = time.perf_counter() - self.start[0]
        tokens = state.num_input_tokens_seen - self.start[1]
        rate = tokens / seconds if seconds > 0 else 0.0
        run_here = state.global_step - self.first_step
        resumed = f" (steps {self.first_step + 1}-{state.global_step}, resumed after step {self.first_step})"
        if state.global_step >= state.max_steps:
            steps = f"{run_here} steps" + (resumed if self.first_step else "")
        else:
            steps = f"stopped at step {state.global_step} of {state.max_steps}" + (
                f", {run_here} steps run here" if self.first_step else "")
        lines = [f"{'done: ' if state.global_step >= state.max_steps else ''}{steps} in {seconds:.1f} s, "
                 f"{_si(tokens)} tokens, {_si(rate)} tok/s"]
        if len(self.rates) > 2:
            # The first interval carries kernel compilation and autotuning: leave it out.
            rate = statistics.median(self.rates[1:])
            lines[-1] += f" ({_si(rate)} tok/s median after the first log)"
        if self.peak_flops > 0 and rate > 0:
            lines[-1] += f", MFU {100 * rate * self.flops_per_token / self.peak_flops:.1f}%"
        if torch.cuda.is_available():
            lines[-1] += f", peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
        busy = self.busy.overall()
        if busy is not None:
            lines[-1] += f", GPU busy {busy:.0f}% of the time"
        for label, values in [("loss", self.losses), *((self.metrics[k], v) for k, v in self.series.items())]:
            ends = _first_and_last(values)
            if ends is not None:
                lines.append(f"{label}: {ends[0]:.4f} (first steps) -> {ends[1]:.4f} (last steps)")
        plot = plot_loss(self.output_dir, self.title)
        lines.append(f"metrics: {self.output_dir / METRICS_FILE}" + (f", loss curve: {plot}" if plot else ""))
        for line in lines:
            log.info("%s", line)
