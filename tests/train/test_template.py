import copy
import random
import string

import pytest

from tigon.train import tiny
from tigon.train.config import SFTError
from tigon.train.data import Sample, load_samples
from tigon.train.template import IGNORE, encode, encode_all, ensure_chat_template


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tokenizer(load_samples([str(tiny.BUNDLED_DATASET)], seed=0))


def words(rng, n):
    return " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7))) for _ in range(n))


def chat(rng, turns=2, system=True):
    messages = [{"role": "system", "content": words(rng, 3)}] if system else []
    for _ in range(turns):
        messages += [{"role": "user", "content": words(rng, rng.randint(1, 6))},
                     {"role": "assistant", "content": words(rng, rng.randint(1, 6))}]
    return Sample("test", messages=tuple(messages))


def labelled_runs(tokenizer, enc):
    """The decoded text of each maximal run of labelled tokens (labels equal to their ids)."""
    runs, run = [], []
    for tok, label in zip(enc["input_ids"], enc["labels"]):
        if label == IGNORE:
            if run:
                runs.append(run)
            run = []
        else:
            assert label == tok
            run.append(tok)
    if run:
        runs.append(run)
    return [tokenizer.decode(r) for r in runs]


def assistant_texts(sample):
    return [m["content"] for m in sample.messages if m["role"] == "assistant"]


def test_loss_only_on_assistant_turns_chatml(tokenizer):
    rng = random.Random()
    for turns in (1, 2, 3):
        sample = chat(rng, turns, system=turns != 2)
        enc = encode(tokenizer, sample, max_length=1000)
        assert labelled_runs(tokenizer, enc) == [a + "<|im_end|>\n" for a in assistant_texts(sample)]
        assert enc["input_ids"] == tokenizer(tokenizer.apply_chat_template(list(sample.messages), tokenize=False),
                                             add_special_tokens=False)["input_ids"]


def test_default_template_for_tokenizers_without_one(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    ensure_chat_template(plain)
    sample = chat(random.Random(), 2)
    text = plain.apply_chat_template(list(sample.messages), tokenize=False)
    assert text.startswith("### System:\n") and "### Assistant:\n" in text
    enc = encode(plain, sample, max_length=1000)
    assert labelled_runs(plain, enc) == [a + plain.eos_token + "\n\n" for a in assistant_texts(sample)]


def test_template_that_rewrites_earlier_turns_falls_back_to_content(tokenizer):
    marked = copy.deepcopy(tokenizer)
    # Not prefix-stable: the last message is marked, so shorter renders are not prefixes of the full one.
    marked.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                            "{% if loop.last %} (last){% endif %}{{ '\\n' }}{% endfor %}"
                            "{% if add_generation_prompt %}assistant:{% endif %}")
    sample = chat(random.Random(), 2)
    enc = encode(marked, sample, max_length=1000)
    # (a leading space is labelled when the tokenizer merged it into the content's first token)
    assert [run.lstrip(" ") for run in labelled_runs(marked, enc)] == assistant_texts(sample)

    marked.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
                            "{{ m['role'] }}: {{ m['content'] }}{{ '\\n' }}{% endif %}{% endfor %}")
    with pytest.raises(SFTError, match="test: the chat template drops assistant turn 2"):
        encode(marked, sample, max_length=1000)
    marked.chat_template = "{{ raise_exception('no system messages') }}"
    with pytest.raises(SFTError, match="test: the chat template failed: .*no system messages"):
        encode(marked, sample, max_length=1000)


def test_plain_text_trains_on_every_token_but_the_first(tokenizer):
    text = words(random.Random(), 12)
    enc = encode(tokenizer, Sample("t", text=text), max_length=1000)
    ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    assert enc["input_ids"] == ids
    assert enc["labels"] == [IGNORE] + ids[1:]


def test_truncation_and_dropping(tokenizer, caplog):
    rng = random.Random()
    sample = chat(rng, 3)
    full = encode(tokenizer, sample, max_length=1000)
    n = len(full["input_ids"])
    cut = encode(tokenizer, sample, max_length=n - 3)
    assert cut == {"input_ids": full["input_ids"][: n - 3], "labels": full["labels"][: n - 3]}
    first_label = next(i for i, label in enumerate(full["labels"]) if label != IGNORE)
    assert encode(tokenizer, sample, max_length=first_label) is None  # nothing to learn left

    short = Sample("short", messages=({"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}))
    kept = encode_all(tokenizer, [sample, short], max_length=first_label, what="training data")
    assert kept == [encode(tokenizer, short, first_label)]
    assert "training data: 1 of 2 samples have no assistant tokens" in caplog.text
    with pytest.raises(SFTError, match="training data: no sample has a trainable token within --max-length 2"):
        encode_all(tokenizer, [sample], max_length=2, what="training data")
