"""Writes src/tigon/train/data/topics.jsonl, the rows `tigon sft --task classification` trains on
by default: 300 one-sentence texts, 75 for each of four topics (sports, food, weather,
technology), each a subject, a verb phrase and an ending drawn from the topic's own lists, so that
a tiny model learns the topic from its words within a CPU minute. Seeded: rerun it to get the
same file.

    python scripts/make_topics.py
"""

import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "src" / "tigon" / "train" / "data"
PER_TOPIC = 75

TOPICS = {
    "sports": (["The team", "Our striker", "The coach", "The goalkeeper", "The runner", "The home side", "The captain"],
               ["won the match", "scored twice in the final", "trained hard before the race",
                "lost the game on penalties", "broke the league record", "signed a new contract with the club",
                "was sent off in the second half"],
               ["at the stadium", "this season", "in the tournament", "after the whistle", "on the pitch"]),
    "food": (["The chef", "My grandmother", "The bakery", "This restaurant", "The cook", "Our neighbour", "The cafe"],
             ["baked fresh bread", "made a spicy curry", "served a sweet apple pie", "roasted vegetables with garlic",
              "cooked pasta with tomato sauce", "fried the fish in butter", "prepared a bowl of soup"],
             ["for dinner", "with extra cheese", "in the kitchen", "for breakfast", "with a pinch of salt"]),
    "weather": (["The forecast", "The sky", "A cold front", "The storm", "Heavy rain", "The wind", "The morning fog"],
                ["brought snow to the hills", "turned grey and cloudy", "will bring thunder tonight",
                 "kept the temperature low", "flooded the streets", "cleared by noon", "made the air humid and warm"],
                ["over the coast", "this weekend", "across the valley", "until tomorrow", "in the north"]),
    "technology": (["The new phone", "The software update", "Our laptop", "The startup", "The robot", "The app",
                    "The server"],
                   ["runs on a faster chip", "fixed a bug in the code", "crashed after the upgrade",
                    "uses less battery power", "stores the data in the cloud", "launched a new version",
                    "learned to recognise faces"],
                   ["this year", "for developers", "with better security", "on every device", "after the patch"]),
}


def main() -> None:
    rng = random.Random(7)
    rows = []
    for label, (subjects, verbs, endings) in TOPICS.items():
        texts: set[str] = set()
        while len(texts) < PER_TOPIC:
            texts.add(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(endings)}.")
        rows += [{"text": text, "label": label} for text in sorted(texts)]
    rng.shuffle(rows)
    (DATA / "topics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
