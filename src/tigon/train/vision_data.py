"""Image + text training data for `tigon sft` on a vision-language model: the layouts users already
have, read into one kind of example, and every image found, opened and checked before training.

Layouts (detected from each file's first row, as for text data):

* OpenAI messages whose content is a list of parts: ``{"type": "text", "text": ...}``,
  ``{"type": "image_url", "image_url": {"url": ...}}`` or ``{"type": "image", "image": ...}``;
* OpenAI / ms-swift ``messages`` or ShareGPT / LLaMA-Factory ``conversations`` whose text holds
  ``<image>`` placeholders, with the row's ``images`` list, one image per placeholder, in order.

An image is a path (relative to the data file), a ``data:`` URL, bytes (a parquet column of
bytes, or the ``{"bytes": ..., "path": ...}`` structs that Hugging Face datasets write). An
``http(s)`` URL is refused: nothing is fetched.

A video is its frames: a ``{"type": "video", "video": [frame, ...]}`` part (frames as images
are given, or a folder of image files taken in name order; an optional ``"fps"``, the rate the
frames were taken at, 2 when not given), or a ``<video>`` placeholder with the row's ``videos``
list. A video file (``.mp4``) is refused: tigon decodes no video."""

from __future__ import annotations

import base64
import binascii
import io
import logging
import os
import re
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
# Set (by the web UI, for the runs it starts) to a folder: data files' images and frames are then
# read only from inside it, symbolic links followed.
MEDIA_ROOT_ENV = "TIGON_MEDIA_ROOT"
DEFAULT_VIDEO_FPS = 2.0
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


@dataclass(frozen=True)
class VideoRef:
    """A video as its frames in order: as the row gave them (a list, or a folder) until
    `resolve_images`, then files or bytes, then opened images; `fps`, the rate they were taken at."""

    frames: Any
    fps: float = DEFAULT_VIDEO_FPS


@dataclass(frozen=True)
class VisionSample:
    """One chat with images: `messages` in the processors' chat-template form (content a list of
    ``{"type": "text", "text": ...}``, ``{"type": "image"}`` and ``{"type": "video"}`` parts),
    `images` the sources of its image and video parts in their order (raw as the row gave them
    until `resolve_images`; a video's a `VideoRef`), `videos` the number of videos among them."""

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


def _fps(value: Any, what: str) -> float:
    if value is None:
        return DEFAULT_VIDEO_FPS
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise RowError(f"{what} must be a positive number of frames per second, got {value!r}")
    return float(value)


def _parts(content: Any, what: str, sources: list[Any]) -> list[dict[str, Any]]:
    """A message's content as parts, the sources of its image and video parts appended to
    `sources` (a video's as a `VideoRef`)."""
    if isinstance(content, str):
        return _split_placeholders(content)
    if not isinstance(content, list):
        raise RowError(f"{what} must be a string or a list of parts, got {type(content).__name__}")
    parts = []
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
            sources.append(VideoRef(_part_source(part, f"{what}[{j}]"), _fps(part.get("fps"), f"{what}[{j}].fps")))
            parts.append({"type": "video"})
        else:
            raise RowError(f"{what}[{j}] has type {kind!r}; expected text, image_url, image or video")
    return parts


def content_parts(sources: list[Any]) -> Callable[[Any, str], list[dict[str, Any]]]:
    """`turn_list`'s content converter to parts: each message's images and videos appended to
    `sources`."""

    def parts(content: Any, what: str) -> list[dict[str, Any]]:
        return _parts(content, what, sources)

    return parts


def count_parts(messages: Any, kind: str) -> int:
    return sum(p["type"] == kind for m in messages for p in m["content"])


def _listed(row: dict, key: str, single: tuple[type, ...]) -> list[Any]:
    listed = row.get(key)
    if isinstance(listed, str) and listed.lstrip().startswith("["):  # a CSV cell holding a JSON list
        listed = _json_cell(listed, key)
    listed = [] if listed in (None, "") else [listed] if isinstance(listed, single) else listed
    if not isinstance(listed, list):
        raise RowError(f"{key} must be a list of {key}, got {type(listed).__name__}")
    return listed


