"""Writes src/tigon/train/data/pairs.jsonl, the pairs `tigon embed` trains on by default: 200
made-up facts (50 people, each with a city, a job, a food and a pet drawn from short lists,
seeded), each a question as the query, the fact as its positive, and two hard negatives: the same
fact about someone else, and another fact about the same person. A query is answered only by
matching both its person and what it asks, which the held-out pairs test with people and
relations seen in training but not together.

    python scripts/make_pairs.py
"""

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "tigon" / "train" / "data" / "pairs.jsonl"
NAMES = ("Anna Ben Carla David Elena Farid Greta Hugo Ines Jonas Kira Leo Maya Nils Olga Pablo Quinn Rosa Sven Tara "
         "Umar Vera Wade Xenia Yusuf Zoe Aldo Bianca Cyril Dana Emil Fiona Gustav Hana Igor Jana Karl Lina Marco "
         "Nora Omar Petra Rafael Sara Tomas Ulla Viktor Wanda Yara Zeno").split()
CITIES = "Paris Berlin Madrid Rome Vienna Oslo Lisbon Prague Dublin Athens Warsaw Cairo Lima Tokyo Seoul Delhi".split()
JOBS = "baker doctor pilot teacher farmer painter nurse lawyer chef driver writer singer".split()
FOODS = "apples rice soup cheese bread noodles pears fish beans cake olives honey".split()
PETS = "cat dog parrot horse rabbit goat turtle hamster snake pony".split()
# relation: (question templates, the fact's template, its values)
RELATIONS = {
    "city": (["Where does {n} live?", "In which city does {n} live?"], "{n} lives in {v}.", CITIES),
    "job": (["What is the job of {n}?", "What does {n} work as?"], "{n} works as a {v}.", JOBS),
    "food": (["What does {n} like to eat?", "Which food does {n} like?"], "{n} likes to eat {v}.", FOODS),
    "pet": (["Which pet does {n} have?", "What pet does {n} keep?"], "{n} has a pet {v}.", PETS),
}


def main() -> None:
    rng = random.Random(41)
    facts = {(n, r): rng.choice(RELATIONS[r][2]) for n in NAMES for r in RELATIONS}
    rows = []
    for (name, relation), value in facts.items():
        questions, fact, _ = RELATIONS[relation]
        query = rng.choice(questions).format(n=name)
        other_name = rng.choice([m for m in NAMES if m != name])
        other_relation = rng.choice([r for r in RELATIONS if r != relation])
        negatives = [fact.format(n=other_name, v=value),
                     RELATIONS[other_relation][1].format(n=name, v=facts[(name, other_relation)])]
        rows.append({"query": query, "positive": fact.format(n=name, v=value), "negatives": negatives})
    rng.shuffle(rows)
    OUT.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
