"""Before/after table of `scripts/gpu_check.sh ab`: tok/s and peak GiB of each (shape, mode, impl)
on the base tree and this one, each side's median over its rounds, and head / base.

Usage: python scripts/ab_summary.py RESULTS_DIR (holding ab_base-N/ and ab_head-N/ from the stage).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def runs(results: Path, side: str) -> dict[tuple[str, str, str], list[dict]]:
    """Each (shape, mode, impl)'s records over the rounds of `side`."""
    found: dict[tuple[str, str, str], list[dict]] = {}
    for path in sorted(results.glob(f"ab_{side}-*/**/e2e.json")):
        data = json.loads(path.read_text())
        shape = f"{data['settings']['batch']}x{data['settings']['seq']}"
        for record in data["results"]:
            if "error" not in record:
                found.setdefault((shape, record["mode"], record["impl"]), []).append(record)
    return found


def main(results: Path) -> None:
    base, head = runs(results, "base"), runs(results, "head")
    print(f"{'shape':<8} {'mode':<5} {'impl':<13} {'base tok/s':>11} {'head tok/s':>11} {'head/base':>9} "
          f"{'base GiB':>9} {'head GiB':>9}  rounds")
    for key in sorted(base.keys() | head.keys()):
        b = statistics.median(r["tokens_per_s"] for r in base[key]) if key in base else None
        h = statistics.median(r["tokens_per_s"] for r in head[key]) if key in head else None
        bp = max((r["peak_gib"] for r in base.get(key, [])), default=float("nan"))
        hp = max((r["peak_gib"] for r in head.get(key, [])), default=float("nan"))
        ratio = f"{h / b:9.3f}" if b and h else f"{'-':>9}"
        print(f"{key[0]:<8} {key[1]:<5} {key[2]:<13} {b or 0:11.0f} {h or 0:11.0f} {ratio} {bp:9.2f} {hp:9.2f}  "
              f"{len(base.get(key, []))}/{len(head.get(key, []))}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
