"""`tigon sft` on vision-language models: the data layouts read into the same examples, the label
masks, each bad input as one line before anything is written, short runs on tiny random
Qwen2-VL, Qwen2.5-VL, LLaVA, Gemma 3 and Gemma 4 (saved to disk with their processors, built offline), the
vision encoder frozen, and the built-in default learning its shapes task."""

import base64
import io
import json
import logging
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tigon.cli import main
from tigon.train import tiny, tiny_vlm
from tigon.train import vision_run
from tigon.train.data import Sample
from tigon.train.template import IGNORE
from tigon.train.batching import pack
from tigon.train.vision import (VisionCollator, VisionEncoder, freeze, load_processor, model_config,
                                model_parts, pack_positions, vision_token_ids)
from tigon.train.vision_data import VideoRef, VisionSample, load_vision_samples, open_image

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

QUESTION, ANSWER = "What colour is the shape?", "red"


def _png(colour=(220, 40, 40), size=(30, 20), fmt="PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format=fmt)
    return out.getvalue()


@pytest.fixture
def layouts(tmp_path):
    """The same two-image chat in every layout, the images as files (PNG, JPEG), a data: URL and
    parquet bytes."""
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png())
    (tmp_path / "img" / "b.jpg").write_bytes(_png((40, 40, 220), (20, 30), "JPEG"))
    b_url = "data:image/jpeg;base64," + base64.b64encode((tmp_path / "img" / "b.jpg").read_bytes()).decode()
    openai = {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "img/a.png"}},
                                     {"type": "text", "text": "Compare "},
                                     {"type": "image", "image": b_url}, {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]}]}
    swift = {"messages": [{"role": "user", "content": f"<image>Compare <image>{QUESTION}"},
                          {"role": "assistant", "content": ANSWER}], "images": ["img/a.png", "img/b.jpg"]}
    sharegpt = {"conversations": [{"from": "human", "value": f"<image>Compare <image>{QUESTION}"},
                                  {"from": "gpt", "value": ANSWER}],
                "images": [str(tmp_path / "img" / "a.png"), b_url]}
    for name, row in (("openai", openai), ("swift", swift), ("sharegpt", sharegpt)):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    table = pa.table({"messages": [swift["messages"]],
                      "images": [[{"bytes": (tmp_path / "img" / "a.png").read_bytes(), "path": None},
                                  {"bytes": (tmp_path / "img" / "b.jpg").read_bytes(), "path": None}]]})
    pq.write_table(table, tmp_path / "rows.parquet")
    return tmp_path


def test_every_layout_reads_into_the_same_example(layouts):
    names = ("openai.jsonl", "swift.jsonl", "sharegpt.jsonl", "rows.parquet")
    samples = [load_vision_samples([str(layouts / n)], seed=0)[0] for n in names]
    expected = ({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Compare "}, {"type": "image"},
                                             {"type": "text", "text": QUESTION}]},
                {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]})
    pixels = [(220, 40, 40), None]
    for sample in samples:
        assert sample.messages == expected
        images = [open_image(ref) for ref in sample.images]
        assert [im.size for im in images] == [(30, 20), (20, 30)]
        assert images[0].getpixel((3, 3)) == pixels[0]
        # JPEG: the same decoded pixels, from the file, the data: URL or the parquet bytes
        assert images[1].tobytes() == open_image(layouts / "img" / "b.jpg").tobytes()


@pytest.fixture(scope="module")
def processor():
    return tiny_vlm.build_processor()


def test_labels_score_the_assistant_turns_only_never_an_image(processor):
    image = _png(size=(56, 56))
    messages = ({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What shape is this?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "a circle"}]},
                {"role": "user", "content": [{"type": "text", "text": "And this?"}, {"type": "image"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "a red square"}]})
    from tigon.train.vision_data import VisionSample

    encoder = VisionEncoder(processor)
    row = encoder.encode(VisionSample("row", messages, (image, image)), 512)
    tokenizer = processor.tokenizer
    scored = [t for t, label in zip(row["input_ids"], row["labels"]) if label != IGNORE]
    assert all(label in (IGNORE, t) for t, label in zip(row["input_ids"], row["labels"]))
    assert tokenizer.decode(scored) == "a circle<|im_end|>\na red square<|im_end|>\n"
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert row["input_ids"].count(image_pad) == 2 * 4  # 56 x 56 pixels: 4 tokens per image
    assert not set(vision_token_ids(processor)) & set(scored)
    # the collator's batch is the processor's, cut to the rows, with these labels
    batch = VisionCollator(encoder)([row, encoder.encode(VisionSample("r2", messages[:2], (image,)), 512)])
    assert batch["input_ids"][0].tolist() == row["input_ids"]
    assert batch["labels"][0].tolist() == row["labels"]
    assert batch["pixel_values"].shape[0] == 3 * 16 and batch["image_grid_thw"].shape == (3, 3)
    assert batch["attention_mask"][1].sum() < batch["attention_mask"][0].sum()


