"""Writes src/tigon/train/data/preferences.jsonl, the pairs `tigon rlhf` trains on by default: one
per bundled instruction, its answer chosen and a wrong one rejected.

The wrong answer is the right one with its fact swapped for another row's: among the answers
worded alike (same words but one or two), the word where they differ that the question does not
name ("The capital of France is Madrid.", "A dog has 2 legs."); sums and differences get a wrong
number; an answer worded like no other gets another question's answer. Seeded: rerun it to get
the same file.

    python scripts/make_preferences.py
"""

import json
import random
import re
import string
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "src" / "tigon" / "train" / "data"
ARITHMETIC = re.compile(r"^(\d+) (plus|minus) (\d+) is (\d+)\.$")


def words(text: str) -> list[str]:
    return text.split()


def bare(word: str) -> str:
    return word.strip(string.punctuation).lower()


def wrong_number(answer: str, rng: random.Random) -> str | None:
    match = ARITHMETIC.match(answer)
    if match is None:
        return None
    a, op, b, result = match.groups()
    wrong = int(result) + rng.choice([d for d in (-2, -1, 1, 2) if int(result) + d >= 0])
    return f"{a} {op} {b} is {wrong}."


def swapped_fact(question: str, answer: str, others: list[str], rng: random.Random) -> str | None:
    """`answer` with one word taken from an answer worded alike, preferring a word the question
    does not name."""
    mine = words(answer)
    named = {bare(w) for w in words(question)}
    candidates = []
    for other in others:
        theirs = words(other)
        if len(theirs) != len(mine):
            continue
        differ = [i for i, (x, y) in enumerate(zip(mine, theirs)) if bare(x) != bare(y)]
        if not 1 <= len(differ) <= 2:
            continue
        unnamed = [i for i in differ if bare(mine[i]) not in named]
        for i in unnamed or differ:
            candidates.append((not unnamed, i, theirs[i]))
    if not candidates:
        return None
    best = min(c[0] for c in candidates)
    _, i, word = rng.choice([c for c in candidates if c[0] == best])
    swapped = list(mine)
    # Keep the right answer's punctuation around the word (a final full stop, a comma).
    swapped[i] = mine[i].replace(mine[i].strip(string.punctuation), word.strip(string.punctuation))
    result = " ".join(swapped)
    return result if result != answer else None


def main() -> None:
    rng = random.Random(0)
    rows = [json.loads(line) for line in (DATA / "instructions.jsonl").read_text().splitlines() if line.strip()]
    pairs = [(r["messages"][0]["content"], r["messages"][-1]["content"]) for r in rows]
    answers = sorted({a for _, a in pairs})
    with (DATA / "preferences.jsonl").open("w") as out:
        for question, answer in pairs:
            rejected = (wrong_number(answer, rng) or swapped_fact(question, answer, answers, rng)
                        or rng.choice([a for a in answers if a != answer]))
            out.write(json.dumps({"prompt": question, "chosen": answer, "rejected": rejected}) + "\n")


if __name__ == "__main__":
    main()
