"""Preference data for `tigon rlhf`: pairs (a prompt, a chosen and a rejected answer) or judged
answers (KTO: a prompt, an answer, desirable or not), read in five layouts from the files
`tigon sft` reads, then turned into token rows as TRL's trainers make them.

Layouts, detected per file from its first row (the first that fits):

    messages + rejected_response    ms-swift: a chat whose last (assistant) turn is the chosen
                                    answer, and the rejected answer as text
    messages + rejected_messages    ms-swift: the chosen chat and the rejected one
    prompt + completion + label     KTO's unpaired answers, label true (desirable) or false
    prompt + chosen + rejected      each a string (a user turn / an assistant answer) or messages
    chosen + rejected               two whole chats: their shared first turns are the prompt

Tokens: the chat template renders the prompt with its generation prompt, and the prompt followed
by each answer; the answer is what follows the tokens they share (a template may render the prompt
differently alone), and only its tokens are scored. ``--max-prompt-length`` keeps a prompt's last
tokens; ``--max-length`` then cuts each answer to fit, and a row whose prompt alone fills it is
dropped (TRL drops those too). A bad row stops the run with its file and line, before anything is
written."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from tigon.train.config import SFTError
from tigon.train.data import TEXT_ONLY, Format, RowError, _text, load_samples, turn_list
from tigon.train.template import render

log = logging.getLogger("tigon.train")

Turns = tuple[dict[str, str], ...]


@dataclass(frozen=True)
class Pair:
    """A prompt (the chat up to the answers) and its chosen and rejected answers (assistant turns,
    and whatever follows them)."""

    where: str
    prompt: Turns
    chosen: Turns
    rejected: Turns
    margin: float | None = None  # how much more the chosen answer is preferred (a reward model's margin column)


@dataclass(frozen=True)
class Judged:
    """KTO's unpaired example: a prompt, one answer and whether that answer is desirable."""

    where: str
    prompt: Turns
    completion: Turns
    desirable: bool


def _turns_or_text(value: Any, key: str) -> list[dict[str, str]] | str:
    """Messages (a list, or a CSV cell holding one as JSON), or else the text itself."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, list) and parsed and all(isinstance(m, dict) for m in parsed):
            value = parsed
    if isinstance(value, list):
        return turn_list(value, key)
    if not isinstance(value, str):
        raise RowError(f"{key} must be a string or a list of messages, got {type(value).__name__}")
    return _text(value, key)


def _prompt(value: Any, key: str) -> Turns:
    turns = _turns_or_text(value, key)
    if isinstance(turns, str):
        return ({"role": "user", "content": turns},)
    if turns[-1]["role"] == "assistant":
        raise RowError(f"{key} ends with an assistant turn; the answers go in the answer fields")
    return tuple(turns)


def _answer(turns: list[dict[str, str]] | str, key: str) -> Turns:
    if isinstance(turns, str):
        return ({"role": "assistant", "content": turns},)
    if turns[0]["role"] != "assistant":
        raise RowError(f"{key} must start with an assistant turn (the answer), got role {turns[0]['role']!r}")
    if not any(m["role"] == "assistant" and _text_of(m["content"]).strip() for m in turns):
        raise RowError(f"{key} has no assistant message with content")
    return tuple(turns)


def _text_of(content: str | list[dict[str, Any]]) -> str:
    """A message's text (of its text parts, for a vision-language model's messages)."""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content if p["type"] == "text")


def _shared_prompt(chosen: list[dict[str, str]], rejected: list[dict[str, str]], keys: tuple[str, str]) -> Pair:
    """Two whole chats as a prompt (the turns they share) and the two answers after it."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n == len(chosen) or n == len(rejected):
        raise RowError(f"{keys[0]} and {keys[1]} do not differ in an answer (one holds the other whole)")
    if chosen[n]["role"] != "assistant" or rejected[n]["role"] != "assistant":
        raise RowError(f"{keys[0]} and {keys[1]} first differ at turn {n}, which is not an assistant turn: they "
                       "must share the prompt and differ in the answer")
    if n == 0:
        raise RowError(f"{keys[0]} and {keys[1]} share no prompt: they must start with the same turns")
    return Pair("", tuple(chosen[:n]), _answer(chosen[n:], keys[0]), _answer(rejected[n:], keys[1]))


def _from_prompt_chosen_rejected(row: dict) -> Pair:
    return Pair("", _prompt(row["prompt"], "prompt"), _answer(_turns_or_text(row["chosen"], "chosen"), "chosen"),
                _answer(_turns_or_text(row["rejected"], "rejected"), "rejected"))


def _from_chats(row: dict) -> Pair:
    return _shared_prompt(turn_list(row["chosen"], "chosen"), turn_list(row["rejected"], "rejected"),
                          ("chosen", "rejected"))