def _save_qwen2_vl(path: Path) -> Path:
    processor = tiny_vlm.build_processor()
    tiny_vlm.build_model(processor, seed=0).save_pretrained(path)
    processor.save_pretrained(path)
    return path


def _save_qwen2_5_vl(path: Path) -> Path:
    """A tiny random Qwen2.5-VL (windowed vision attention, 2-D vision rotary), with the built-in
    model's tokenizer and Qwen-VL's image processor."""
    from tigon.train.vision import image_only

    built = tiny_vlm.build_processor()
    processor = image_only(transformers.Qwen2_5_VLProcessor)(image_processor=built.image_processor,
                                                             tokenizer=built.tokenizer, chat_template=built.chat_template)
    qwen2 = tiny_vlm.build_model(built, seed=0).config
    config = transformers.Qwen2_5_VLConfig(
        text_config=qwen2.text_config.to_dict(),
        vision_config={"depth": 2, "hidden_size": 48, "intermediate_size": 64, "num_heads": 4, "out_hidden_size": 64,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                       "fullatt_block_indexes": [1]},
        **{k: getattr(qwen2, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                          "vision_end_token_id")})
    tiny.random_model(config, 0, auto=transformers.AutoModelForImageTextToText).save_pretrained(path)
    processor.save_pretrained(path)
    return path


def _save_llava(path: Path) -> Path:
    """A tiny random LLaVA (CLIP vision tower, Llama language model) with its processor."""
    tokenizer = tiny.build_tokenizer([Sample("", text="a red circle: what shape, what colour? describe the image")])
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    template = tiny_vlm.CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")
    image_processor = (getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor)(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                                            vision_feature_select_strategy="default", chat_template=template,
                                            num_additional_image_tokens=1)
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(image_size=28, patch_size=14, hidden_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=64),
        text_config=transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                             pad_token_id=tokenizer.pad_token_id),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
        vision_feature_select_strategy="default")
    tiny.random_model(config, 0, auto=transformers.AutoModelForImageTextToText).save_pretrained(path)
    processor.save_pretrained(path)
    return path


def _tokenizer_naming(path: Path, tokens: dict[str, str]) -> Any:
    """A tiny tokenizer with `tokens` added, saved in `path` and read back naming them as Gemma's
    do (``tokenizer.image_token`` ...: extra special tokens in tokenizer_config.json)."""
    tokenizer = tiny.build_tokenizer([Sample("", text="a red circle: what shape, what colour? describe the image")])
    tokenizer.add_tokens(list(tokens.values()), special_tokens=True)
    tokenizer.save_pretrained(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "extra_special_tokens": tokens}))
    return transformers.AutoTokenizer.from_pretrained(path)


def _save_gemma3(path: Path) -> Path:
    """A tiny random Gemma 3 (SigLIP vision tower) with its processor; its tokenizer names the
    image tokens as Gemma 3's does (extra special tokens in tokenizer_config.json)."""
    tokens = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tokenizer = _tokenizer_naming(path, tokens)
    template = tiny_vlm.CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<start_of_image>")
    image_processor = (getattr(transformers, "Gemma3ImageProcessorPil", None) or transformers.Gemma3ImageProcessor)(
        size={"height": 28, "width": 28})
    processor = transformers.Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                             chat_template=template, image_seq_length=4)
    ids = {name: tokenizer.convert_tokens_to_ids(tokens[key]) for name, key in
           (("boi_token_index", "boi_token"), ("eoi_token_index", "eoi_token"), ("image_token_index", "image_token"))}
    config = transformers.Gemma3Config(
        vision_config=transformers.SiglipVisionConfig(image_size=28, patch_size=7, hidden_size=32, num_hidden_layers=1,
                                                      num_attention_heads=2, intermediate_size=64),
        text_config=transformers.Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                                  head_dim=16, pad_token_id=tokenizer.pad_token_id),
        mm_tokens_per_image=4, **ids)
    tiny.random_model(config, 0, auto=transformers.AutoModelForImageTextToText).save_pretrained(path)
    processor.save_pretrained(path)
    return path


