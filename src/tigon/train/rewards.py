"""`tigon rlhf --method grpo`'s reward functions: from the user's Python files
(``--reward-funcs rewards.py:fn1,fn2``) and built in (``builtin:exact_answer``, ``builtin:format``,
``builtin:length``), each called as TRL's GRPOTrainer calls one:

    fn(prompts=[...], completions=[...], completion_ids=[...], <the data's other columns>=[...],
       trainer_state=..., log_extra=..., log_metric=...) -> one float (or None) per completion

Everything that can be wrong with them is found before the run writes anything, each as one line
naming the file and function: a missing file or function, an import that raises, a signature that
cannot take that call, and an exception inside or a wrong return value on a trial call with the
first rows of the data. An exception inside during training stops the run with the same kind of
line (the function's name, the exception and its line in the function's file)."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import numbers
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tigon.train.config import SFTError

BUILTIN = "builtin"
DEFAULT = ["builtin:exact_answer,builtin:format"]
ANSWER = "answer"  # the data column builtin:exact_answer compares with
# Keywords TRL passes to every reward function besides the data's columns.
TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


class RewardError(SFTError):
    """A reward function that cannot be loaded, called or trusted: one line for the user."""


@dataclass(frozen=True)
class Reward:
    """One reward function: `fn` takes TRL's call; `name` is what TRL logs it as
    (``rewards/<name>/mean``); `spec` is how --reward-funcs named it."""

    name: str
    spec: str
    fn: Callable[..., list[float | None]]
    needs: tuple[str, ...] = ()  # data columns it reads


def text_of(completion: Any) -> str:
    """A completion's text: the string itself, or the content of a conversational one's messages."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion if isinstance(m, dict))


# --- built-ins ----------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _normal(text: str) -> str:
    return text.strip().rstrip(".").strip().lower()


def _matches(completion: str, answer: Any) -> bool:
    """The completion's last number equals a numeric answer; else its text (stripped of spaces and
    a final period, any case) equals the answer's."""
    answer = str(answer).replace(",", "").strip()
    if _NUMBER.fullmatch(answer.rstrip(".")):
        numbers_seen = _NUMBER.findall(completion.replace(",", ""))
        return bool(numbers_seen) and float(numbers_seen[-1]) == float(answer.rstrip("."))
    return _normal(completion) == _normal(answer)


def exact_answer(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float | None]:
    """1 where the completion gives the row's answer (its last number, for a numeric answer), else
    0; None (unscored) for a row without one."""
    return [None if a is None else float(_matches(text_of(c), a)) for c, a in zip(completions, answer)]


def format_reward(pattern: str) -> Callable[..., list[float]]:
    """1 for a completion matching `pattern` whole, else 0."""
    regex = re.compile(pattern)

    def format(prompts: list, completions: list, **kwargs: Any) -> list[float]:  # noqa: A001 (TRL logs the name)
        return [float(regex.fullmatch(text_of(c)) is not None) for c in completions]

    return format


def length_penalty(max_completion_length: int) -> Callable[..., list[float]]:
    """Minus each completion's share of `max_completion_length` tokens: 0 (empty) to -1 (cut off)."""

    def length(prompts: list, completions: list, completion_ids: list, **kwargs: Any) -> list[float]:
        return [-min(len(ids), max_completion_length) / max_completion_length for ids in completion_ids]

    return length


def _builtins(format_regex: str, max_completion_length: int) -> dict[str, Reward]:
    return {
        "exact_answer": Reward("exact_answer", "builtin:exact_answer", exact_answer, (ANSWER,)),
        "format": Reward("format", "builtin:format", format_reward(format_regex)),
        "length": Reward("length", "builtin:length", length_penalty(max_completion_length)),
    }


def builtin_names() -> list[str]:
    """The NAMEs of ``builtin:NAME``, the reward functions that need no file of the user's."""
    return list(_builtins("", 1))


# --- the user's files ---------------------------------------------------------------------------

def _line_in(err: BaseException, path: Path) -> str:
    """`path line N` of the innermost frame of `err`'s traceback in the file `path` (else of its
    innermost frame)."""
    if isinstance(err, SyntaxError) and err.lineno is not None:
        return f"{path} line {err.lineno}"
    frames = traceback.extract_tb(err.__traceback__)
    inside = [f for f in frames if Path(f.filename).resolve() == path.resolve()]
    frame = (inside or frames or [None])[-1]
    return f"{path} line {frame.lineno}" if frame is not None else str(path)


def _import(path: Path, spec: str) -> Any:
    if not path.is_file():
        raise RewardError(f"--reward-funcs {spec}: no such file: {path}")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(f"tigon_rewards_{digest}", path)
    if module_spec is None or module_spec.loader is None:
        raise RewardError(f"--reward-funcs {spec}: {path} cannot be imported as Python")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # as an import would: dataclasses and pickling look it up
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:  # whatever the user's file raises on import: one line, with its place
        del sys.modules[module_spec.name]
        raise RewardError(f"--reward-funcs {spec}: importing {path} raised {type(err).__name__}: {err} "
                          f"({_line_in(err, path)})") from None
    return module


