"""Image + text training data for `tigon sft` on a vision-language model: the layouts users already
have, read into one kind of example, and every image found, opened and checked before training.

Layouts (detected from each file's first row, as for text data):

* OpenAI messages whose content is a list of parts: ``{"type": "text", "text": ...}``,
  ``{"type": "image_url", "image_url": {"url": ...}}`` or ``{"type": "image", "image": ...}``;
* OpenAI / ms-swift ``messages`` or ShareGPT / LLaMA-Factory ``conversations`` whose text holds
  ``<image>`` placeholders, with the row's ``images`` list, one image per placeholder, in order.

An image is a path (relative to the data file), a ``data:`` URL, bytes (a parquet column of
bytes, or the ``{"bytes": ..., "path": ...}`` structs that Hugging Face datasets write). An
``http(s)`` URL is refused: nothing is fetched."""

from __future__ import annotations

import base64
import binascii
import io
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from tigon.train.config import SFTError
from tigon.train.data import _SHAREGPT_ROLES, ROLES, RowError, _json_cell, read_file, split_spec, turn_list

log = logging.getLogger("tigon.train")

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
_IMAGE_PARTS = ("image", "image_url")
_VIDEO_PARTS = ("video", "video_url")

ImageRef = Path | bytes  # a file, or the encoded bytes of one


@dataclass(frozen=True)
class VisionSample:
    """One chat with images: `messages` in the processors' chat-template form (content a list of
    ``{"type": "text", "text": ...}`` and ``{"type": "image"}`` parts), `images` the sources of its
    image parts in order (raw as the row gave them until `resolve_images`), `videos` the number of
    videos the row carries (refused by `check_videos`)."""

    where: str
    messages: tuple[dict[str, Any], ...]
    images: tuple[Any, ...] = ()
    videos: int = 0


def _split_placeholders(text: str) -> list[dict[str, Any]]:
    """`text` as parts: its text between ``<image>`` / ``<video>`` placeholders, and the placeholders."""
    parts: list[dict[str, Any]] = []
    rest = text
    while rest:
        hits = [(rest.find(mark), kind) for mark, kind in ((IMAGE_PLACEHOLDER, "image"), (VIDEO_PLACEHOLDER, "video"))]
        hits = [(at, kind) for at, kind in hits if at >= 0]
        if not hits:
            parts.append({"type": "text", "text": rest})
            break
        at, kind = min(hits)
        if at:
            parts.append({"type": "text", "text": rest[:at]})
        parts.append({"type": kind})
        rest = rest[at + len(IMAGE_PLACEHOLDER if kind == "image" else VIDEO_PLACEHOLDER):]
    return parts


def _part_source(part: dict[str, Any], what: str) -> Any:
    """Where an OpenAI image part's image is: ``image_url.url`` (or ``image_url`` as a string),
    ``image`` (a path, URL, bytes or a bytes/path struct), or ``url`` / ``path``."""
    for key in ("image_url", "image", "video_url", "video", "url", "path"):
        value = part.get(key)
        if isinstance(value, dict) and "url" in value:
            value = value["url"]
        if value is not None:
            return value
    raise RowError(f"{what} is an {part.get('type')} part without its image (image_url.url, image or path)")


def _parts(content: Any, what: str, sources: list[Any]) -> tuple[list[dict[str, Any]], int]:
    """A message's content as parts, the images of its image parts appended to `sources`, and the
    number of videos it holds."""
    if isinstance(content, str):
        return _split_placeholders(content), 0
    if not isinstance(content, list):
        raise RowError(f"{what} must be a string or a list of parts, got {type(content).__name__}")
    parts, videos = [], 0
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise RowError(f"{what}[{j}].text must be a string")
            parts += _split_placeholders(text)
        elif kind in _IMAGE_PARTS:
            sources.append(_part_source(part, f"{what}[{j}]"))
            parts.append({"type": "image"})
        elif kind in _VIDEO_PARTS:
            videos += 1
            parts.append({"type": "video"})
        else:
            raise RowError(f"{what}[{j}] has type {kind!r}; expected text, image_url, image or video")
    return parts, videos


def content_parts(sources: list[Any]) -> Callable[[Any, str], list[dict[str, Any]]]:
    """`turn_list`'s content converter to parts: each message's images appended to `sources`; a
    video is a ``{"type": "video"}`` part (counted by `count_parts`)."""

    def parts(content: Any, what: str) -> list[dict[str, Any]]:
        return _parts(content, what, sources)[0]

    return parts