def listed_media(row: dict) -> tuple[list[Any], list[VideoRef]]:
    """A row's ``images`` list (a single image, or a CSV cell holding a JSON list, made one) and
    its ``videos`` list (each video a list of frames or a folder of them), at the row's ``fps``."""
    videos = _listed(row, "videos", (str,))
    return _listed(row, "images", (str, bytes, dict)), [VideoRef(v, _fps(row.get("fps"), "fps")) for v in videos]


def _mismatch(slots: int, given: int, kind: str, placeholder: str) -> RowError:
    return RowError(f"has {slots} {placeholder} placeholder{'s' if slots != 1 else ''} (or {kind} parts) but "
                    f"{given} {kind}{'s' if given != 1 else ''}: each {kind} needs one, in order")


def matched_images(slots: int, part_sources: list[Any], listed: list[Any]) -> tuple[Any, ...]:
    """The row's images, from its image parts or its images list, one for each of its `slots`
    (placeholders and image parts); a RowError when they do not match."""
    if part_sources and listed:
        raise RowError("has images both in its messages' image parts and in its images list: give one or the other")
    sources = part_sources or listed
    if slots != len(sources):
        raise _mismatch(slots, len(sources), "image", IMAGE_PLACEHOLDER)
    return tuple(sources)


def matched_media(messages: Any, part_sources: list[Any], images: list[Any], videos: list[VideoRef]) -> tuple[Any, ...]:
    """The row's images and videos in the order of its image and video slots (placeholders and
    parts): from the parts' own sources, or from its images and videos lists; a RowError when
    they do not match."""
    slots = [p["type"] for m in messages for p in m["content"] if p["type"] in ("image", "video")]
    part_videos = [s for s in part_sources if isinstance(s, VideoRef)]
    part_images = [s for s in part_sources if not isinstance(s, VideoRef)]
    matched_images(slots.count("image"), part_images, images)
    if part_videos and videos:
        raise RowError("has videos both in its messages' video parts and in its videos list: give one or the other")
    if slots.count("video") != len(part_videos or videos):
        raise _mismatch(slots.count("video"), len(part_videos or videos), "video", VIDEO_PLACEHOLDER)
    queues = {"image": iter(part_images or images), "video": iter(part_videos or videos)}
    return tuple(next(queues[kind]) for kind in slots)


def _chat(row: dict, key: str, role_key: str, content_key: str, roles: dict[str, str]) -> VisionSample:
    part_sources: list[Any] = []
    messages = turn_list(row[key], key, role_key, content_key, roles, content=content_parts(part_sources))
    if not any(m["role"] == "assistant" and _text_of(m).strip() for m in messages):
        raise RowError("no assistant message with content: nothing to learn from")
    sources = matched_media(messages, part_sources, *listed_media(row))
    return VisionSample("", tuple(messages), sources, count_parts(messages, "video"))


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
    if isinstance(source, Path):  # a frame found in a video's folder
        return source
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


def confined(ref: ImageRef, root: str | Path | None = None) -> ImageRef:
    """`ref`, where a file of it lies inside `root` (default: ``$TIGON_MEDIA_ROOT``; no bound when
    neither is set), symbolic links followed; a ValueError where it does not."""
    root = root if root is not None else os.environ.get(MEDIA_ROOT_ENV)
    if isinstance(ref, Path) and root and not Path(os.path.realpath(ref)).is_relative_to(os.path.realpath(root)):
        raise ValueError(f"outside the runs folder ({root})")
    return ref


def _checked_image(source: Any, folder: Path, what: str) -> tuple[ImageRef, tuple[int, int]]:
    """The file or bytes of `source` and its size, opened once to check it decodes; an SFTError
    starting with `what` when it does not (or lies outside `confined`'s folder)."""
    try:
        ref = confined(image_ref(source, folder))
    except ValueError as err:
        raise SFTError(f"{what}: {err}") from None
    if isinstance(ref, Path) and not ref.is_file():
        raise SFTError(f"{what}: no such file ({ref})")
    try:
        return ref, open_image(ref).size
    except Exception as err:  # PIL raises several kinds for a damaged or foreign file
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise SFTError(f"{what}: cannot be read as an image: {reason}") from None


