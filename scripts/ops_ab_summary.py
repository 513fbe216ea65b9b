"""Before/after table of `scripts/gpu_check.sh opsab`: each op's fwd+bwd time (CUDA-graph replayed and
plainly launched) and peak MiB on the base tree and this one, each side's median over its rounds.

Usage: python scripts/ops_ab_summary.py RESULTS_DIR (holding opsab_base-N/ and opsab_head-N/).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def runs(results: Path, side: str) -> dict[tuple[str, str, str], list[dict]]:
    """Each (op, size, impl)'s records over the rounds of `side`."""
    found: dict[tuple[str, str, str], list[dict]] = {}
    for path in sorted(results.glob(f"opsab_{side}-*/bench.json")):
        for record in json.loads(path.read_text())["results"]:
            if "fwd_bwd_ms" in record:
                found.setdefault((record["op"], record["size"], record["impl"]), []).append(record)
    return found


def median(records: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in records) if records else float("nan")


def main(results: Path) -> None:
    base, head = runs(results, "base"), runs(results, "head")
    print(f"{'op':<34} {'impl':<6} {'base ms':>8} {'head ms':>8} {'head/base':>9} {'plain b':>8} {'plain h':>8} "
          f"{'ratio':>6} {'peak b':>8} {'peak h':>8}")
    for key in sorted(base.keys() & head.keys()):
        b, h = base[key], head[key]
        replay = median(h, "fwd_bwd_ms") / median(b, "fwd_bwd_ms")
        plain = median(h, "fwd_bwd_host_ms") / median(b, "fwd_bwd_host_ms")
        print(f"{key[0]:<34} {key[2]:<6} {median(b, 'fwd_bwd_ms'):8.3f} {median(h, 'fwd_bwd_ms'):8.3f} {replay:9.3f} "
              f"{median(b, 'fwd_bwd_host_ms'):8.3f} {median(h, 'fwd_bwd_host_ms'):8.3f} {plain:6.3f} "
              f"{max(r['peak_mib'] for r in b):8.0f} {max(r['peak_mib'] for r in h):8.0f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