def count_parts(messages: Any, kind: str) -> int:
    return sum(p["type"] == kind for m in messages for p in m["content"])


def listed_media(row: dict) -> tuple[list[Any], int]:
    """A row's ``images`` list (a single image, or a CSV cell holding a JSON list, made one) and
    the number of videos its ``videos`` list holds."""
    listed = row.get("images")
    if isinstance(listed, str) and listed.lstrip().startswith("["):  # a CSV cell holding a JSON list
        listed = _json_cell(listed, "images")
    listed = [] if listed in (None, "") else [listed] if isinstance(listed, (str, bytes, dict)) else listed
    if not isinstance(listed, list):
        raise RowError(f"images must be a list of images, got {type(listed).__name__}")
    return listed, len(_json_cell(row.get("videos"), "videos") or [])


def matched_images(slots: int, part_sources: list[Any], listed: list[Any]) -> tuple[Any, ...]:
    """The row's images, from its image parts or its images list, one for each of its `slots`
    (placeholders and image parts); a RowError when they do not match."""
    if part_sources and listed:
        raise RowError("has images both in its messages' image parts and in its images list: give one or the other")
    sources = part_sources or listed
    if slots != len(sources):
        raise RowError(f"has {slots} {IMAGE_PLACEHOLDER} placeholder{'s' if slots != 1 else ''} (or image parts) but "
                       f"{len(sources)} image{'s' if len(sources) != 1 else ''}: each image needs one, in order")
    return tuple(sources)


def _chat(row: dict, key: str, role_key: str, content_key: str, roles: dict[str, str]) -> VisionSample:
    part_sources: list[Any] = []
    messages = turn_list(row[key], key, role_key, content_key, roles, content=content_parts(part_sources))
    if not any(m["role"] == "assistant" and _text_of(m).strip() for m in messages):
        raise RowError("no assistant message with content: nothing to learn from")
    listed, videos = listed_media(row)
    sources = matched_images(count_parts(messages, "image"), part_sources, listed)
    return VisionSample("", tuple(messages), sources, videos + count_parts(messages, "video"))


def _text_of(message: dict[str, Any]) -> str:
    return "".join(p.get("text", "") for p in message["content"] if p["type"] == "text")


def _from_messages(row: dict) -> VisionSample:
    return _chat(row, "messages", "role", "content", {r: r for r in ROLES})


def _from_sharegpt(row: dict) -> VisionSample:
    return _chat(row, "conversations", "from", "value", _SHAREGPT_ROLES)


VISION_FORMATS: list[tuple[str, tuple[str, ...], Callable[[dict], Any]]] = [
    ("messages with images", ("messages",), _from_messages),
    ("ShareGPT conversations with images", ("conversations",), _from_sharegpt),
]


