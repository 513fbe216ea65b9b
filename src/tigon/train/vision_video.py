"""Videos given as frames, for the Qwen-VL families: each clip's pixels and (t, h, w) grid laid out
as Qwen-VL's video processor lays them out, made by the model's own image processor (so frames are
sized and normalised exactly as its images are, and neither a video decoder nor torchvision is
needed), and the chat text's video placeholders expanded to the clip's tokens.

Qwen-VL's vision tower embeds patches of `temporal_patch_size` (2) consecutive frames. Its image
processor gives an image that temporal depth by repeating it, so an image's patches are a
one-frame clip's: a clip is the patches of its frames, their temporal slots taken from
consecutive frames (the last frame repeated to fill the last slot)."""

from __future__ import annotations

import re
from typing import Any

import torch

from tigon.train.vision_data import VideoRef

# How each family's text stands for a clip (by model type). "tokens": the video token once per
# merged patch of the whole clip. "timestamps": per temporal patch, "<t seconds>" and the patch's
# tokens between their own vision start and end (Qwen3-VL), in place of the template's one pair.
VIDEO_LAYOUTS = {"qwen2_vl": "tokens", "qwen2_5_vl": "tokens", "qwen3_vl": "timestamps", "qwen3_vl_moe": "timestamps"}
# The families whose rotary positions space a clip's temporal patches by seconds, read from
# `second_per_grid_ts` (Qwen2.5-VL).
SECONDS_PER_GRID = ("qwen2_5_vl",)


def clip_pixels(image_processor: Any, frames: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The flattened patches (one row per patch, as ``pixel_values_videos`` holds them) and the
    ``(t, h, w)`` grid of the clip `frames` (opened images of one size)."""
    out = image_processor(images=list(frames), return_tensors="pt")
    pixels, grids = out["pixel_values"], out["image_grid_thw"]
    if not bool((grids == grids[0]).all()):
        raise ValueError("a video's frames must be one size")
    depth, patch = image_processor.temporal_patch_size, image_processor.patch_size
    _, height, width = (int(n) for n in grids[0])
    channels = pixels.shape[1] // (depth * patch * patch)
    # (frames, patches, channels, temporal slot, patch, patch): an image's slots are all its frame.
    per_frame = pixels.view(len(frames), height * width, channels, depth, patch, patch)[:, :, :, 0]
    short = -len(frames) % depth
    if short:
        per_frame = torch.cat([per_frame, per_frame[-1:].expand(short, *per_frame.shape[1:])])
    steps = per_frame.shape[0] // depth
    clip = per_frame.view(steps, depth, height * width, channels, patch, patch).permute(0, 2, 3, 1, 4, 5)
    return clip.reshape(steps * height * width, channels * depth * patch * patch), torch.tensor([steps, height, width])


def frame_times(frames: int, fps: float, depth: int) -> list[float]:
    """The time of each temporal patch of a clip of `frames` taken at `fps`: the mean of its first
    and last frame's (the last frame repeated to fill the last patch)."""
    indices = list(range(frames)) + [frames - 1] * (-frames % depth)
    return [(indices[i] + indices[i + depth - 1]) / 2 / fps for i in range(0, len(indices), depth)]


def video_inputs(processor: Any, family: str, texts: list[str], media: list[list[Any]]) -> Any:
    """The model's batch of `texts` (rendered chats, right-padded) with their `media` (per text,
    opened images and `VideoRef` clips of opened frames, in the order of their placeholders): what
    the processor gives for images, with the clips' ``pixel_values_videos`` and ``video_grid_thw``
    (and ``second_per_grid_ts`` where the family reads it) beside them."""
    from transformers import BatchFeature

    layout = VIDEO_LAYOUTS[family]
    ip, tokenizer = processor.image_processor, processor.tokenizer
    merge = ip.merge_size ** 2
    images = [m for row in media for m in row if not isinstance(m, VideoRef)]
    clips = [m for row in media for m in row if isinstance(m, VideoRef)]
    features: dict[str, Any] = {}
    image_tokens: list[str] = []
    if images:
        out = ip(images=images, return_tensors="pt")
        features.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
        image_tokens = [processor.image_token * (int(grid.prod()) // merge) for grid in out["image_grid_thw"]]
    pixels, grids = zip(*(clip_pixels(ip, clip.frames) for clip in clips))
    features.update(pixel_values_videos=torch.cat(pixels), video_grid_thw=torch.stack(grids))
    if family in SECONDS_PER_GRID:
        features["second_per_grid_ts"] = torch.tensor([ip.temporal_patch_size / clip.fps for clip in clips])
    video_tokens = []
    for clip, (steps, height, width) in zip(clips, (g.tolist() for g in grids)):
        per_step = processor.video_token * (height * width // merge)
        if layout == "tokens":
            video_tokens.append(per_step * steps)
        else:
            video_tokens.append("".join(f"<{t:.1f} seconds>{processor.vision_start_token}{per_step}"
                                        f"{processor.vision_end_token}" for t in
                                        frame_times(len(clip.frames), clip.fps, ip.temporal_patch_size)))
    video_mark = (re.escape(processor.vision_start_token + processor.video_token + processor.vision_end_token)
                  if layout == "timestamps" else re.escape(processor.video_token))
    pattern = re.compile(f"{re.escape(processor.image_token)}|{video_mark}")
    queues = {True: iter(image_tokens), False: iter(video_tokens)}
    expanded = [pattern.sub(lambda hit: next(queues[hit.group(0) == processor.image_token]), text) for text in texts]
    batch = dict(tokenizer(expanded, padding=True, return_tensors="pt"))
    if "mm_token_type_ids" in processor.model_input_names:  # which tokens are an image's (1), a video's (2)
        ids = batch["input_ids"]
        batch["mm_token_type_ids"] = ((ids == processor.image_token_id).long()
                                      + 2 * (ids == processor.video_token_id).long())
    return BatchFeature({**batch, **features})
