"""What is alive at the GPU memory peak: the caching allocator's record of every allocation and free
(``torch.cuda.memory._record_memory_history``) is replayed to its largest total, and the blocks live
there are listed by the Python code that allocated them and, one by one, by size.

    with PeakRecord(8192) as record:
        step()
    print(record.report())
    record.dump(Path("out/qlora-tigon"))  # out/qlora-tigon.pickle (for pytorch.org/memory_viz) and .txt

Blocks allocated before recording began (weights, optimizer state, when it starts after them) are
one line; started before the model is built, the record names the code behind every block.
"""

from __future__ import annotations

import collections
import pickle
from pathlib import Path
from typing import Any

import torch

# Frames from these paths name an allocation; torch's own autograd / module plumbing does not.
OWN_CODE = ("tigon/", "transformers/", "peft/", "trl/", "bitsandbytes/", "unsloth/", "unsloth_zoo/",
            "torch/utils/checkpoint", "torch/optim", "scripts/")
FRAMES_PER_SITE = 3


def _site(frames: list[dict]) -> str:
    named = [f for f in frames if any(part in f["filename"] for part in OWN_CODE)]
    chosen = named[:FRAMES_PER_SITE] or frames[:1]
    return " <- ".join(f"{f['filename'].split('/src/')[-1].split('site-packages/')[-1]}:{f['line']} {f['name']}" for f in chosen)


class PeakRecord:
    """Records the allocator's events on the current CUDA device while active; :meth:`report` lists
    what was live at the peak, per `unit` (`units` of them in the recorded work, e.g. its tokens)."""

    def __init__(self, units: int, unit: str = "token", max_entries: int = 2_000_000):
        self.units, self.unit, self.max_entries = units, unit, max_entries
        self.snapshot: dict[str, Any] | None = None

    def __enter__(self) -> "PeakRecord":
        torch.cuda.synchronize()
        self.device = torch.cuda.current_device()
        self.before = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                 max_entries=self.max_entries)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize()
        self.snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)

    def live_at_peak(self) -> tuple[int, int, list[dict[str, Any]], int]:
        """(peak bytes, events replayed, the alloc events live at the peak, bytes of blocks from
        before the record that were freed before the peak)."""
        events = [e for e in self.snapshot["device_traces"][self.device] if e["action"] in ("alloc", "free_completed")]
        total = peak = self.before
        peak_at = -1
        for i, event in enumerate(events):
            total += event["size"] if event["action"] == "alloc" else -event["size"]
            if total > peak:
                peak, peak_at = total, i
        live: dict[int, dict] = {}
        freed_earlier = 0
        for event in events[: peak_at + 1]:
            if event["action"] == "alloc":
                live[event["addr"]] = event
            elif live.pop(event["addr"], None) is None:
                freed_earlier += event["size"]
        return peak, len(events), list(live.values()), freed_earlier

    def report(self, top: int = 30, blocks: int = 20) -> str:
        """The peak, then the `top` allocating sites of what is live there, then the `blocks`
        largest live blocks."""
        peak, n_events, live, freed_earlier = self.live_at_peak()
        sites: collections.Counter = collections.Counter()
        counts: collections.Counter = collections.Counter()
        for event in live:
            site = _site(event.get("frames", []))
            sites[site] += event["size"]
            counts[site] += 1
        per_unit = 1 / self.units / 1024
        lines = [f"peak {peak / 2**20:.0f} MiB ({n_events} events): "
                 f"{(self.before - freed_earlier) / 2**20:.0f} MiB from before the record, "
                 f"{sum(sites.values()) / 2**20:.0f} MiB allocated in it "
                 f"({sum(sites.values()) * per_unit:.1f} KiB per {self.unit})"]
        if n_events >= self.max_entries:
            lines.append(f"  (the record holds its last {self.max_entries} events only: record fewer steps)")
        for site, nbytes in sites.most_common(top):
            lines.append(f"  {nbytes / 2**20:9.1f} MiB {nbytes * per_unit:8.1f} KiB/{self.unit} x{counts[site]:<5} {site}")
        lines.append(f"the {blocks} largest blocks live at the peak:")
        for event in sorted(live, key=lambda e: -e["size"])[:blocks]:
            lines.append(f"  {event['size'] / 2**20:9.1f} MiB  {_site(event.get('frames', []))}")
        return "\n".join(lines)

    def dump(self, prefix: Path) -> tuple[Path, Path]:
        """Write the snapshot to ``prefix.pickle`` (loadable by torch's memory_viz) and the report
        to ``prefix.txt``; returns both paths."""
        prefix.parent.mkdir(parents=True, exist_ok=True)
        pickled, text = prefix.with_name(prefix.name + ".pickle"), prefix.with_name(prefix.name + ".txt")
        with pickled.open("wb") as f:
            pickle.dump(self.snapshot, f)
        text.write_text(self.report() + "\n")
        return pickled, text
