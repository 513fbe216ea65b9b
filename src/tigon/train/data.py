"""Training data: read jsonl/json/csv/parquet files, detect each file's format from its first row,
and turn every row into a chat (a list of role/content messages) or a plain text. Every row is
checked; the first bad one stops the run with its file, line and what is wrong."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

from tigon.train.config import SFTError, utf8_text

log = logging.getLogger("tigon.train")

ROLES = ("system", "user", "assistant")
# ShareGPT speaker names seen in the wild, mapped to chat roles.
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "model": "assistant", "bot": "assistant", "chatgpt": "assistant", "system": "system"}


@dataclass(frozen=True)
class Sample:
    """One training example: `messages` for a chat (loss on assistant turns only) or `text` for
    plain text (loss on every token). `where` names its file and line, for error messages."""

    where: str
    messages: tuple[dict[str, str], ...] | None = None
    text: str | None = None


class RowError(ValueError):
    """What is wrong with one row; the reader adds the file and line."""


@contextlib.contextmanager
def _open_text(path: Path, newline: str | None = None) -> Iterator[TextIO]:
    """`path` opened as UTF-8 text, less the byte-order mark that spreadsheet exports put first.
    A byte that is not UTF-8 becomes an SFTError naming its place in the file."""
    try:
        with path.open(encoding="utf-8-sig", newline=newline) as f:
            yield f
    except UnicodeDecodeError:
        utf8_text(path.read_bytes(), path)  # the decoder's position is within a buffer: find it in the file
        raise


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with _open_text(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield f"line {number}", json.loads(line)
                except json.JSONDecodeError as err:
                    raise SFTError(f"{path} line {number}: not valid JSON: {err.msg}") from None


def _read_json(path: Path) -> Iterator[tuple[str, Any]]:
    text = utf8_text(path.read_bytes(), path)
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # several JSON documents, one per line: JSON Lines named .json
            yield from _read_jsonl(path)
            return
        raise SFTError(f"{path} line {err.lineno}: not valid JSON: {err.msg}") from None
    if not isinstance(payload, list):
        raise SFTError(f"{path}: expected a JSON list of rows, got {type(payload).__name__}")
    for number, row in enumerate(payload, 1):
        yield f"row {number}", row


def _read_csv(path: Path) -> Iterator[tuple[str, Any]]:
    with _open_text(path, newline="") as f:
        reader = csv.DictReader(f)
        for row in reader:
            if None in row:
                raise SFTError(f"{path} line {reader.line_num}: more cells than header columns")
            yield f"line {reader.line_num}", row


def _read_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    """Rows read one row group at a time, so that damage is placed: pyarrow's own errors
    ("Corrupt snappy compressed data.") name neither the file nor where in it."""
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise SFTError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as err:
        raise SFTError(f"{path}: not a readable parquet file: {err}") from None
    with table:
        groups = table.metadata.num_row_groups
        number = 0
        for group in range(groups):
            try:
                rows = table.read_row_group(group).to_pylist()
            except (pyarrow.ArrowException, OSError) as err:
                size = table.metadata.row_group(group).num_rows
                raise SFTError(f"{path} rows {number + 1}-{number + size} (row group {group + 1} of {groups}): "
                               f"cannot be read, the file is damaged: {err}") from None
            for row in rows:
                number += 1
                yield f"row {number}", row


_READERS: dict[str, Callable[[Path], Iterator[tuple[str, Any]]]] = {
    ".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet,
}


def _text(value: Any, what: str, *, required: bool = True) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise RowError(f"{what} must be a string, got {type(value).__name__}")
    if required and not value.strip():
        raise RowError(f"{what} is empty")
    return value


def _json_cell(value: Any, what: str) -> Any:
    """CSV cells hold nested lists as JSON text."""
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else None
        except json.JSONDecodeError as err:
            raise RowError(f"{what} is not valid JSON: {err.msg}") from None
    return value


def _content(value: Any, what: str) -> str:
    # OpenAI content may be a list of parts; only text parts can be trained on here.
    if isinstance(value, list):
        parts = []
        for part in value:
            if isinstance(part, dict) and part.get("type") in ("image", "image_url", "video", "video_url"):
                raise RowError(f"{what} has an {part['type']} part: {TEXT_ONLY}")
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RowError(f"{what} has a non-text part; only text content is supported")
            parts.append(_text(part.get("text"), f"{what} text part", required=False))
        value = "".join(parts)
    return _text(value, what, required=False)


def _check_chat(messages: list[dict[str, str]]) -> tuple[dict[str, str], ...]:
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise RowError("no assistant message with content: nothing to learn from")
    return tuple(messages)


def turn_list(value: Any, key: str, role_key: str = "role", content_key: str = "content",
              roles: dict[str, str] | None = None, content: Callable[[Any, str], Any] | None = None
              ) -> list[dict[str, str]]:
    """`value` (a list, or a CSV cell holding one as JSON) as role/content messages; `key` names
    it in errors. `content(value, what)` converts each message's content (default: to text)."""
    roles = roles or {r: r for r in ROLES}
    content = content or _content
    turns = _json_cell(value, key)
    if not isinstance(turns, list) or not turns:
        raise RowError(f"{key} must be a non-empty list of messages")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowError(f"{key}[{i}] must be an object, got {type(turn).__name__}")
        # ShareGPT files sometimes carry OpenAI-style keys inside "conversations".
        rk, ck = (role_key, content_key) if role_key in turn else ("role", "content")
        if rk not in turn or ck not in turn:
            raise RowError(f"{key}[{i}] needs {role_key!r} and {content_key!r}")
        role = roles.get(turn[rk]) if isinstance(turn[rk], str) else None
        if role is None:
            raise RowError(f"{key}[{i}] has {rk} {turn[rk]!r}; expected one of {', '.join(sorted(roles))}")
        messages.append({"role": role, "content": content(turn[ck], f"{key}[{i}].{ck}")})
    return messages


