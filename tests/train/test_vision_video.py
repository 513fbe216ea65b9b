"""Videos given as frames (`tigon.train.vision_video`): a clip's patches are its frames' patches
(as the model's image processor makes them) two frames to a temporal patch, the timestamps Qwen3-VL
writes between its frames, a Qwen3-VL forward on such a batch, and (where torchvision is installed:
on the GPU machine) the whole batch against transformers' own video processor."""

import io

import pytest
import torch

from tigon.train import tiny_vlm
from tigon.train.config import SFTError
from tigon.train.batching import pack
from tigon.train.vision import VisionCollator, VisionEncoder, image_only, pack_positions
from tigon.train.vision_data import VideoRef, VisionSample, check_videos
from tigon.train.vision_video import VIDEO_LAYOUTS, clip_pixels, frame_times

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

SIDE = 56  # pixels: 4 x 4 patches of 14, merged 2 x 2 into 4 tokens


def _frames(n: int, seed: int = 0) -> list:
    """`n` frames of random pixels (every patch of each differs from the others')."""
    gen = torch.Generator().manual_seed(seed)
    return [Image.fromarray(torch.randint(0, 256, (SIDE, SIDE, 3), generator=gen, dtype=torch.uint8).numpy())
            for _ in range(n)]


@pytest.fixture(scope="module")
def processor():
    return tiny_vlm.build_processor()


def _png(frames: list) -> tuple[bytes, ...]:
    """`frames` as PNG files' bytes: what a sample's sources are."""
    out = []
    for frame in frames:
        buffer = io.BytesIO()
        frame.save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return tuple(out)


def _image_patches(image_processor, frame) -> torch.Tensor:
    """One image's patches as (patches, channels, temporal slots, patch, patch)."""
    pixels = image_processor(images=[frame], return_tensors="pt")["pixel_values"]
    return pixels.view(pixels.shape[0], 3, 2, 14, 14)


def test_a_clip_is_its_frames_patches_two_frames_to_a_temporal_patch(processor):
    ip = processor.image_processor
    a, b, c = _frames(3)
    pixels, grid = clip_pixels(ip, [a, b, c])
    assert grid.tolist() == [2, 4, 4] and pixels.shape == (2 * 16, 3 * 2 * 14 * 14)
    steps = pixels.view(2, 16, 3, 2, 14, 14)
    first, second, third = (_image_patches(ip, f)[:, :, 0] for f in (a, b, c))
    assert torch.equal(steps[0, :, :, 0], first) and torch.equal(steps[0, :, :, 1], second)
    assert torch.equal(steps[1, :, :, 0], third) and torch.equal(steps[1, :, :, 1], third)  # the last, repeated
    # a still clip of one frame is that frame as an image
    assert torch.equal(clip_pixels(ip, [a, a])[0], ip(images=[a], return_tensors="pt")["pixel_values"])
    assert torch.equal(clip_pixels(ip, [a])[0], clip_pixels(ip, [a, a])[0])


def test_frame_times_are_qwen3_vls():
    ours = [frame_times(n, fps, 2) for n, fps in ((1, 2.0), (3, 2.0), (6, 1.5), (7, 24.0))]
    assert ours[1] == [0.25, 1.0]
    timestamps = getattr(transformers.Qwen3VLProcessor, "_calculate_timestamps", None)
    if timestamps is None:
        pytest.skip("this transformers' Qwen3VLProcessor computes no timestamps")
    for (n, fps), got in zip(((1, 2.0), (3, 2.0), (6, 1.5), (7, 24.0)), ours):
        assert got == pytest.approx(timestamps(None, list(range(n)), fps, 2))


def _chat(kinds: str) -> tuple:
    parts = [{"type": "video" if k == "v" else "image"} for k in kinds]
    return ({"role": "user", "content": [*parts, {"type": "text", "text": "What shape and colour is this?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a red circle"}]})


@pytest.fixture(scope="module")
def qwen3(processor):
    """A tiny random Qwen3-VL with a Qwen3-VL processor (the built-in tokenizer and image processor)."""
    tokenizer = processor.tokenizer
    qwen3 = image_only(transformers.Qwen3VLProcessor)(image_processor=processor.image_processor, tokenizer=tokenizer,
                                                      chat_template=processor.chat_template)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           (("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
            ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
    config = transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, num_heads=4, intermediate_size=64, out_hidden_size=32, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[1],
                           num_position_embeddings=16), **ids)
    torch.manual_seed(0)
    return qwen3, transformers.Qwen3VLForConditionalGeneration(config)


