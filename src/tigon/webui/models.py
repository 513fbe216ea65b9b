"""The UI's in-process uses of tigon.train: the data preview (tigon sft's own reader, format
detection, chat template and label spans) and the chat (the loading and generation code of
`tigon chat`). Training never runs here: that is the command line's, in its own process."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREVIEW_TOKENIZER_ROWS = 200  # the built-in tokenizer is trained on the data; its template is fixed
# The preview reads a file whole, into the UI's own memory: a larger one is left to the run.
PREVIEW_MAX_BYTES = 256 * 2**20


@dataclass
class Preview:
    """What the Train tab shows about a dataset: a one-line summary (or the reader's error) and
    the first sample as the model sees it, split into (text, "trained" or None) parts."""

    summary: str
    parts: list[tuple[str, str | None]]
    error: bool = False


def _tokenizer(model: str, samples: list[Any]) -> Any:
    from tigon.train import tiny
    from tigon.train.modeling import load_tokenizer
    from tigon.train.template import ensure_chat_template

    tokenizer = load_tokenizer(model) if model else tiny.build_tokenizer(samples[:PREVIEW_TOKENIZER_ROWS])
    ensure_chat_template(tokenizer)
    return tokenizer


def preview_dataset(datasets: list[str], model: str = "", seed: int = 42) -> Preview:
    """Read the first of the files `datasets` (none: the bundled instructions) as `tigon sft`
    would and render its first sample with the chat template of `model` (empty: the built-in
    model's), marking the tokens the loss is computed on. An error is the one line `tigon sft`
    would print. The caller has checked that the UI may read these files and this model."""
    from tigon.train import tiny
    from tigon.train.data import read_file, split_spec
    from tigon.train.template import assistant_spans

    specs = datasets or [str(tiny.BUNDLED_DATASET)]
    try:
        size = split_spec(specs[0])[0].stat().st_size
        if size > PREVIEW_MAX_BYTES:
            return Preview(f"{specs[0]}: {size / 2**20:,.0f} MiB, more than the preview reads "
                           f"({PREVIEW_MAX_BYTES // 2**20} MiB): the run reads it when it starts", [])
        samples, fmt = read_file(specs[0], seed)
        sample = samples[0]
        summary = f"{specs[0]}: {fmt}, {len(samples)} rows"
        if len(specs) > 1:
            summary += f" (and {len(specs) - 1} more file(s), read when the run starts)"
        if sample.text is not None:
            return Preview(summary + "; plain text: the loss covers every token", [(sample.text, "trained")])
        text, spans = assistant_spans(_tokenizer(model.strip(), samples), sample)
    except (ValueError, OSError) as err:
        return Preview(str(err), [], error=True)
    parts, cursor = [], 0
    for start, end in spans:
        parts += [(text[cursor:start], None), (text[start:end], "trained")]
        cursor = end
    parts.append((text[cursor:], None))
    return Preview(summary + "; rendered with the chat template, the loss covers the highlighted turns",
                   [p for p in parts if p[0]])


class ChatModel:
    """One model loaded for chatting, as `tigon chat` loads it (a LoRA adapter on its base),
    kept until another is asked for: the UI process holds one model at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded: tuple[str, Any, Any] | None = None

    def _load(self, path: str) -> tuple[Any, Any]:
        from tigon.train import load_for_inference
        from tigon.train.modeling import pick_dtype

        if self._loaded is None or self._loaded[0] != path:
            self._loaded = None  # let the old one go before the new one takes memory
            if not Path(path).is_dir():
                raise ValueError(f"no model directory {path!r}: pick a finished run or a checkpoint")
            model, tokenizer = load_for_inference(path, pick_dtype("auto"))
            self._loaded = (path, model, tokenizer)
        return self._loaded[1], self._loaded[2]

    def reply(self, path: str, messages: list[dict[str, str]], max_new_tokens: int, temperature: float) -> str:
        """The model's answer to `messages` (role/content dicts), greedy at temperature 0."""
        from tigon.train import generate

        with self._lock:  # one generation at a time: the model is not shared between threads
            model, tokenizer = self._load(path)
            return generate(model, tokenizer, messages, max_new_tokens, temperature)

    def unload(self) -> None:
        with self._lock:
            self._loaded = None