# Why a row with images stops a text-only run (tigon.train.vision_run trains vision-language models).
TEXT_ONLY = ("a text-only model cannot train on images or video: give a vision-language model (--model whose "
             "config has a vision_config), or --modality vision for the built-in one")


def _messages(row: dict, key: str, role_key: str, content_key: str, roles: dict[str, str]) -> tuple:
    for media in ("images", "videos"):
        if row.get(media) not in (None, "", [], "[]"):
            raise RowError(f"has {media}: {TEXT_ONLY}")
    return _check_chat(turn_list(row[key], key, role_key, content_key, roles))


def _from_messages(row: dict) -> Sample:
    return Sample("", messages=_messages(row, "messages", "role", "content", {r: r for r in ROLES}))


def _from_sharegpt(row: dict) -> Sample:
    return Sample("", messages=_messages(row, "conversations", "from", "value", _SHAREGPT_ROLES))


def _system(row: dict) -> list[dict[str, str]]:
    system = _text(row.get("system"), "system", required=False)
    return [{"role": "system", "content": system}] if system.strip() else []


def _from_alpaca(row: dict) -> Sample:
    instruction = _text(row["instruction"], "instruction")
    extra = _text(row.get("input"), "input", required=False)
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return Sample("", messages=_check_chat(_system(row) + [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": _text(row["output"], "output")}]))


def _from_query_response(row: dict) -> Sample:
    history = _json_cell(row.get("history"), "history") or []
    if not isinstance(history, list):
        raise RowError(f"history must be a list of [query, response] pairs, got {type(history).__name__}")
    messages = _system(row)
    for i, pair in enumerate(history):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise RowError(f"history[{i}] must be a [query, response] pair")
        messages += [{"role": "user", "content": _text(pair[0], f"history[{i}][0]")},
                     {"role": "assistant", "content": _text(pair[1], f"history[{i}][1]")}]
    messages += [{"role": "user", "content": _text(row["query"], "query")},
                 {"role": "assistant", "content": _text(row["response"], "response")}]
    return Sample("", messages=_check_chat(messages))


def _from_text(row: dict) -> Sample:
    return Sample("", text=_text(row["text"], "text"))


# name shown to the user, the keys that identify the format, the converter.
Format = tuple[str, tuple[str, ...], Callable[[dict], Any]]
FORMATS: list[Format] = [
    ("OpenAI messages", ("messages",), _from_messages),
    ("ShareGPT conversations", ("conversations",), _from_sharegpt),
    ("Alpaca", ("instruction", "output"), _from_alpaca),
    ("query/response", ("query", "response"), _from_query_response),
    ("plain text", ("text",), _from_text),
]


def detect_format(row: Any, formats: list[Format] = FORMATS) -> Format | None:
    """The entry of `formats` whose keys `row` has (the first that fits), or None."""
    if isinstance(row, dict):
        for fmt in formats:
            if all(k in row for k in fmt[1]):
                return fmt
    return None


def _expected(formats: list[Format]) -> str:
    names = ["+".join(keys) for _, keys, _ in formats]
    return ", ".join(names[:-1]) + " or " + names[-1]


def split_spec(spec: str) -> tuple[Path, int | None]:
    """``PATH#N`` -> (PATH, N); a plain path -> (path, None)."""
    path, sep, count = spec.rpartition("#")
    if sep and count.isdigit():
        if int(count) < 1:
            raise SFTError(f"{spec}: the row count after # must be >= 1")
        return Path(path), int(count)
    return Path(spec), None


def read_file(spec: str, seed: int, formats: list[Format] = FORMATS) -> tuple[list[Any], str]:
    """All rows of one data file, each converted by its format in `formats` (Samples, for the
    default table), and the name of the file's format, detected from its first row. ``PATH#N``
    keeps N rows chosen at random (fixed by `seed`), in file order. Each row's ``where`` names
    its file and line."""
    path, count = split_spec(spec)
    if not path.is_file():
        raise SFTError(f"dataset file not found: {path}")
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise SFTError(f"{path}: unknown file type {path.suffix!r}; use .jsonl, .json, .csv or .parquet")
    items: list[Any] = []
    fmt = None
    for where, row in reader(path):
        if fmt is None:
            fmt = detect_format(row, formats)
            if fmt is None:
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise SFTError(f"{path} {where}: unknown data format (keys {keys}); expected {_expected(formats)}")
        name, keys, convert = fmt
        if not isinstance(row, dict):
            raise SFTError(f"{path} {where}: expected an object, got {type(row).__name__}")
        missing = [k for k in keys if k not in row]
        if missing:
            raise SFTError(f"{path} {where}: missing {', '.join(missing)} (the file is {name} format)")
        try:
            item = convert(row)
        except RowError as err:
            raise SFTError(f"{path} {where}: {err}") from None
        items.append(dataclasses.replace(item, where=f"{path} {where}"))
    if not items:
        raise SFTError(f"{path}: no rows")
    if count is not None:
        if count > len(items):
            raise SFTError(f"{spec}: asks for {count} rows but the file has {len(items)}")
        keep = sorted(random.Random(seed).sample(range(len(items)), count))
        items = [items[i] for i in keep]
    return items, fmt[0]


def load_samples(specs: list[str], seed: int, formats: list[Format] = FORMATS) -> list[Any]:
    """The rows of every file in `specs`, in order; logs each file's format and row count."""
    samples = []
    for spec in specs:
        rows, fmt = read_file(spec, seed, formats)
        log.info("data: %s: %d rows, %s", spec, len(rows), fmt)
        samples += rows
    return samples
