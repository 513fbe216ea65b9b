"""What is alive at the GPU memory peak of a training step: the caching allocator's record of every
allocation and free during the step (``torch.cuda.memory._record_memory_history``) is replayed to its
largest total, and the blocks live there are listed by the Python code that allocated them, in MiB
and bytes per token. Blocks allocated before the step (weights, optimizer state) are one line.

As a library (scripts/qlora_bench.py --inspect memory, scripts/profile_e2e.py)::

    with PeakRecord(8192) as record:
        step()
    print(record.report())

As a command, around one step of `tigon sft` / `tigon rlhf` (the step after the 4th):

    PYTHONPATH=src python3 scripts/memory_peak_gpu.py rlhf --method dpo --model ... [tigon options]
"""

from __future__ import annotations

import collections
import sys

import torch

# Frames from these paths name an allocation; torch's own autograd / module plumbing does not.
OWN_CODE = ("tigon/", "transformers/", "peft/", "trl/", "bitsandbytes/", "torch/utils/checkpoint", "torch/optim", "scripts/")
FRAMES_PER_SITE = 3


def _site(frames: list[dict]) -> str:
    named = [f for f in frames if any(part in f["filename"] for part in OWN_CODE)]
    chosen = named[:FRAMES_PER_SITE] or frames[:1]
    return " <- ".join(f"{f['filename'].split('/src/')[-1].split('site-packages/')[-1]}:{f['line']} {f['name']}" for f in chosen)


class PeakRecord:
    """Records the allocator's events while active; :meth:`report` lists what was live at the peak."""

    def __init__(self, units: int, unit: str = "token", max_entries: int = 2_000_000):
        self.units, self.unit, self.max_entries = units, unit, max_entries
        self.snapshot: dict | None = None

    def __enter__(self) -> "PeakRecord":
        torch.cuda.synchronize()
        self.before = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                 max_entries=self.max_entries)
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize()
        self.snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)

    def report(self, top: int = 30) -> str:
        events = [e for e in self.snapshot["device_traces"][0] if e["action"] in ("alloc", "free_completed")]
        live_total, peak, peak_at, sizes = self.before, self.before, -1, {}
        for i, event in enumerate(events):
            if event["action"] == "alloc":
                live_total += event["size"]
                sizes[event["addr"]] = event["size"]
            else:
                live_total -= event["size"]
                sizes.pop(event["addr"], None)
            if live_total > peak:
                peak, peak_at = live_total, i
        live: dict[int, dict] = {}
        freed_earlier = 0  # blocks from before the step freed before the peak
        for event in events[: peak_at + 1]:
            if event["action"] == "alloc":
                live[event["addr"]] = event
            elif live.pop(event["addr"], None) is None:
                freed_earlier += event["size"]
        sites: collections.Counter = collections.Counter()
        counts: collections.Counter = collections.Counter()
        for event in live.values():
            site = _site(event.get("frames", []))
            sites[site] += event["size"]
            counts[site] += 1
        per_unit = 1 / self.units / 1024
        lines = [f"peak {peak / 2**20:.0f} MiB ({len(events)} events, peak at event {peak_at}): "
                 f"{(self.before - freed_earlier) / 2**20:.0f} MiB from before the step, "
                 f"{sum(sites.values()) / 2**20:.0f} MiB allocated in it "
                 f"({sum(sites.values()) * per_unit:.1f} KiB per {self.unit})"]
        for site, nbytes in sites.most_common(top):
            lines.append(f"  {nbytes / 2**20:9.1f} MiB {nbytes * per_unit:8.1f} KiB/{self.unit} x{counts[site]:<4} {site}")
        return "\n".join(lines)


def main() -> int:
    if not torch.cuda.is_available():
        print("memory_peak_gpu.py: the allocator's record is CUDA's: run it on a machine with a GPU", file=sys.stderr)
        return 2
    from transformers import TrainerCallback

    from tigon import cli
    from tigon.train.trainer import TigonTrainer

    recorded_step = 5

    class OneStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == recorded_step:
                sequences = args.per_device_train_batch_size * args.gradient_accumulation_steps
                self.record = PeakRecord(sequences, "sequence").__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == recorded_step + 1:
                self.record.__exit__(None, None, None)
                print(self.record.report())

    base_init = TigonTrainer.__init__

    def init_with_record(self, *args, **kwargs):
        base_init(self, *args, **kwargs)
        self.add_callback(OneStep())

    TigonTrainer.__init__ = init_with_record
    command = sys.argv[1:2] if sys.argv[1:2] == ["rlhf"] else []
    return cli.main([*(command or ["sft"]), *sys.argv[1 + len(command):]])


if __name__ == "__main__":
    sys.exit(main())
