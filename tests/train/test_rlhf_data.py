"""`tigon rlhf`'s data: every preference layout in every file type, the bad rows (one line naming
the file and line, nothing written), and the token rows (prompt, answers, truncation)."""

import json
import logging
import random

import pytest

from tests.train.test_data import SUFFIXES, word, write
from tigon.train import preference, tiny
from tigon.train.config import SFTError
from tigon.train.data import load_samples, read_file
from tigon.train.preference import Judged, Pair, encode, encode_all, load_preferences
from tigon.train.template import ensure_chat_template, render


def turn(role, content):
    return {"role": role, "content": content}


def layout(name, system, user, chosen, rejected):
    """One preference row in layout `name` (a system turn, a user turn, two answers)."""
    prompt = [turn("system", system), turn("user", user)]
    if name == "prompt_chosen_rejected":
        return {"prompt": prompt, "chosen": [turn("assistant", chosen)], "rejected": [turn("assistant", rejected)]}
    if name == "strings":
        return {"prompt": user, "chosen": chosen, "rejected": rejected}
    if name == "chats":
        return {"chosen": prompt + [turn("assistant", chosen)], "rejected": prompt + [turn("assistant", rejected)]}
    if name == "rejected_response":
        return {"messages": prompt + [turn("assistant", chosen)], "rejected_response": rejected}
    if name == "rejected_messages":
        return {"messages": prompt + [turn("assistant", chosen)], "rejected_messages": prompt + [turn("assistant", rejected)]}
    raise AssertionError(name)


LAYOUTS = [("prompt_chosen_rejected", "prompt/chosen/rejected"), ("strings", "prompt/chosen/rejected"),
           ("chats", "chosen/rejected chats"), ("rejected_response", "ms-swift messages + rejected_response"),
           ("rejected_messages", "ms-swift messages + rejected_messages")]


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("name, detected", LAYOUTS)
def test_paired_layouts(tmp_path, name, detected, suffix):
    rng = random.Random()
    rows = [tuple(word(rng) for _ in range(4)) for _ in range(rng.randint(2, 5))]
    path = write(tmp_path / f"d{suffix}", [layout(name, *r) for r in rows])
    pairs, fmt = read_file(str(path), 0, preference.FORMATS)
    assert fmt == detected
    for (system, user, chosen, rejected), pair in zip(rows, pairs):
        prompt = (turn("user", user),) if name == "strings" else (turn("system", system), turn("user", user))
        assert pair == Pair(pair.where, prompt, (turn("assistant", chosen),), (turn("assistant", rejected),))
    assert pairs[0].where.startswith(str(path))


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_kto_layout_and_labels(tmp_path, suffix):
    rng = random.Random()
    labels = [True, False, "true", "False", 1, 0, "yes", "no"]
    rows = [{"prompt": word(rng), "completion": word(rng), "label": label} for label in labels]
    if suffix == ".parquet":  # one type per column
        for r in rows:
            r["label"] = str(r["label"])
    path = write(tmp_path / f"d{suffix}", rows)
    judged, fmt = read_file(str(path), 0, preference.FORMATS)
    assert fmt == "KTO prompt/completion/label"
    assert [j.desirable for j in judged] == [True, False] * 4
    assert judged[0].prompt == (turn("user", rows[0]["prompt"]),)
    assert judged[0].completion == (turn("assistant", rows[0]["completion"]),)


def test_kto_takes_pairs_as_a_desirable_and_an_undesirable_answer_and_dpo_refuses_kto_rows(tmp_path):
    pairs = write(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "good", "rejected": "bad"}])
    kto = write(tmp_path / "k.jsonl", [{"prompt": "q2", "completion": "fine", "label": True}])
    judged = load_preferences([str(pairs), str(kto)], 0, "kto")
    assert [(j.completion[0]["content"], j.desirable) for j in judged] == [("good", True), ("bad", False),
                                                                          ("fine", True)]
    with pytest.raises(SFTError, match=f"^{kto} line 1: prompt/completion/label rows are unpaired .*use --method kto"):
        load_preferences([str(pairs), str(kto)], 0, "dpo")


def test_subsample_and_message_lists_as_csv_cells(tmp_path):
    rows = [layout("chats", "s", f"user {i}", f"yes {i}", f"no {i}") for i in range(20)]
    path = write(tmp_path / "d.csv", rows)
    a, b = (load_preferences([f"{path}#5"], 7, "dpo") for _ in range(2))
    assert a == b and len(a) == 5
    numbers = [int(p.prompt[-1]["content"].split()[1]) for p in a]
    assert numbers == sorted(numbers)


GOOD = {"prompt": "q", "chosen": "a", "rejected": "b"}
CHAT = {"chosen": [turn("user", "q"), turn("assistant", "a")], "rejected": [turn("user", "q"), turn("assistant", "b")]}