def _save_gemma4(path: Path) -> Path:
    """A tiny random Gemma 4 (its own vision tower: patches pooled 2 x 2) with its processor, built
    without torchvision (no video processor); its tokenizer names the image and audio tokens as
    Gemma 4's does (its processor refuses every input, images too, where the audio ones are not named)."""
    from tigon.train.vision import image_only

    tokens = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
              "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}
    tokenizer = _tokenizer_naming(path, tokens)
    template = tiny_vlm.CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", tokens["image_token"])
    # 4 x 4-pixel patches, at most 70 soft tokens (the fewest Gemma 4 allows) of 2 x 2 patches each
    image_processor = (getattr(transformers, "Gemma4ImageProcessorPil", None) or transformers.Gemma4ImageProcessor)(
        patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)
    processor = image_only(transformers.Gemma4Processor)(
        feature_extractor=transformers.Gemma4AudioFeatureExtractor(), image_processor=image_processor,
        tokenizer=tokenizer, chat_template=template)
    ids = {f"{key[:-6]}_token_id": tokenizer.convert_tokens_to_ids(token) for key, token in tokens.items()}
    config = transformers.Gemma4Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16,
                         sliding_window=8, hidden_size_per_layer_input=16, vocab_size_per_layer_input=len(tokenizer),
                         use_bidirectional_attention="vision", pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                           position_embedding_size=32),
        audio_config=None, video_token_id=processor.video_token_id, **ids)
    tiny.random_model(config, 0, auto=transformers.AutoModelForImageTextToText).save_pretrained(path)
    processor.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlms")
    return {"qwen2_vl": _save_qwen2_vl(root / "qwen2_vl"), "qwen2_5_vl": _save_qwen2_5_vl(root / "qwen2_5_vl"),
            "llava": _save_llava(root / "llava"),
            "gemma3": _save_gemma3(root / "gemma3"),
            **({"gemma4": _save_gemma4(root / "gemma4")} if hasattr(transformers, "Gemma4Processor") else {})}


@pytest.fixture
def shapes_file(tmp_path):
    """A few rows of the shapes task as a data file with its images beside it."""
    rows = []
    for i, sample in enumerate(tiny_vlm.shapes_task(8, seed=0)):
        (tmp_path / f"s{i}.png").write_bytes(sample.images[0])
        user, reply = sample.messages
        rows.append({"messages": [{"role": "user", "content": "<image>" + user["content"][1]["text"]},
                                  {"role": "assistant", "content": reply["content"][0]["text"]}],
                     "images": [f"s{i}.png"]})
    path = tmp_path / "shapes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# The saved VLMs every `tigon sft` test takes (Gemma 4's where transformers has it).
WITH_GEMMA4 = pytest.mark.skipif(not hasattr(transformers, "Gemma4Processor"), reason="transformers has no Gemma 4")
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "llava", "gemma3", pytest.param("gemma4", marks=WITH_GEMMA4)]


# LoRA on every family; the full fine-tune (the same run but for what trains) on a Qwen-VL and a
# CLIP-tower family, where it is quickest. Batches of two rows: still padded, still several rows to
# a kernel launch, and the interpreted loss kernel's work (one program per row) is half of four's.
@pytest.mark.parametrize("family, tuner", [("qwen2_vl", "lora"), ("qwen2_5_vl", "lora"), ("llava", "lora"), ("gemma3", "lora"),
                                           pytest.param("gemma4", "lora", marks=WITH_GEMMA4), ("qwen2_vl", "full"),
                                           ("llava", "full")])
