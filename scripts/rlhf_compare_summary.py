"""The table of scripts/rlhf_gpu_compare.sh: per run, tokens/s (median after the first 3 logs),
peak GPU MiB, both as multiples of trl's, and the largest per-step loss difference to trl's, from
OUT/PREFIX-RUN.metrics.jsonl; written also to OUT/PREFIX-compare.json.

    python scripts/rlhf_compare_summary.py OUT PREFIX RUN [RUN ...]     # one RUN named trl
"""

import json
import statistics
import sys
from pathlib import Path


def main() -> None:
    out, prefix, names = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]

    def load(name):
        path = out / f"{prefix}-{name}.metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if '"loss"' in line] if path.is_file() else []

    def rate(recs):
        return statistics.median(r["tokens_per_s"] for r in recs[3:] or recs)

    def peak(recs):
        return max(r.get("gpu_mem_gib", 0) for r in recs) * 1024

    runs = {name: load(name) for name in names}
    base = runs.get("trl") or []
    summary = {}
    print(f"{prefix}: {'run':<16} {'tok/s':>9} {'x trl':>6} {'peak MiB':>9} {'x trl':>6} {'max |dloss| vs trl':>19}  steps")
    for name, recs in runs.items():
        if not recs:
            print(f"{prefix}: {name:<16} (no metrics: see {out}/{prefix}-{name}.log)")
            continue
        x_rate = rate(recs) / rate(base) if base else float("nan")
        x_peak = peak(recs) / peak(base) if base and peak(base) else float("nan")
        diff = max((abs(a["loss"] - b["loss"]) for a, b in zip(recs, base)), default=float("nan"))
        summary[name] = {"tokens_per_s": rate(recs), "peak_mib": peak(recs), "max_loss_diff_vs_trl": diff,
                         "losses": [r["loss"] for r in recs]}
        print(f"{prefix}: {name:<16} {rate(recs):>9.0f} {x_rate:>6.2f} {peak(recs):>9.0f} {x_peak:>6.2f} {diff:>19.4g}"
              f"  {len(recs)}")
    (out / f"{prefix}-compare.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
