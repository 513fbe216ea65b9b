"""The images of a chat request to `tigon serve` on a vision-language model: OpenAI ``image_url``
parts holding a ``data:`` URL (base64 PNG, JPEG or WebP) or a local file (``file://`` or a plain
path) inside the folders the server may read (the model's own, and any --image-root). Every
source is hostile: a remote URL is never fetched, a path is resolved (symlinks followed) before it
is compared with the folders, and an image is bounded in bytes (before it is decoded, for a data:
URL before its base64 is) and in pixels (from its header, before it is decompressed). Each refusal
is an APIError 400 naming the part and the reason."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tigon.serve.protocol import APIError
from tigon.train.vision_data import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, image_ref, open_untrusted


@dataclass(frozen=True)
class ImagePolicy:
    """Where image files may be read from (`roots`, resolved), and the bounds of a request's images."""

    roots: tuple[Path, ...] = ()
    max_images: int = 8
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS

    @classmethod
    def over(cls, folders: list[str | Path], **bounds: int) -> "ImagePolicy":
        return cls(tuple(Path(os.path.realpath(f)) for f in folders), **bounds)


def _inside(path: Path, roots: tuple[Path, ...]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def _local_file(source: str, policy: ImagePolicy) -> Path:
    """The file a path names, resolved, when it lies in one of the policy's folders."""
    raw = source[len("file://"):] if source.startswith("file://") else source
    if not policy.roots:
        raise ValueError("this server reads no image files (start it with --image-root DIR); send the image as a "
                         "data: URL")
    # A relative path is looked up in each folder in turn. realpath follows every symlink on the
    # way: a link inside a folder to a file outside it is outside.
    candidates = [Path(os.path.realpath(Path(raw) if Path(raw).is_absolute() else root / raw))
                  for root in policy.roots]
    # Refused if it leads out of any folder, whether or not a file is there: the answer tells
    # nothing about what exists outside them.
    if not all(_inside(path, policy.roots) for path in candidates):
        raise ValueError("a path outside the folders this server reads images from")
    found = next((path for path in candidates if path.is_file()), None)
    if found is None:
        raise ValueError("no such image file in the folders this server reads images from")
    return found


def request_image(source: str, policy: ImagePolicy) -> Any:
    """The RGB PIL image an ``image_url`` names (a ValueError saying why it cannot be had)."""
    if source.startswith(("http://", "https://")):
        raise ValueError("a remote URL: this server fetches nothing; send the image as a data: URL (base64) or a "
                         "file in its image folder")
    if source.startswith("data:"):
        # base64 holds 3 bytes in 4 characters: a payload too long for the bound is refused undecoded
        if len(source) * 3 // 4 > policy.max_bytes + 3:
            raise ValueError(f"the data: URL holds more than the {policy.max_bytes} image bytes allowed")
        ref = image_ref(source, Path())
    elif ":" in source.split("/", 1)[0] and not source.startswith("file://"):
        raise ValueError(f"the URL scheme {source.split(':', 1)[0]!r} is not taken: a data: URL or a file")
    else:
        ref = _local_file(source, policy)
    return open_untrusted(ref, policy.max_bytes, policy.max_pixels)


def request_images(urls: list[tuple[str, str]], policy: ImagePolicy) -> list[Any]:
    """The images of a request's ``(param, url)`` image parts, in order; the count bounded first."""
    if len(urls) > policy.max_images:
        raise APIError(400, f"this request holds {len(urls)} images; this server takes at most {policy.max_images} "
                            "per request", param="messages", code="too_many_images")
    images = []
    for param, url in urls:
        try:
            images.append(request_image(url, policy))
        except ValueError as err:
            raise APIError(400, f"{param}: {err}", param=param, code="invalid_image") from None
    return images