def test_sft_trains_a_saved_vlm_and_its_output_loads(models, shapes_file, tmp_path, family, tuner, caplog):
    out = tmp_path / "out"
    caplog.set_level(logging.INFO, logger="tigon")
    assert main(["sft", "--model", str(models[family]), "--dataset", str(shapes_file), "--tuner", tuner,
                 "--max-steps", "3", "--batch-size", "2", "--lr", "1e-3", "--samples", "1", "--max-new-tokens", "3",
                 "--save-steps", "0", "--output-dir", str(out)]) == 0
    losses = [r["loss"] for r in _metrics(out) if "loss" in r]
    assert len(losses) == 3 and all(loss == loss and loss > 0 for loss in losses)
    assert "linear_cross_entropy" in caplog.text and "kernels off" not in caplog.text  # tigon's kernels ran
    final = out / "final"
    assert (final / ("adapter_config.json" if tuner == "lora" else "model.safetensors")).is_file()
    assert load_processor(str(final), model_config(str(models[family]))).chat_template
    if tuner == "lora":
        adapted = json.loads((final / "adapter_config.json").read_text())["target_modules"]
        assert adapted and all("language_model" in name for name in adapted)
        assert "(vision encoder and projector frozen)" in caplog.text
    samples = json.loads((out / "samples.json").read_text())
    assert samples[0]["prompt"].startswith("[s") and "before" in samples[0] and "after" in samples[0]


@pytest.mark.skipif(not hasattr(transformers, "Gemma4Processor"), reason="transformers has no Gemma 4")
def test_gemma4_batches_mark_each_images_tokens_for_its_bidirectional_attention(models):
    """Gemma 4's batches carry mm_token_type_ids (1 on exactly the images' soft tokens): without
    them its model would attend causally within an image, unlike the Gemma 4 being trained."""
    path = str(models["gemma4"])
    encoder = VisionEncoder(load_processor(path, model_config(path)))
    batch = VisionCollator(encoder)([encoder.encode(s, 512) for s in tiny_vlm.shapes_task(2, seed=0)])
    batch.pop("num_tokens")
    image = batch["input_ids"] == encoder.processor.image_token_id
    assert image.sum() > 0 and torch.equal(batch["mm_token_type_ids"].bool(), image)
    model = transformers.AutoModelForImageTextToText.from_pretrained(path)
    with torch.no_grad():
        marked = model(**batch).logits
        unmarked = model(**{k: v for k, v in batch.items() if k != "mm_token_type_ids"}).logits
    assert not torch.allclose(marked, unmarked)


def test_freeze_vision_leaves_the_tower_without_gradients(processor):
    model = tiny_vlm.build_model(processor, seed=0)
    parts = model_parts(model)
    assert parts.tower == "model.visual" and parts.projector == "model.visual.merger"
    freeze(model, parts, freeze_vision=True, freeze_projector=False)
    encoder = VisionEncoder(processor)
    batch = VisionCollator(encoder)([encoder.encode(s, 128) for s in tiny_vlm.shapes_task(2, seed=0)])
    batch.pop("num_tokens")
    model(**batch).loss.backward()
    for name, param in model.named_parameters():
        if name.startswith("model.visual.merger") or not name.startswith("model.visual"):
            assert param.grad is not None, name
        else:
            assert param.grad is None and not param.requires_grad, name


def _bad_rows(tmp_path: Path) -> None:
    (tmp_path / "ok.png").write_bytes(_png())
    (tmp_path / "wide.png").write_bytes(_png(size=(40, 20)))
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    chat = [{"role": "user", "content": "<image>What colour?"}, {"role": "assistant", "content": "red"}]
    files = {
        "missing": {"messages": chat, "images": ["nope.png"]},
        "broken": {"messages": chat, "images": ["broken.png"]},
        "more_slots": {"messages": [{"role": "user", "content": "<image><image>Which?"}, chat[1]], "images": ["ok.png"]},
        "more_images": {"messages": chat, "images": ["ok.png", "ok.png"]},
        "remote": {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, {"type": "text", "text": "?"}]},
            chat[1]]},
        "video": {"messages": [{"role": "user", "content": "<video>What happens?"}, chat[1]], "videos": [["ok.png"]]},
        "video_file": {"messages": [{"role": "user", "content": "<video>What happens?"}, chat[1]], "videos": ["clip.mp4"]},
        "video_frame_missing": {"messages": [{"role": "user", "content": [
            {"type": "video", "video": ["ok.png", "nope.png"]}, {"type": "text", "text": "?"}]}, chat[1]]},
        "video_sizes": {"messages": [{"role": "user", "content": "<video>What happens?"}, chat[1]],
                        "videos": [["ok.png", "ok.png", "wide.png"]]},
        "more_videos": {"messages": [{"role": "user", "content": "<video>What happens?"}, chat[1]],
                        "videos": [["ok.png"], ["ok.png"]]},
        "video_fps": {"messages": [{"role": "user", "content": [
            {"type": "video", "video": ["ok.png"], "fps": 0}, {"type": "text", "text": "?"}]}, chat[1]]},
        "text_only": {"conversations": [{"from": "human", "value": "<image>What colour?"}, {"from": "gpt", "value": "red"}],
                      "images": ["ok.png"]},
    }
    for name, row in files.items():
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"messages": chat, "images": ["ok.png"]}) + "\n"
                                                + json.dumps(row) + "\n")


