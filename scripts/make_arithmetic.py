"""Writes src/tigon/train/data/arithmetic.jsonl, the prompts `tigon rlhf --method grpo` trains on
by default: 40 of the sums and non-negative differences of two digits (seeded), worded as the
bundled instructions word them ("What is 7 plus 5?"), with the number as the `answer` column that
builtin:exact_answer compares the completion's last number with. Some of them are among the
instructions the built-in model learns in sft; the others it has to get right by trial. Few
enough that each prompt comes back ~8 times in the default run's 80 steps of 4 prompts: with all
155 each comes twice, and the reward stays flat within the run.

    python scripts/make_arithmetic.py
"""

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "tigon" / "train" / "data" / "arithmetic.jsonl"


def main() -> None:
    rows = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(10) for b in range(10)]
    rows += [{"prompt": f"What is {a} minus {b}?", "answer": str(a - b)} for a in range(10) for b in range(a + 1)]
    random.Random(0).shuffle(rows)
    OUT.write_text("".join(json.dumps(row) + "\n" for row in rows[:40]))


if __name__ == "__main__":
    main()