def _from_messages_and_rejected_response(row: dict) -> Pair:
    messages = turn_list(row["messages"], "messages")
    if messages[-1]["role"] != "assistant" or not messages[-1]["content"].strip():
        raise RowError("messages must end with the chosen answer (an assistant turn with content)")
    if len(messages) < 2:
        raise RowError("messages holds no prompt before its answer")
    rejected = _text(row["rejected_response"], "rejected_response")
    return Pair("", _prompt(messages[:-1], "messages"), (messages[-1],), _answer(rejected, "rejected_response"))


def _from_messages_and_rejected_messages(row: dict) -> Pair:
    return _shared_prompt(turn_list(row["messages"], "messages"),
                          turn_list(row["rejected_messages"], "rejected_messages"), ("messages", "rejected_messages"))


_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _label(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise RowError(f"label must be true or false (desirable or not), got {value!r}")


def _from_kto(row: dict) -> Judged:
    return Judged("", _prompt(row["prompt"], "prompt"), _answer(_turns_or_text(row["completion"], "completion"),
                                                                "completion"), _label(row["label"]))


def _text_only(convert: Callable[[dict], Any]) -> Callable[[dict], Any]:
    """`convert`, refusing a row that carries images or video (`tigon.train.vision_rlhf` reads those)."""
    def converted(row: dict) -> Any:
        for media in ("images", "videos"):
            if row.get(media) not in (None, "", [], "[]"):
                raise RowError(f"has {media}: {TEXT_ONLY}")
        return convert(row)

    return converted


def _pair_format(convert: Callable[[dict], Pair]) -> Callable[[dict], Pair]:
    """`convert`, refusing a pair whose two answers are the same (nothing to prefer), and keeping
    a row's optional ``margin`` (a finite number) in its pair."""
    def converted(row: dict) -> Pair:
        pair = convert(row)
        if pair.chosen == pair.rejected:
            raise RowError("the chosen and rejected answers are the same: nothing to prefer")
        value = row.get("margin")
        if value is None or (isinstance(value, str) and not value.strip()):
            return pair
        try:
            margin = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError):
            margin = math.nan
        if not math.isfinite(margin):
            raise RowError(f"margin must be a finite number, got {value!r}")
        return dataclasses.replace(pair, margin=margin)

    return converted


FORMATS: list[Format] = [
    ("ms-swift messages + rejected_response", ("messages", "rejected_response"),
     _text_only(_pair_format(_from_messages_and_rejected_response))),
    ("ms-swift messages + rejected_messages", ("messages", "rejected_messages"),
     _text_only(_pair_format(_from_messages_and_rejected_messages))),
    ("KTO prompt/completion/label", ("prompt", "completion", "label"), _text_only(_from_kto)),
    ("prompt/chosen/rejected", ("prompt", "chosen", "rejected"), _text_only(_pair_format(_from_prompt_chosen_rejected))),
    ("chosen/rejected chats", ("chosen", "rejected"), _text_only(_pair_format(_from_chats))),
]


def load_preferences(specs: list[str], seed: int, method: str) -> list[Pair] | list[Judged]:
    """The rows of every file in `specs`: pairs for the paired methods; for ``kto`` judged answers,
    each pair giving a desirable (chosen) and an undesirable (rejected) one."""
    return for_method(load_samples(specs, seed, FORMATS), method,
                      lambda pair, desirable: Judged(pair.where, pair.prompt,
                                                     pair.chosen if desirable else pair.rejected, desirable))


def for_method(items: list[Any], method: str, judged: Callable[[Any, bool], Any]) -> list[Any]:
    """`items` (pairs and judged answers) as `method` trains on them: for ``kto`` judged answers,
    each pair giving a desirable and an undesirable one (`judged(pair, desirable)`); for the
    others the pairs, an unpaired row being an SFTError."""
    if method == "kto":
        return [j for item in items for j in ([judged(item, True), judged(item, False)]
                                               if isinstance(item, Pair) else [item])]
    unpaired = next((item for item in items if isinstance(item, Judged)), None)
    if unpaired is not None:
        raise SFTError(f"{unpaired.where}: prompt/completion/label rows are unpaired (KTO's layout): --method "
                       f"{method} needs pairs (prompt, chosen, rejected); use --method kto")
    return items


# --- tokens -------------------------------------------------------------------------------------