def _name_order(path: Path) -> list[Any]:
    """Sorts frame_2.png before frame_10.png."""
    return [int(piece) if piece.isdigit() else piece for piece in re.split(r"(\d+)", path.name)]


def _frame_sources(video: VideoRef, folder: Path, what: str) -> list[Any]:
    """The frames of `video`: its list, or the image files of its folder in name order; an
    SFTError for a video file or anything else."""
    frames = video.frames
    if isinstance(frames, (list, tuple)):
        if not frames:
            raise SFTError(f"{what}: an empty list of frames")
        return list(frames)
    if not isinstance(frames, str) or frames.startswith(("http://", "https://", "data:")):
        raise SFTError(f"{what}: a video must be a list of frames or a folder of them, got "
                       f"{_shown_source(frames) if isinstance(frames, str) else type(frames).__name__}")
    try:
        path = confined(image_ref(frames, folder))
    except ValueError as err:
        raise SFTError(f"{what} ({_shown_source(frames)}): {err}") from None
    if path.is_dir():
        files = sorted((f for f in path.iterdir() if f.suffix.lower() in FRAME_SUFFIXES and f.is_file()), key=_name_order)
        if not files:
            raise SFTError(f"{what}: the folder {path} holds no frames (files ending {', '.join(FRAME_SUFFIXES)})")
        return files
    if path.is_file():
        raise SFTError(f"{what}: a video file; tigon decodes no video: give its frames, a list of images or a folder "
                       f"of them (e.g. ffmpeg -i {path.name} -r 2 frames/%04d.png)")
    raise SFTError(f"{what}: no such folder of frames ({path})")


def resolve_images(samples: list[VisionSample], spec: str, max_pixels: int | None = None) -> tuple[list[VisionSample], int]:
    """`samples` of the data file `spec` with their images (and videos' frames) as files or
    bytes, each opened once to check it decodes, a video's frames all of one size; an SFTError
    names the file, row and image that is wrong. Also the number of images (and videos) larger
    than `max_pixels`."""
    folder = split_spec(spec)[0].parent
    resolved, large = [], 0
    for sample in samples:
        refs, counts = [], {"image": 0, "video": 0}
        for source in sample.images:
            kind = "video" if isinstance(source, VideoRef) else "image"
            counts[kind] += 1
            what = f"{sample.where}: {kind} {counts[kind]}"
            if kind == "image":
                ref, (width, height) = _checked_image(source, folder, f"{what} ({_shown_source(source)})")
            else:
                checked = [_checked_image(frame, folder, f"{what}, frame {j + 1} ({_shown_source(frame)})")
                           for j, frame in enumerate(_frame_sources(source, folder, what))]
                (width, height), other = checked[0][1], next((c for c in checked if c[1] != checked[0][1]), None)
                if other is not None:
                    raise SFTError(f"{what}: its frames differ in size (frame 1 is {width}x{height}, frame "
                                   f"{checked.index(other) + 1} is {other[1][0]}x{other[1][1]}): a video's frames must "
                                   "be one size")
                ref = VideoRef(tuple(r for r, _ in checked), source.fps)
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
        videos = sum(r.videos for r in rows)
        log.info("data: %s: %d rows, %s, %d images%s", spec, len(rows), fmt, sum(len(r.images) for r in rows) - videos,
                 f", {videos} videos" if videos else "")
        samples += rows
    if large:
        log.info("data: %d images larger than --max-pixels %d: scaled down to it (aspect kept)", large, max_pixels)
    return samples


def check_videos(samples: list[VisionSample], family: str, takes_video: bool, video_families: tuple[str, ...]) -> None:
    """One SFTError for the first row holding a video where `family` takes none, or takes video
    in a way tigon does not lay out (not one of `video_families`)."""
    sample = next((s for s in samples if s.videos), None)
    if sample is None:
        return
    if not takes_video:
        raise SFTError(f"{sample.where}: a video, but {family} models take no video (images only)")
    if family not in video_families:
        raise SFTError(f"{sample.where}: a video: tigon sft trains video (as frames) on {', '.join(video_families)} "
                       f"models; for {family}, give the video's frames as images")