@pytest.mark.parametrize("family, argv, message", [
    ("qwen2_vl", ["--dataset", "{tmp}/missing.jsonl"], "{tmp}/missing.jsonl line 2: image 1 (nope.png): no such file"),
    ("qwen2_vl", ["--dataset", "{tmp}/broken.jsonl"],
     "{tmp}/broken.jsonl line 2: image 1 (broken.png): cannot be read as an image"),
    ("qwen2_vl", ["--dataset", "{tmp}/more_slots.jsonl"],
     "{tmp}/more_slots.jsonl line 2: has 2 <image> placeholders (or image parts) but 1 image"),
    ("qwen2_vl", ["--dataset", "{tmp}/more_images.jsonl"],
     "{tmp}/more_images.jsonl line 2: has 1 <image> placeholder (or image parts) but 2 images"),
    ("qwen2_vl", ["--dataset", "{tmp}/remote.jsonl"], "{tmp}/remote.jsonl line 2: image 1 (https://example.com/cat.png): "
                                                      "a remote URL: tigon fetches nothing"),
    ("llava", ["--dataset", "{tmp}/video.jsonl"], "{tmp}/video.jsonl line 2: a video, but llava models take no video"),
    ("gemma3", ["--dataset", "{tmp}/video.jsonl"], "{tmp}/video.jsonl line 2: a video, but gemma3 models take no video"),
    ("qwen2_vl", ["--dataset", "{tmp}/video_file.jsonl"], "{tmp}/video_file.jsonl line 2: video 1: a video file; tigon "
                                                          "decodes no video: give its frames"),
    ("qwen2_vl", ["--dataset", "{tmp}/video_frame_missing.jsonl"],
     "{tmp}/video_frame_missing.jsonl line 2: video 1, frame 2 (nope.png): no such file"),
    ("qwen2_5_vl", ["--dataset", "{tmp}/video_sizes.jsonl"], "{tmp}/video_sizes.jsonl line 2: video 1: its frames differ "
                                                             "in size (frame 1 is 30x20, frame 3 is 40x20)"),
    ("qwen2_vl", ["--dataset", "{tmp}/more_videos.jsonl"],
     "{tmp}/more_videos.jsonl line 2: has 1 <video> placeholder (or video parts) but 2 videos"),
    ("qwen2_vl", ["--dataset", "{tmp}/video_fps.jsonl"],
     "{tmp}/video_fps.jsonl line 2: messages[0].content[0].fps must be a positive number of frames per second, got 0"),
    (None, ["--dataset", "{tmp}/text_only.jsonl"], "{tmp}/text_only.jsonl line 1: has images: a text-only model cannot "
                                                   "train on images"),
    (None, ["--max-pixels", "1000"], "--max-pixels: only for vision-language models"),
    ("gemma3", ["--packing"], "--packing: rows with images cannot be packed exactly for gemma3 yet (packing takes "
                              "qwen2_vl, qwen2_5_vl"),
    ("llava", ["--min-pixels", "100"], "--min-pixels: llava's image processor resizes every image to its own size"),
    ("qwen2_vl", ["--max-pixels", "0"], "--max-pixels must be > 0, got 0"),
])
def test_bad_input_is_one_line_and_writes_nothing(models, tmp_path, capsys, family, argv, message):
    _bad_rows(tmp_path)
    model = ["--model", str(models[family])] if family else []
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["sft", *model, "--output-dir", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tigon sft: error: {message.format(tmp=tmp_path)}"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_large_images_are_scaled_down_and_said_once(models, tmp_path, caplog):
    (tmp_path / "big.png").write_bytes(_png(size=(200, 150)))
    row = {"messages": [{"role": "user", "content": "<image>What colour?"}, {"role": "assistant", "content": "red"}],
           "images": ["big.png"]}
    (tmp_path / "big.jsonl").write_text((json.dumps(row) + "\n") * 3)
    caplog.set_level(logging.INFO, logger="tigon.train")
    assert main(["sft", "--model", str(models["qwen2_vl"]), "--dataset", str(tmp_path / "big.jsonl"), "--max-pixels",
                 str(56 * 56), "--max-steps", "1", "--samples", "0", "--output-dir", str(tmp_path / "out")]) == 0
    said = [r.getMessage() for r in caplog.records if "larger than --max-pixels" in r.getMessage()]
    assert said == [f"data: 3 images larger than --max-pixels {56 * 56}: scaled down to it (aspect kept)"]
    encoder = VisionEncoder(tiny_vlm.build_processor(), max_pixels=56 * 56)
    assert encoder.images([tmp_path / "big.png"])[0].size[0] * encoder.images([tmp_path / "big.png"])[0].size[1] <= 56 * 56


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_sft_trains_on_videos_given_as_frames(models, tmp_path, family, caplog):
    """Rows with a video (frames listed, or a folder of them in name order) beside an image:
    `tigon sft` reads, lays out and trains on them; a video's tokens are its frames' patches, two
    frames to each (an odd last frame repeated)."""
    rng = random.Random(0)
    (tmp_path / "clip").mkdir()
    for i in (10, 1, 2):
        (tmp_path / "clip" / f"frame_{i}.png").write_bytes(tiny_vlm.draw("circle", "red", rng))
    for name in ("a", "b", "s"):
        (tmp_path / f"{name}.png").write_bytes(tiny_vlm.draw("square", "blue", rng))
    rows = [{"messages": [{"role": "user", "content": [{"type": "video", "video": "clip", "fps": 4},
                                                       {"type": "text", "text": "What moves?"}]},
                          {"role": "assistant", "content": "a red circle"}]},
            {"messages": [{"role": "user", "content": "<video>then <image>Which?"},
                          {"role": "assistant", "content": "a blue square"}],
             "videos": [["a.png", "b.png"]], "images": ["s.png"]}]
    (tmp_path / "video.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) * 2)
    samples = load_vision_samples([str(tmp_path / "video.jsonl")], seed=0)
    clip = next(s.images[0] for s in samples if len(s.images) == 1)
    assert [f.name for f in clip.frames] == ["frame_1.png", "frame_2.png", "frame_10.png"] and clip.fps == 4
    processor = load_processor(str(models[family]), model_config(str(models[family])))
    encoder = VisionEncoder(processor, family=family)
    batch = VisionCollator(encoder)([encoder.encode(s, 512) for s in samples[:2]])
    per_step = 56 * 56 // (28 * 28)  # a 56-pixel frame: 4 x 4 patches, merged 2 x 2
    steps = sorted(batch["video_grid_thw"][:, 0].tolist())
    assert steps == [1, 2] and (batch["input_ids"] == processor.video_token_id).sum() == per_step * 3
    if family == "qwen2_5_vl":  # two frames a temporal patch: 0.5 s at 4 fps, 1 s at the default 2
        assert sorted(batch["second_per_grid_ts"].tolist()) == [0.5, 1.0]
    caplog.set_level(logging.INFO, logger="tigon.train")
    out = tmp_path / "out"
    assert main(["sft", "--model", str(models[family]), "--dataset", str(tmp_path / "video.jsonl"), "--max-steps", "2",
                 "--batch-size", "2", "--samples", "1", "--max-new-tokens", "2", "--save-steps", "0",
                 "--output-dir", str(out)]) == 0
    losses = [r["loss"] for r in _metrics(out) if "loss" in r]
    assert len(losses) == 2 and all(0 < loss < 100 for loss in losses)
    assert "4 rows, messages with images, 2 images, 4 videos" in caplog.text


def _packing_samples(tmp_path: Path, video: bool) -> list:
    """Three chats of different lengths: two images, one image, and (for a family with video) a
    video's frames beside an image."""
    rng = random.Random(1)
    shapes = [tiny_vlm.draw(s, "red", rng) for s in ("circle", "square", "triangle", "circle")]
    ask = lambda parts, answer: ({"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]},
                                 {"role": "assistant", "content": [{"type": "text", "text": answer}]})
    image = {"type": "image"}
    samples = [VisionSample("a", ask([image, image], "red and red, a longer answer"), tuple(shapes[:2])),
               VisionSample("b", ask([image], "red"), (shapes[2],))]
    if video:
        samples.append(VisionSample("c", ask([{"type": "video"}, image], "a red circle"),
                                    (VideoRef(tuple(shapes[:3]), 1.0), shapes[3]), 1))
    return samples


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava"])
def test_packed_rows_give_the_loss_and_gradients_of_their_samples_alone(models, tmp_path, family):
    """Samples packed end to end in one row (Qwen-VL's 3-D positions too, a video's among them)
    train exactly as the same samples in a padded batch of their own rows."""
    path = str(models[family])
    processor = load_processor(path, model_config(path))
    encoder = VisionEncoder(processor, family=family)
    rows = [encoder.encode(s, 512) for s in _packing_samples(tmp_path, video=family != "llava")]
    packed = pack(rows, 512, seed=0, keep=("text", "images"))
    assert len(packed) == 1 and len(packed[0]["samples"]) == len(rows)
    model = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    pack_positions(model)
    grads = []
    for batch in (VisionCollator(encoder)(rows), VisionCollator(encoder)(packed)):
        batch.pop("num_tokens")
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (alone, alone_grads), (together, together_grads) = grads
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)
    assert len(alone_grads) == len(together_grads)
    for a, b in zip(alone_grads, together_grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_sft_packs_vlm_rows(models, shapes_file, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tigon.train")
    out = tmp_path / "out"
    assert main(["sft", "--model", str(models["qwen2_5_vl"]), "--dataset", str(shapes_file), "--packing",
                 "--max-length", "128", "--max-steps", "2", "--batch-size", "2", "--samples", "0", "--save-steps", "0",
                 "--output-dir", str(out)]) == 0
    losses = [r["loss"] for r in _metrics(out) if "loss" in r]
    assert len(losses) == 2 and all(0 < loss < 100 for loss in losses)
    packed = re.search(r"packing: into (\d+) rows of up to 128 tokens", caplog.text)
    assert packed and int(packed.group(1)) < 8  # the file's 8 rows, a few to each packed row


def test_builtin_vision_default_learns_the_shapes(tmp_path, monkeypatch, caplog):
    """A shorter run of `tigon sft --modality vision`: the held-out answers name the shapes' colours
    after training, and not before."""
    monkeypatch.setattr(vision_run, "BUILTIN_ROWS", 240)
    caplog.set_level(logging.INFO, logger="tigon.train")
    out = tmp_path / "out"
    # (Kernels off, as the sft defaults' tests run: the interpreter would take minutes; they are
    # tested on these models in tests/patch/test_vlm.py.)
    assert main(["sft", "--modality", "vision", "--epochs", "12", "--samples", "12", "--max-new-tokens", "4",
                 "--save-steps", "0", "--no-kernels", "--output-dir", str(out)]) == 0
    samples = json.loads((out / "samples.json").read_text())
    assert len(samples) == 12
    drawn = [s["prompt"].split("]")[0].lstrip("[") for s in samples]  # "a red circle"
    right_before = sum(s["before"] == d for s, d in zip(samples, drawn))
    colour_after = sum(s["after"].split()[1:2] == d.split()[1:2] for s, d in zip(samples, drawn))
    assert right_before == 0 and colour_after >= 9, samples


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_bf16_vlm_trains_with_kernels_as_without(models, shapes_file, tmp_path, family):
    """On the GPU, in bf16, LoRA on a tiny VLM takes the same steps with tigon.patch (where it takes
    the family; else unpatched, with its warning) as without (bf16 tolerance)."""
    args = ["--model", str(models[family]), "--dataset", str(shapes_file), "--dtype", "bf16", "--lr", "1e-3",
            "--batch-size", "4", "--max-steps", "6", "--save-steps", "0", "--samples", "1", "--max-new-tokens", "3"]
    assert main(["sft", *args, "--output-dir", str(tmp_path / "off"), "--no-kernels"]) == 0
    assert main(["sft", *args, "--output-dir", str(tmp_path / "on")]) == 0
    off, on = ([r for r in _metrics(tmp_path / run) if "loss" in r] for run in ("off", "on"))
    assert [r["step"] for r in off] == [r["step"] for r in on] == list(range(1, 7))
    for a, b in zip(off, on):
        assert b["loss"] == pytest.approx(a["loss"], rel=3e-2), a["step"]
    assert all(r["gpu_mem_gib"] > 0 for r in on)


def test_infer_answers_about_an_image_and_refuses_what_it_cannot(models, shapes_file, tmp_path, capsys):
    """`tigon infer VLM --image PATH`: the model's answer about the image; an image it cannot open,
    a remote URL, or a text-only model get one line each."""
    image = str(shapes_file.parent / "s0.png")
    assert main(["infer", str(models["qwen2_vl"]), "--image", image, "--prompt", "What shape?",
                 "--max-new-tokens", "3", "--dtype", "fp32"]) == 0
    assert capsys.readouterr().out.count("\n") == 1  # one answer (the random model's words)
    text_model = tmp_path / "text"
    from transformers import LlamaConfig

    tiny.random_model(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1), 0).save_pretrained(text_model)
    for argv, message in (
        ([str(models["qwen2_vl"]), "--image", str(tmp_path / "nothing.png")], "--image " + str(tmp_path / "nothing.png")),
        ([str(models["qwen2_vl"]), "--image", "https://example.com/a.png"], "a remote URL"),
        ([str(text_model), "--image", image], "is not a vision-language model"),
    ):
        assert main(["infer", *argv, "--prompt", "What shape?"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_merge_folds_a_vlm_adapter_into_a_model_that_loads_with_its_processor(models, shapes_file, tmp_path):
    """`tigon merge` of a VLM's LoRA adapter: a vision-language model (not a causal LM) with its
    processor beside it, which answers with the adapter's numbers."""
    out = tmp_path / "out"
    assert main(["sft", "--model", str(models["qwen2_vl"]), "--dataset", str(shapes_file), "--max-steps", "2",
                 "--batch-size", "4", "--lr", "1e-2", "--samples", "0", "--save-steps", "0", "--no-kernels",
                 "--output-dir", str(out)]) == 0
    merged = tmp_path / "merged"
    assert main(["merge", str(out / "final"), "--output", str(merged), "--dtype", "fp32"]) == 0
    config = model_config(str(merged))
    assert type(load_processor(str(merged), config)).__name__.startswith("Qwen2VL")
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    folded = AutoModelForImageTextToText.from_pretrained(merged)
    adapted = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(models["qwen2_vl"]), out / "final")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(folded(input_ids=ids).logits, adapted(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_with_a_media_root_images_and_frames_outside_it_are_refused(tmp_path, monkeypatch):
    """Under the web UI (TIGON_MEDIA_ROOT: its runs folder) a data file's images and video frames
    are read only from inside that folder: a path up and out of it, an absolute one elsewhere, a
    link out of it and a folder of frames elsewhere are each one line; inside, all is read."""
    from tigon.train.config import SFTError
    from tigon.train.vision_data import MEDIA_ROOT_ENV

    root, elsewhere = tmp_path / "runs", tmp_path / "private"
    (root / "clip").mkdir(parents=True)
    (elsewhere / "clip").mkdir(parents=True)
    for folder in (root, elsewhere):
        (folder / "a.png").write_bytes(_png())
        (folder / "clip" / "f1.png").write_bytes(_png())
    (root / "link.png").symlink_to(elsewhere / "a.png")
    monkeypatch.setenv(MEDIA_ROOT_ENV, str(root))
    chat = [{"role": "user", "content": "<image>What colour?"}, {"role": "assistant", "content": "red"}]
    video = [{"role": "user", "content": "<video>What happens?"}, {"role": "assistant", "content": "red"}]
    ok = [{"messages": chat, "images": ["a.png"]}, {"messages": video, "videos": ["clip"]}]
    (root / "ok.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ok))
    assert len(load_vision_samples([str(root / "ok.jsonl")], seed=0)) == 2
    for name, row, where in (("up", {"messages": chat, "images": ["../private/a.png"]}, "image 1"),
                             ("absolute", {"messages": chat, "images": [str(elsewhere / "a.png")]}, "image 1"),
                             ("link", {"messages": chat, "images": ["link.png"]}, "image 1"),
                             ("frames", {"messages": video, "videos": [str(elsewhere / "clip")]}, "video 1"),
                             ("frame", {"messages": video, "videos": [["../private/clip/f1.png"]]}, "video 1, frame 1")):
        (root / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
        with pytest.raises(SFTError, match=rf"line 1: {where} \(.*\): outside the runs folder \({re.escape(str(root))}\)$"):
            load_vision_samples([str(root / f"{name}.jsonl")], seed=0)