def _guarded(fn: Callable[..., Any], name: str, path: Path) -> Callable[..., Any]:
    """`fn` whose exceptions become one RewardError naming it, the exception and its line."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # the user's code: any exception, said on one line
            raise RewardError(f"reward function {name} raised {type(err).__name__}: {err} "
                              f"({_line_in(err, path)})") from None

    call.__name__ = name  # what TRL logs it under
    return call


def _from_file(path: Path, names: list[str], spec: str) -> list[Reward]:
    module = _import(path, spec)
    defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
    rewards = []
    for name in names:
        fn = getattr(module, name, None)
        if fn is None:
            raise RewardError(f"--reward-funcs {spec}: {path} defines no function {name!r} (its functions: "
                              f"{', '.join(defined) or 'none'})")
        if not callable(fn):
            raise RewardError(f"--reward-funcs {spec}: {path}: {name} is a {type(fn).__name__}, not a function")
        rewards.append(Reward(name, f"{path}:{name}", _guarded(fn, name, path)))
    return rewards


def _parts(specs: list[str]) -> list[tuple[str, list[str], str]]:
    """(source, function names, the spec as given) per source: a comma-separated item with a colon
    starts a source (``FILE.py:fn`` or ``builtin:name``), one without names another function of
    the source before it."""
    parts: list[tuple[str, list[str], str]] = []
    for spec in specs:
        for item in (i.strip() for i in spec.split(",")):
            if not item:
                continue
            source, sep, name = item.rpartition(":")
            if sep and source and name:
                parts.append((source, [name], spec))
            elif not sep and parts and parts[-1][2] == spec:
                parts[-1][1].append(item)
            else:
                raise RewardError(f"--reward-funcs {spec}: {item!r} is not FILE.py:FUNCTION or builtin:NAME")
    return parts


def load_rewards(specs: list[str] | None, format_regex: str, max_completion_length: int) -> list[Reward]:
    """The reward functions `specs` (--reward-funcs; default :data:`DEFAULT`) name, in order."""
    try:
        re.compile(format_regex)
    except re.error as err:
        raise RewardError(f"--format-regex {format_regex!r}: not a regular expression: {err}") from None
    builtins = _builtins(format_regex, max_completion_length)
    rewards: list[Reward] = []
    for source, names, spec in _parts(specs or DEFAULT):
        if source == BUILTIN:
            for name in names:
                if name not in builtins:
                    raise RewardError(f"--reward-funcs {spec}: no built-in reward {name!r}; choose from "
                                      f"{', '.join(builtins)}")
                rewards.append(builtins[name])
        else:
            rewards += _from_file(Path(source).expanduser(), names, spec)
    seen: dict[str, str] = {}
    for reward in rewards:
        if reward.name in seen:
            raise RewardError(f"--reward-funcs: {seen[reward.name]} and {reward.spec} are both named {reward.name!r} "
                              "(TRL logs each reward by its function's name)")
        seen[reward.name] = reward.spec
    return rewards


# --- a trial call before anything is written ----------------------------------------------------

def _signature_takes(reward: Reward, keywords: list[str]) -> None:
    try:
        signature = inspect.signature(reward.fn)
    except (TypeError, ValueError):
        return  # a builtin or C function: its call will tell
    try:
        signature.bind(**dict.fromkeys(keywords))
    except TypeError as err:
        raise RewardError(f"--reward-funcs {reward.spec}: {reward.name}{signature} cannot take TRL's call "
                          f"{reward.name}(prompts=, completions=, completion_ids=, <columns>=, ...) ({err}); define it "
                          f"as def {reward.name}(prompts, completions, **kwargs)") from None


def check_rewards(rewards: list[Reward], rows: list[dict[str, Any]], completions: list[Any],
                  completion_ids: list[list[int]]) -> None:
    """Call each reward function once as TRL will, on `rows` (prompt and columns) and
    `completions`: a signature that cannot take the call, an exception inside, or anything but one
    number (or None) per completion is a RewardError."""
    columns = sorted({k for row in rows for k in row if k != "prompt"})
    for reward in rewards:
        missing = [c for c in reward.needs if c not in columns]
        if missing:
            raise RewardError(f"--reward-funcs {reward.spec} reads the data's {', '.join(missing)} column, which the "
                              f"data lacks (its columns: {', '.join(columns) or 'none'})")
    kwargs = {c: [row.get(c) for row in rows] for c in columns}
    kwargs.update(trainer_state=None, log_extra=lambda column, values: None, log_metric=lambda name, value: None)
    for reward in rewards:
        _signature_takes(reward, [*TRL_KEYWORDS, *columns])
        out = reward.fn(prompts=[row["prompt"] for row in rows], completions=completions,
                        completion_ids=completion_ids, **kwargs)
        if not isinstance(out, (list, tuple)) or len(out) != len(rows):
            got = f"{len(out)} values" if isinstance(out, (list, tuple)) else type(out).__name__
            raise RewardError(f"reward function {reward.name} returned {got} for {len(rows)} completions; it must "
                              "return a list of one float (or None) per completion")
        bad = [v for v in out if v is not None and not isinstance(v, numbers.Real)]
        if bad:
            raise RewardError(f"reward function {reward.name} returned {bad[0]!r} ({type(bad[0]).__name__}) among its "
                              "rewards; each must be a float (or None for a completion it does not score)")