def _qwen3_rows(encoder) -> list:
    return [encoder.encode(VisionSample("r1", _chat("vi"), (VideoRef(_png(_frames(3)), 2.0), *_png(_frames(1, 1))), 1),
                           512),
            encoder.encode(VisionSample("r2", _chat("v"), (VideoRef(_png(_frames(2, 2)), 1.0),), 1), 512),
            encoder.encode(VisionSample("r3", _chat("ii"), _png(_frames(2, 5))), 512)]


def test_qwen3_vl_reads_a_batch_of_timestamped_frames(qwen3):
    """Qwen3-VL's layout: each temporal patch between its own vision start and end after its time.
    Its model takes the batch (it checks the video tokens against the clip's features, and gives
    each temporal patch its own positions) and learns from it."""
    qwen3, model = qwen3
    tokenizer = qwen3.tokenizer
    encoder = VisionEncoder(qwen3, family="qwen3_vl")
    rows = _qwen3_rows(encoder)[:2]
    text = tokenizer.decode(rows[0]["input_ids"])
    assert "<0.2 seconds><|vision_start|>" in text and "<1.0 seconds><|vision_start|>" in text
    assert "<0.5 seconds><|vision_start|>" in tokenizer.decode(rows[1]["input_ids"])
    batch = VisionCollator(encoder)(rows)
    batch.pop("num_tokens")
    assert batch["video_grid_thw"].tolist() == [[2, 4, 4], [1, 4, 4]] and "second_per_grid_ts" not in batch
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.visual.patch_embed.proj.weight.grad.abs().sum() > 0


def test_qwen3_vl_packed_rows_train_as_their_samples_alone(qwen3):
    """Qwen3-VL rows packed end to end (videos' timestamped frames among them) give the loss and
    gradients of the same samples in rows of their own."""
    qwen3, model = qwen3
    encoder = VisionEncoder(qwen3, family="qwen3_vl")
    rows = _qwen3_rows(encoder)
    handle = pack_positions(model)
    try:
        results = []
        for batch in (VisionCollator(encoder)(rows), VisionCollator(encoder)(pack(rows, 512, 0, ("text", "images")))):
            batch.pop("num_tokens")
            model.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    finally:
        handle.remove()
    assert batch["input_ids"].shape[0] == 1 and batch["position_ids"].shape[0] == 1
    (alone, alone_grads), (together, together_grads) = results
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)
    for a, b in zip(alone_grads, together_grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_a_video_for_a_family_tigon_does_not_lay_out_is_one_line():
    sample = VisionSample("data.jsonl line 3", _chat("v"), (VideoRef(("a.png",)),), 1)
    with pytest.raises(SFTError, match=r"^data.jsonl line 3: a video: tigon sft trains video \(as frames\) on qwen2_vl, "
                                       r".*; for glm4v, give the video's frames as images$"):
        check_videos([sample], "glm4v", True, tuple(VIDEO_LAYOUTS))
    with pytest.raises(SFTError, match=r"^data.jsonl line 3: a video, but llava models take no video"):
        check_videos([sample], "llava", False, tuple(VIDEO_LAYOUTS))
    check_videos([VisionSample("x", _chat("i"), ("a.png",))], "llava", False, tuple(VIDEO_LAYOUTS))


# (Marked gpu: transformers' video processors need torchvision, which the GPU machine has and the
# CPU suite's torch cannot load; nothing here needs the GPU itself.)
@pytest.mark.gpu
def test_a_clip_batch_equals_transformers_video_processors(processor):
    pytest.importorskip("torchvision")
    from transformers import Qwen2VLProcessor, Qwen2VLVideoProcessor

    ip = processor.image_processor
    video_processor = Qwen2VLVideoProcessor(
        patch_size=14, temporal_patch_size=2, merge_size=2, do_sample_frames=False,
        size={"shortest_edge": 28 * 28, "longest_edge": SIDE * SIDE * 4}, image_mean=ip.image_mean, image_std=ip.image_std)
    real = Qwen2VLProcessor(image_processor=ip, tokenizer=processor.tokenizer, video_processor=video_processor,
                            chat_template=processor.chat_template)
    frames, image = _frames(4, 3), _frames(1, 4)[0]
    text = real.apply_chat_template(list(_chat("vi")), tokenize=False)
    want = real(text=[text], images=[image], videos=[frames], return_tensors="pt")
    got = VisionEncoder(processor, family="qwen2_vl").inputs([text], [[VideoRef(tuple(frames)), image]])
    assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["video_grid_thw"], want["video_grid_thw"])
    torch.testing.assert_close(got["pixel_values_videos"], want["pixel_values_videos"], rtol=0, atol=1e-5)
    torch.testing.assert_close(got["pixel_values"], want["pixel_values"], rtol=0, atol=0)
    if "mm_token_type_ids" in want:
        assert torch.equal(got["mm_token_type_ids"], want["mm_token_type_ids"])
