"""Samples to tokens: render chats with the tokenizer's chat template (or a plain default), and
label only the assistant turns so the loss is computed on what the model should learn to say."""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

from tigon.train.config import SFTError
from tigon.train.data import Sample

log = logging.getLogger("tigon.train")

IGNORE = -100  # the label value Hugging Face losses skip

# For tokenizers that ship without a chat template: plain-text headers, so no new tokens (and no
# untrained embeddings) are needed; each assistant turn ends with EOS so generation learns to stop.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}### Assistant:\n{{ m['content'] }}{{ eos_token }}\n\n"
    "{% else %}### {{ m['role'] | capitalize }}:\n{{ m['content'] }}\n\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}### Assistant:\n{% endif %}"
)


def ensure_chat_template(tokenizer: Any) -> None:
    """Give `tokenizer` the default chat template (and a pad token) if it has none."""
    if not getattr(tokenizer, "chat_template", None):
        log.info("tokenizer has no chat template: using tigon's plain '### Role:' template")
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def render(tokenizer: Any, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
    """The chat as text, as the model sees it."""
    return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


# How many of an assistant turn's last characters locate its end in a chat whose template renders it
# otherwise once later turns follow (it ends the same, before the same end-of-turn marker).
_TAIL = 8


def _rewritten_span(
    full: str, history: str, before: str, through: str, content: str, cursor: int
) -> tuple[int, int] | None:
    """The span of an assistant turn that the template renders otherwise in the whole chat than as
    its last turn (Qwen3 drops the reasoning of the turns before the last user message and gives the
    last one an empty ``<think>`` block; DeepSeek-R1's drops every turn's reasoning and opens its
    generation prompt with ``<think>``): from where the whole chat and the chat before the turn with a
    generation prompt part, through the turn's end-of-turn marker, which follows the content's last
    characters as in the turn rendered last. None unless the chat before the turn (`history`)
    renders as it does in the whole chat."""
    tail = content.rstrip().rsplit("\n", 1)[-1][-_TAIL:]  # (its last line: reasoning may be dropped before it)
    if not full.startswith(history) or len(history) < cursor or not tail:
        return None
    start = len(os.path.commonprefix([full, before]))
    at = through.rfind(tail)
    closing = through[at + len(tail):] if at >= len(history) else ""
    hit = full.find(tail + closing, start)
    return None if hit < 0 else (start, hit + len(tail) + len(closing))


def assistant_spans(tokenizer: Any, sample: Sample) -> tuple[str, list[tuple[int, int]]]:
    """The rendered chat and the character spans of its assistant turns (with their end-of-turn
    markers). A turn's span runs from the end of the chat rendered up to it with a generation
    prompt to the end of the chat rendered through it. Templates that render a turn otherwise once
    later turns follow break that prefix property: then the span ends after the turn's last
    characters and the end-of-turn marker that follows them (:func:`_rewritten_span`); for templates
    that rewrite the turns before it too, the span is found by searching for the turn's content."""
    messages = sample.messages
    try:
        full = render(tokenizer, messages, False)
        spans, cursor = [], 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = render(tokenizer, messages[:i], True)
            through = render(tokenizer, messages[: i + 1], False)
            if full.startswith(through) and through.startswith(before) and len(before) >= cursor:
                span = (len(before), len(through))
            else:
                history = render(tokenizer, messages[:i], False)
                span = _rewritten_span(full, history, before, through, message["content"], cursor)
            if span is None:
                start = full.find(message["content"], cursor)
                if start < 0:
                    raise SFTError(f"{sample.where}: the chat template drops assistant turn {i}, so it "
                                   "cannot be trained on")
                span = (start, start + len(message["content"]))
            spans.append(span)
            cursor = span[1]
    except SFTError:
        raise
    except Exception as err:  # a template raises whatever its author chose: report it on one line
        raise SFTError(f"{sample.where}: the chat template failed: {type(err).__name__}: {err}") from None
    return full, spans


def encode(tokenizer: Any, sample: Sample, max_length: int) -> dict[str, list[int]] | None:
    """``input_ids`` and ``labels`` (IGNORE outside the trained spans), truncated to `max_length`;
    None when truncation leaves nothing to learn from."""
    if sample.text is not None:
        ids = tokenizer(sample.text, add_special_tokens=True)["input_ids"]
        if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
            ids = ids + [tokenizer.eos_token_id]
        labels = list(ids)
    else:
        text, spans = assistant_spans(tokenizer, sample)
        # The template writes BOS itself where the model wants one.
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        # Any overlap counts: a byte-level token such as "Ġword" starts on the space before the turn.
        labels = [tok if any(start < b and end > a for a, b in spans) else IGNORE
                  for tok, (start, end) in zip(ids, enc["offset_mapping"])]
    ids, labels = ids[:max_length], labels[:max_length]
    if labels:
        labels[0] = IGNORE  # nothing precedes it; in a packed row it must not be predicted from the previous sample
    if all(label == IGNORE for label in labels):
        return None
    return {"input_ids": ids, "labels": labels}


def encode_all(tokenizer: Any, samples: list[Sample], max_length: int, what: str) -> list[dict[str, list[int]]]:
    """Encode every sample; samples left with no trained token are dropped with a count."""
    if not getattr(tokenizer, "is_fast", False):
        raise SFTError("tigon sft needs a fast (Rust) tokenizer to find the assistant tokens; "
                       f"{type(tokenizer).__name__} is not one")
    encoded = [encode(tokenizer, s, max_length) for s in samples]
    kept = [e for e in encoded if e is not None]
    if len(kept) < len(encoded):
        log.warning("%s: %d of %d samples have no assistant tokens within --max-length %d: dropped",
                    what, len(encoded) - len(kept), len(encoded), max_length)
    if not kept:
        raise SFTError(f"{what}: no sample has a trainable token within --max-length {max_length}")
    return kept