@pytest.mark.parametrize("first, bad, message", [
    (GOOD, {"prompt": "q", "chosen": "", "rejected": "b"}, "chosen is empty"),
    (GOOD, {"prompt": "q", "chosen": "a"}, "missing rejected \\(the file is prompt/chosen/rejected format\\)"),
    (GOOD, {"prompt": 3, "chosen": "a", "rejected": "b"}, "prompt must be a string or a list of messages, got int"),
    (GOOD, {"prompt": [turn("user", "q"), turn("assistant", "a")], "chosen": "a", "rejected": "b"},
     "prompt ends with an assistant turn"),
    (GOOD, {"prompt": "q", "chosen": [turn("user", "a")], "rejected": "b"}, "chosen must start with an assistant turn"),
    (GOOD, {"prompt": "q", "chosen": [turn("robot", "a")], "rejected": "b"}, "chosen\\[0\\] has role 'robot'"),
    (CHAT, {"chosen": CHAT["chosen"], "rejected": CHAT["chosen"]}, "chosen and rejected do not differ in an answer"),
    (CHAT, {"chosen": [turn("user", "q"), turn("assistant", "a")], "rejected": [turn("user", "x"), turn("assistant", "b")]},
     "chosen and rejected first differ at turn 0, which is not an assistant turn"),
    (CHAT, {"chosen": [turn("assistant", "a")], "rejected": [turn("assistant", "b")]}, "chosen and rejected share no prompt"),
    ({"messages": [turn("user", "q"), turn("assistant", "a")], "rejected_response": "b"},
     {"messages": [turn("user", "q")], "rejected_response": "b"}, "messages must end with the chosen answer"),
    ({"messages": [turn("user", "q"), turn("assistant", "a")], "rejected_response": "b"},
     {"messages": [turn("user", "q"), turn("assistant", "a")], "rejected_response": None},
     "rejected_response must be a string, got NoneType"),
    ({"prompt": "q", "completion": "a", "label": True}, {"prompt": "q", "completion": "a", "label": "maybe"},
     "label must be true or false \\(desirable or not\\), got 'maybe'"),
])
def test_bad_row_names_file_line_and_problem(tmp_path, first, bad, message):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(first) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(SFTError, match=f"^{path} line 2: {message}"):
        load_preferences([str(path)], 0, "kto")


def test_unknown_layout_names_the_expected_keys(tmp_path):
    path = write(tmp_path / "d.jsonl", [{"messages": [turn("user", "q"), turn("assistant", "a")]}])
    with pytest.raises(SFTError, match=f"^{path} line 1: unknown data format \\(keys \\['messages'\\]\\); expected "
                                       "messages\\+rejected_response, messages\\+rejected_messages, "
                                       "prompt\\+completion\\+label, prompt\\+chosen\\+rejected or chosen\\+rejected$"):
        load_preferences([str(path)], 0, "dpo")


@pytest.fixture(scope="module")
def tokenizer():
    tok = tiny.build_tokenizer(load_samples([str(tiny.BUNDLED_DATASET)], seed=0))
    ensure_chat_template(tok)
    return tok


def ids(tokenizer, messages, generation_prompt):
    return tokenizer(render(tokenizer, messages, generation_prompt), add_special_tokens=False)["input_ids"]


def test_rows_are_the_prompt_then_what_each_answer_adds(tokenizer):
    rng = random.Random()
    prompt = (turn("system", word(rng)), turn("user", word(rng)), turn("assistant", word(rng)), turn("user", word(rng)))
    pair = Pair("row", prompt, (turn("assistant", word(rng)),), (turn("assistant", " ".join(word(rng) for _ in range(3))),))
    row, whole = encode(tokenizer, pair, 10_000)
    assert whole and row["prompt_ids"] == ids(tokenizer, prompt, True)  # the history's answers are prompt
    for key in ("chosen", "rejected"):
        assert row["prompt_ids"] + row[f"{key}_ids"] == ids(tokenizer, prompt + getattr(pair, key), False)
        assert tokenizer.decode(row[f"{key}_ids"]).startswith(getattr(pair, key)[0]["content"])
    judged, _ = encode(tokenizer, Judged("row", prompt, pair.chosen, False), 10_000)
    assert judged == {"prompt_ids": row["prompt_ids"], "completion_ids": row["chosen_ids"], "label": False}


def test_truncation_keeps_the_prompts_end_and_the_answers_start(tokenizer, caplog):
    long = Pair("long", (turn("user", "alpha beta gamma " * 30),), (turn("assistant", "delta " * 40),),
                (turn("assistant", "no"),))
    full, _ = encode(tokenizer, long, 10_000)
    row, whole = encode(tokenizer, long, 60, max_prompt_length=25)
    assert not whole
    assert row["prompt_ids"] == full["prompt_ids"][-25:]
    assert row["chosen_ids"] == full["chosen_ids"][:35] and row["rejected_ids"] == full["rejected_ids"]
    assert encode(tokenizer, long, len(full["prompt_ids"]))[0] is None  # the prompt fills --max-length
    short = Pair("short", (turn("user", "q"),), (turn("assistant", "a"),), (turn("assistant", "b"),))
    caplog.set_level(logging.WARNING)
    rows = encode_all(tokenizer, [long, short, long], len(full["prompt_ids"]), None, "training data")
    assert len(rows) == 1 and "training data: 2 of 3 rows have a prompt of --max-length" in caplog.text
    with pytest.raises(SFTError, match="training data: no row leaves room for an answer within --max-length 5"):
        encode_all(tokenizer, [long], 5, None, "training data")


def test_a_template_that_fails_is_one_line(tokenizer):
    pair = Pair("data.jsonl line 4", (turn("user", "q"),), (turn("assistant", "a"),), (turn("assistant", "b"),))
    saved = tokenizer.chat_template
    tokenizer.chat_template = "{{ raise_exception('no system turns here') }}"
    try:
        with pytest.raises(SFTError, match="^data.jsonl line 4: the chat template failed: .*no system turns here"):
            encode(tokenizer, pair, 100)
    finally:
        tokenizer.chat_template = saved
