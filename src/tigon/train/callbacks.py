"""What a run shows and records: a progress bar (loss, lr, tok/s, MFU, GPU memory and
utilisation), metrics.jsonl, a PNG loss curve and a closing summary. Only the main process
reports."""

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

log = logging.getLogger("tigon.train")

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


def _gpu_utilisation() -> int | None:
    try:
        return int(torch.cuda.utilization())
    except Exception:  # needs pynvml (or amdsmi); utilisation is a nicety, not a requirement
        return None


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    path = output_dir / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss(output_dir: Path) -> Path | None:
    """loss.png from metrics.jsonl (training loss per step, evaluation loss as points)."""
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
    if not train and not evals:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1.2)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"tigon sft: {output_dir.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = output_dir / PLOT_FILE
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class Reporter(TrainerCallback):
    """Progress bar, metrics.jsonl and summary. Speed is measured between logs from the
    tokens the Trainer counted (all processes), so MFU divides by every process's peak."""

    def __init__(self, output_dir: Path, flops_per_token: float, peak_flops: float, world_size: int):
        self.output_dir = output_dir
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops * world_size
        self.bar: Any = None
        self.window: tuple[float, int] | None = None
        self.start: tuple[float, int] | None = None
        self.losses: list[float] = []
        self.rates: list[float] = []
        self.postfix = ""

    def on_train_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            # The peak from here on: weights and optimizer state, not the MFU probe or sample generation.
            torch.cuda.reset_peak_memory_stats()
        if not state.is_world_process_zero:
            return
        from tqdm.auto import tqdm

        self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="tigon sft",
                        dynamic_ncols=True, unit="step")
        now = (time.perf_counter(), state.num_input_tokens_seen)
        self.window = self.start = now

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
            util = _gpu_utilisation()
            if util is not None:
                speed["gpu_util_pct"] = util
        return speed

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        record: dict[str, Any] = {"step": state.global_step, "epoch": round(state.epoch or 0.0, 4)}
        if "loss" in logs:
            record.update(loss=logs["loss"], lr=logs.get("learning_rate"), grad_norm=logs.get("grad_norm"))
            speed = self._speed(state)
            record.update(speed)
            logs.update(speed)  # for the trackers of --report-to, which run after this callback
            self.losses.append(logs["loss"])
            self._show(record)
        elif "eval_loss" in logs:
            record["eval_loss"] = logs["eval_loss"]
            log_line = f"step {state.global_step}: eval loss {logs['eval_loss']:.4f}"
            (self.bar.write if self.bar is not None else log.info)(log_line)
        else:
            return
        with (self.output_dir / METRICS_FILE).open("a") as f:
            f.write(json.dumps(record) + "\n")

    def _show(self, r: dict[str, Any]) -> None:
        parts = [f"loss {r['loss']:.4f}"]
        if r.get("lr") is not None:
            parts.append(f"lr {r['lr']:.2e}")
        if "tokens_per_s" in r:
            parts.append(f"{_si(r['tokens_per_s'])} tok/s")
        if "mfu" in r:
            parts.append(f"MFU {100 * r['mfu']:.1f}%")
        if "gpu_mem_gib" in r:
            parts.append(f"mem {r['gpu_mem_gib']:.1f} GiB")
        if "gpu_util_pct" in r:
            parts.append(f"util {r['gpu_util_pct']}%")
        self.postfix = " | ".join(parts)
        if self.bar is not None:
            self.bar.set_postfix_str(self.postfix, refresh=False)

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            plot_loss(self.output_dir)

    def close(self) -> None:
        """End the progress bar's line, when training raised (and so never ends)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is None:
            return
        self.bar.close()
        seconds = time.perf_counter() - self.start[0]
        tokens = state.num_input_tokens_seen - self.start[1]
        rate = tokens / seconds if seconds > 0 else 0.0
        steps = (f"{state.global_step} steps" if state.global_step >= state.max_steps
                 else f"stopped at step {state.global_step} of {state.max_steps}")
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
        if self.losses:
            head = self.losses[: max(1, len(self.losses) // 10)]
            tail = self.losses[-max(1, len(self.losses) // 10):]
            first, last = sum(head) / len(head), sum(tail) / len(tail)
            if math.isfinite(first) and math.isfinite(last):
                lines.append(f"loss: {first:.4f} (first steps) -> {last:.4f} (last steps)")
        plot = plot_loss(self.output_dir)
        lines.append(f"metrics: {self.output_dir / METRICS_FILE}" + (f", loss curve: {plot}" if plot else ""))
        for line in lines:
            log.info("%s", line)
