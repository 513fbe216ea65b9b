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
        try:
            samples, fmt = read_file(specs[0], seed)
        except ValueError as err:
            vision = _vision_preview(specs[0], seed, len(specs))
            if vision is None:
                raise
            return vision
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


def _vision_preview(spec: str, seed: int, files: int) -> Preview | None:
    """The preview of a file of image + text rows: its first chat, images as ``<image>``, the
    assistant turns marked; None when it holds no such rows."""
    from tigon.train.data import read_file
    from tigon.train.vision_data import VISION_FORMATS

    try:
        samples, fmt = read_file(spec, seed, VISION_FORMATS)
    except ValueError:
        return None
    if not any(s.images for s in samples):
        return None
    parts = [(f"{m['role']}: " + "".join(p.get("text", "<image>") if p["type"] != "video" else "<video>"
                                         for p in m["content"]) + "\n", "trained" if m["role"] == "assistant" else None)
             for m in samples[0].messages]
    more = f" (and {files - 1} more file(s), read when the run starts)" if files > 1 else ""
    return Preview(f"{spec}: {fmt}, {len(samples)} rows, {sum(len(s.images) for s in samples)} images{more}; "
                   "train with --modality vision on a vision-language model; the loss covers the highlighted turns",
                   parts)


THUMBNAILS = 8  # images of the first rows shown with the preview
THUMBNAIL_SIDE = 128  # pixels, the longer side


def preview_images(dataset: str, root: Path, seed: int = 42) -> tuple[list[tuple[Any, str]], str]:
    """Thumbnails of the first images of an image + text data file (`tigon sft --modality vision`'s
    layouts), each captioned with its row, and a line saying what was shown or left out; none
    for a text-only file. An image file is read only inside `root` (the runs folder), each bounded
    in bytes and pixels before it is decoded."""
    from tigon.train.data import read_file, split_spec
    from tigon.train.vision_data import VISION_FORMATS, VideoRef, confined, image_ref, open_untrusted

    try:
        if split_spec(dataset)[0].stat().st_size > PREVIEW_MAX_BYTES:
            return [], ""
        samples, _ = read_file(dataset, seed, VISION_FORMATS)
    except (ValueError, OSError):  # not image + text rows: the text preview says what it is
        return [], ""
    folder = split_spec(dataset)[0].parent
    shown: list[tuple[Any, str]] = []
    skipped: list[str] = []
    total = sum(len(s.images) - s.videos for s in samples)
    videos = sum(s.videos for s in samples)
    for sample in samples:
        for k, source in enumerate(s for s in sample.images if not isinstance(s, VideoRef)):
            if len(shown) + len(skipped) == THUMBNAILS:
                break
            row = sample.where.rsplit(" ", 2)[-2:]
            caption = f"{' '.join(row)}, image {k + 1}"
            try:
                image = open_untrusted(confined(image_ref(source, folder), root))
            except (ValueError, OSError) as err:
                skipped.append(f"{caption}: {str(err).splitlines()[0]}")
                continue
            image.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE))
            shown.append((image, caption))
    line = (f"{total} images in {len(samples)} rows; the first {len(shown)} shown"
            + (f"; {videos} videos (frames), not shown" if videos else ""))
    return shown, line + "".join(f"; {s}" for s in skipped)


class ChatModel:
    """One model loaded for chatting, as `tigon chat` loads it (a LoRA adapter on its base; a
    vision-language model with its processor), kept until another is asked for: the UI process
    holds one model at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded: tuple[str, Any, Any, bool] | None = None

    def _load(self, path: str) -> tuple[Any, Any, bool]:
        """(model, its tokenizer or, for a vision-language model, its VisionEncoder, whether it is one)."""
        from tigon.train import load_for_inference
        from tigon.train.modeling import pick_dtype
        from tigon.train.vision import load_vision_for_inference, vision_config_of

        if self._loaded is None or self._loaded[0] != path:
            self._loaded = None  # let the old one go before the new one takes memory
            if not Path(path).is_dir():
                raise ValueError(f"no model directory {path!r}: pick a finished run or a checkpoint")
            vision = vision_config_of(path) is not None
            model, text = (load_vision_for_inference(path, pick_dtype("auto"), what="the chat") if vision
                           else load_for_inference(path, pick_dtype("auto")))
            self._loaded = (path, model, text, vision)
        return self._loaded[1:]

    def reply(self, path: str, messages: list[dict[str, Any]], max_new_tokens: int, temperature: float,
              images: list[bytes] = ()) -> str:
        """The model's answer to `messages` (role/content dicts, a user message's ``images`` the
        number of `images`, in order, shown with it), greedy at temperature 0. Images for a
        text-only model are a ValueError."""
        from tigon.train import generate
        from tigon.train.vision import VisionPrompt, user_turn, vision_generate

        with self._lock:  # one generation at a time: the model is not shared between threads
            model, text, vision = self._load(path)
            if not vision:
                if images:
                    raise ValueError(f"{path} is a text-only model: it takes no images")
                return generate(model, text, [{"role": m["role"], "content": m["content"]} for m in messages],
                                max_new_tokens, temperature)
            chat = [user_turn(m["content"], m.get("images", 0)) if m["role"] == "user" else
                    {"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages]
            return vision_generate(model, text, VisionPrompt(tuple(chat), tuple(images), ""), max_new_tokens,
                                   temperature)

    def unload(self) -> None:
        with self._lock:
            self._loaded = None
