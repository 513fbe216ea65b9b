"""Plot linear_cross_entropy's time and peak memory over chunk budgets, with the torch.compile and
eager baselines of the same H200 session, from the JSON files `tigon bench` wrote.

Usage: python scripts/plot_lce_budget.py docs/bench/lce_budget.json docs/bench/ops_headline.json docs/bench/lce_budget.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sweep, headline, out = sys.argv[1:4]
points = [r for r in json.load(open(sweep))["results"] if r["impl"] == "tigon" and "fwd_bwd_ms" in r]
base = {r["impl"]: r for r in json.load(open(headline))["results"] if r["op"] == "linear_cross_entropy"}
budgets = [int(r["size"].split("x")[3]) for r in points]

fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(10, 4))
ax_time.plot(budgets, [r["fwd_bwd_ms"] for r in points], marker="o", label="tigon")
for impl, style in (("compile", "--"), ("eager", ":")):
    ax_time.axhline(base[impl]["fwd_bwd_ms"], linestyle=style, color="gray", label=f"torch {impl}")
ax_time.axhline(0.95 * base["compile"]["fwd_bwd_ms"], color="red", linewidth=0.8, label="target 0.95x compile")
ax_time.set(xscale="log", xlabel="chunk budget (MiB)", ylabel="fwd+bwd ms (median)", title="time")
ax_mem.plot(budgets, [r["peak_mib"] for r in points], marker="o", label="tigon")
ax_mem.axhline(base["compile"]["peak_mib"], linestyle="--", color="gray", label="torch compile")
ax_mem.axhline(128, color="red", linewidth=0.8, label="target 128 MiB")
ax_mem.set(xscale="log", yscale="log", xlabel="chunk budget (MiB)", ylabel="peak extra MiB", title="memory")
for ax in (ax_time, ax_mem):
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.legend(fontsize=8)
fig.suptitle("linear_cross_entropy, h 8192x4096, W 128256x4096, bf16, H200")
fig.tight_layout()
fig.savefig(out, dpi=110)