def _decode_data_url(url: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or ";base64" not in header:
        raise ValueError("a data: URL of an image must be base64 (data:image/png;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("its base64 payload is not valid") from None


def _shown_source(source: Any) -> str:
    if isinstance(source, (bytes, bytearray)):
        return f"<{len(source)} bytes>"
    text = str(source)
    return text[:60] + "…" if len(text) > 60 else text


def image_ref(source: Any, folder: Path) -> ImageRef:
    """The file or bytes a row's image `source` names (paths relative to `folder`, the data file's);
    ValueError for what cannot be one (a remote URL, which is never fetched)."""
    if isinstance(source, dict):  # Hugging Face datasets' Image struct: bytes, or a path
        source = source.get("bytes") or source.get("path") or source.get("url")
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"an image must be a path, a data: URL or bytes, got {type(source).__name__}")
    if source.startswith(("http://", "https://")):
        raise ValueError("a remote URL: tigon fetches nothing; download the image and give its path")
    if source.startswith("data:"):
        return _decode_data_url(source)
    path = Path(source[len("file://"):] if source.startswith("file://") else source).expanduser()
    return path if path.is_absolute() else folder / path


def open_image(ref: ImageRef) -> Any:
    """`ref` decoded as an RGB PIL image (OSError or PIL's errors when it cannot be)."""
    from PIL import Image

    with Image.open(io.BytesIO(ref) if isinstance(ref, bytes) else ref) as image:
        image.load()
        return image.convert("RGB")


# What an image from a network client may be: the formats decoded (Pillow tries no other plugin
# on such bytes), and the defaults of its bounds.
UNTRUSTED_FORMATS = ("PNG", "JPEG", "WEBP")
MAX_IMAGE_BYTES = 16 << 20
MAX_IMAGE_PIXELS = 4096 * 4096


def open_untrusted(ref: ImageRef, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """`ref` (bytes, or a file the caller has checked it may read) decoded as an RGB PIL image,
    when it is a PNG, JPEG or WebP of at most `max_bytes` bytes and `max_pixels` pixels; else a
    ValueError naming what is wrong. The pixel count is read from the header, before anything is
    decompressed: a small file that would decode to gigabytes (a decompression bomb) is refused
    unread."""
    from PIL import Image

    size = len(ref) if isinstance(ref, bytes) else ref.stat().st_size
    if size > max_bytes:
        raise ValueError(f"the image is {size} bytes, more than the {max_bytes} allowed")
    try:
        with Image.open(io.BytesIO(ref) if isinstance(ref, bytes) else ref, formats=UNTRUSTED_FORMATS) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise ValueError(f"the image is {width}x{height} pixels, more than the {max_pixels} allowed")
            image.load()
            return image.convert("RGB")
    except ValueError:
        raise
    except Image.DecompressionBombError as err:  # Pillow's own bound, where it is below ours
        raise ValueError(f"the image is too large to decode: {err}") from None
    except Exception as err:  # PIL raises several kinds for damaged or foreign bytes
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"not a readable PNG, JPEG or WebP image ({reason})") from None


def bounded(image: Any, max_pixels: int | None, image_size: int | None) -> Any:
    """`image` scaled down (aspect kept) to at most `max_pixels` pixels and `image_size` on its
    longer side; as it is when within both."""
    width, height = image.size
    scale = 1.0
    if max_pixels and width * height > max_pixels:
        scale = (max_pixels / (width * height)) ** 0.5
    if image_size and max(width, height) * scale > image_size:
        scale = image_size / max(width, height)
    if scale >= 1.0:
        return image
    return image.resize((max(1, int(width * scale)), max(1, int(height * scale))))


def resolve_images(samples: list[VisionSample], spec: str, max_pixels: int | None = None) -> tuple[list[VisionSample], int]:
    """`samples` of the data file `spec` with their images as files or bytes, each opened once to
    check it decodes; an SFTError names the file, row and image that does not. Also the number of
    images larger than `max_pixels`."""
    folder = split_spec(spec)[0].parent
    resolved, large = [], 0
    for sample in samples:
        refs = []
        for k, source in enumerate(sample.images):
            what = f"{sample.where}: image {k + 1} ({_shown_source(source)})"
            try:
                ref = image_ref(source, folder)
            except ValueError as err:
                raise SFTError(f"{what}: {err}") from None
            if isinstance(ref, Path) and not ref.is_file():
                raise SFTError(f"{what}: no such file ({ref})")
            try:
                width, height = open_image(ref).size
            except Exception as err:  # PIL raises several kinds for a damaged or foreign file
                reason = str(err).splitlines()[0] if str(err) else type(err).__name__
                raise SFTError(f"{what}: cannot be read as an image: {reason}") from None
            large += bool(max_pixels and width * height > max_pixels)
            refs.append(ref)
        resolved.append(replace(sample, images=tuple(refs)))
    return resolved, large


def load_vision_samples(specs: list[str], seed: int, max_pixels: int | None = None) -> list[VisionSample]:
    """The rows of every file in `specs` as VisionSamples, their images found and checked; logs
    each file's layout and row count, and once how many images --max-pixels will scale down."""
    samples, large = [], 0
    for spec in specs:
        rows, fmt = read_file(spec, seed, VISION_FORMATS)
        rows, n_large = resolve_images(rows, spec, max_pixels)
        large += n_large
        log.info("data: %s: %d rows, %s, %d images", spec, len(rows), fmt, sum(len(r.images) for r in rows))
        samples += rows
    if large:
        log.info("data: %d images larger than --max-pixels %d: scaled down to it (aspect kept)", large, max_pixels)
    return samples


def check_videos(samples: list[VisionSample], family: str, takes_video: bool) -> None:
    """One SFTError for the first row holding a video: `family` takes none, or (for a family that
    does) tigon sft trains on images only for now."""
    for sample in samples:
        if sample.videos:
            if not takes_video:
                raise SFTError(f"{sample.where}: a video, but {family} models take no video (images only)")
            raise SFTError(f"{sample.where}: a video: tigon sft trains {family} on images only for now; give the "
                           "video's frames as images")

