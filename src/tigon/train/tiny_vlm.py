"""The built-in vision-language default (`tigon sft --modality vision`): a tiny Qwen2-VL made from
a config (random weights), its processor assembled offline (a byte-level BPE tokenizer trained on
the task's text, with Qwen-VL's vision tokens, and Qwen-VL's image processor), and a synthetic
task drawn on the spot: a coloured shape on a plain background, and the question of its shape and
colour. Small enough to learn on a CPU in about two minutes, with nothing to download."""

from __future__ import annotations

import io
import random
from typing import Any

import torch

from tigon.train.data import Sample
from tigon.train.vision_data import VisionSample

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 80, 220), "yellow": (230, 200, 40)}
SHAPES = ("circle", "square", "triangle")
IMAGE_SIDE = 56  # pixels: Qwen-VL's 14-pixel patches, merged 2 x 2, make 4 image tokens
QUESTION = "What shape and colour is this?"  # answered "a red circle"
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def draw(shape: str, colour: str, rng: random.Random) -> bytes:
    """A PNG of one `colour` `shape`, of random size and place, on a light background."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE), tuple(rng.randint(225, 255) for _ in range(3)))
    pen = ImageDraw.Draw(image)
    # Large, so that each of the 4 x 4 patches sees an edge or a corner of it; placed at random.
    size = rng.randint(IMAGE_SIDE * 5 // 7, IMAGE_SIDE - 6)
    x, y = rng.randint(2, IMAGE_SIDE - size - 2), rng.randint(2, IMAGE_SIDE - size - 2)
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse((x, y, x + size, y + size), fill=fill)
    elif shape == "square":
        pen.rectangle((x, y, x + size, y + size), fill=fill)
    else:
        pen.polygon([(x + size / 2, y), (x, y + size), (x + size, y + size)], fill=fill)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def shapes_task(n: int, seed: int) -> list[VisionSample]:
    """`n` rows of the synthetic task: an image, the question, its answer; every shape and colour
    equally often. `where` names the shape and colour drawn."""
    rng = random.Random(seed)
    kinds = [(s, c) for s in SHAPES for c in COLOURS]
    samples = []
    for i in range(n):
        shape, colour = kinds[i % len(kinds)]
        messages = ({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                    {"role": "assistant", "content": [{"type": "text", "text": f"a {colour} {shape}"}]})
        samples.append(VisionSample(f"shapes task row {i + 1} (a {colour} {shape})", messages,
                                    (draw(shape, colour, rng),)))
    rng.shuffle(samples)
    return samples


def drawn(sample: VisionSample) -> str:
    """What the image of a shapes-task row shows (for the log)."""
    return sample.where.rsplit("(", 1)[-1].rstrip(")")


def build_processor(max_pixels: int = IMAGE_SIDE * IMAGE_SIDE) -> Any:
    """Qwen2-VL's processor without a download: a BPE tokenizer trained on the task's text (as the
    built-in text model's is, `tiny.build_tokenizer`) with Qwen-VL's vision tokens, and its image
    processor (the PIL one where this transformers has both) bounded to `max_pixels`."""
    import transformers

    from tigon.train import tiny
    from tigon.train.vision import image_only

    texts = [Sample("", messages=({"role": "user", "content": QUESTION}, {"role": "assistant", "content": f"a {c} {s}"}))
             for s in SHAPES for c in COLOURS]
    tokenizer = tiny.build_tokenizer(texts)
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tokenizer.padding_side = "right"
    image_class = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
    image_processor = image_class(min_pixels=28 * 28, max_pixels=max_pixels)
    return image_only(transformers.Qwen2VLProcessor)(image_processor=image_processor, tokenizer=tokenizer,
                                                     chat_template=CHAT_TEMPLATE)


def build_model(processor: Any, seed: int) -> torch.nn.Module:
    """A ~0.5M-parameter Qwen2-VL (a 2-block vision encoder, a 2-layer language model) with
    seeded weights, its special tokens those of `processor`."""
    from transformers import AutoModelForImageTextToText, Qwen2VLConfig

    from tigon.train import tiny

    tokenizer = processor.tokenizer
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           (("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
            ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
    config = Qwen2VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                     "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, "tie_word_embeddings": True,
                     "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                     "eos_token_id": tokenizer.eos_token_id},
        vision_config={"depth": 2, "embed_dim": 48, "hidden_size": 64, "num_heads": 4, "mlp_ratio": 2,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        tie_word_embeddings=True, attn_implementation="sdpa", **ids)
    return tiny.random_model(config, seed, auto=AutoModelForImageTextToText)