def _ids(tokenizer: Any, messages: Sequence[dict[str, str]], where: str, generation_prompt: bool) -> list[int]:
    try:
        text = render(tokenizer, messages, generation_prompt)
    except Exception as err:  # a template raises whatever its author chose: report it on one line
        raise SFTError(f"{where}: the chat template failed: {type(err).__name__}: {err}") from None
    # The template writes BOS itself where the model wants one.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _split(tokenizer: Any, prompt: Turns, answers: dict[str, Turns], where: str) -> dict[str, list[int]]:
    """``prompt_ids`` and one ``<key>_ids`` per answer: the tokens of prompt + answer after those
    every rendering shares with the prompt's own (with its generation prompt)."""
    prompt_ids = _ids(tokenizer, prompt, where, True)
    full = {key: _ids(tokenizer, prompt + turns, where, False) for key, turns in answers.items()}
    n = min(_shared(prompt_ids, ids) for ids in full.values())
    row = {"prompt_ids": prompt_ids[:n]}
    for key, ids in full.items():
        if len(ids) == n:
            raise SFTError(f"{where}: the chat template renders the {key} answer as no tokens")
        row[f"{key}_ids"] = ids[n:]
    return row


def _truncated(row: dict[str, Any], max_length: int, max_prompt_length: int | None) -> dict[str, Any] | None:
    """`row` with its prompt cut to its last `max_prompt_length` tokens and each answer to what
    `max_length` leaves; None when the prompt alone fills `max_length`."""
    prompt = row["prompt_ids"]
    if max_prompt_length is not None:
        prompt = prompt[-max_prompt_length:]
    if len(prompt) >= max_length:
        return None
    room = max_length - len(prompt)
    return {**row, "prompt_ids": prompt,
            **{k: v[:room] for k, v in row.items() if k.endswith("_ids") and k != "prompt_ids"}}


def encode(tokenizer: Any, item: Pair | Judged, max_length: int, max_prompt_length: int | None = None
           ) -> tuple[dict[str, Any] | None, bool]:
    """The token row of `item` (``prompt_ids``, ``chosen_ids`` and ``rejected_ids``, or
    ``completion_ids`` and ``label``) within the limits, and whether it fits them whole. The row is
    None when the prompt alone fills `max_length`."""
    if isinstance(item, Pair):
        row: dict[str, Any] = _split(tokenizer, item.prompt, {"chosen": item.chosen, "rejected": item.rejected},
                                     item.where)
    else:
        row = {**_split(tokenizer, item.prompt, {"completion": item.completion}, item.where), "label": item.desirable}
    cut = _truncated(row, max_length, max_prompt_length)
    return cut, cut == row


def encode_all(tokenizer: Any, items: list[Pair] | list[Judged], max_length: int, max_prompt_length: int | None,
               what: str) -> list[dict[str, Any]]:
    """Every item's token row; rows whose prompt fills `max_length` are dropped with a count."""
    return [row for _, row in encoded_items(tokenizer, items, max_length, max_prompt_length, what)]


def encoded_items(tokenizer: Any, items: list[Pair] | list[Judged], max_length: int, max_prompt_length: int | None,
                  what: str) -> list[tuple[Pair | Judged, dict[str, Any]]]:
    """`encode_all`'s rows, each with its item."""
    rows = [(item, row) for item, (row, _) in ((i, encode(tokenizer, i, max_length, max_prompt_length)) for i in items)
            if row is not None]
    if len(rows) < len(items):
        log.warning("%s: %d of %d rows have a prompt of --max-length %d tokens or more, leaving no answer: dropped",
                    what, len(items) - len(rows), len(items), max_length)
    if not rows:
        raise SFTError(f"{what}: no row leaves room for an answer within --max-length {max_length}")
    return rows


def shuffled(rows: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """`rows` in a seeded random order. KTO's trainer reads its data in order (each answer's KL
    term pairs it with another prompt of its batch), so a file of pairs split in two would
    otherwise train on its desirable answers first and its undesirable ones after."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    return [rows[i] for i in order]


def sequence_tokens(row: dict[str, Any]) -> tuple[int, int]:
    """(tokens, sequences) the policy trains on for `row`: a pair is two sequences sharing a prompt."""
    answers = [v for k, v in row.items() if k.endswith("_ids") and k != "prompt_ids" and not k.startswith("KL_")]
    return sum(len(row["prompt_ids"]) + len(a) for a in answers), len(answers)


def pick_prompts(tokenizer: Any, items: list[Pair] | list[Judged], n: int, max_length: int,
                 max_prompt_length: int | None) -> list[list[dict[str, str]]]:
    """Up to `n` distinct prompts of rows that training sees whole, for the samples answered
    before and after training."""
    prompts: list[list[dict[str, str]]] = []
    for item in items:
        if len(prompts) == n:
            break
        _, whole = encode(tokenizer, item, max_length, max_prompt_length)
        if whole and list(item.prompt) not in prompts:
            prompts.append(list(item.prompt))
    return prompts
