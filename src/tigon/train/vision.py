"""Vision-language models for `tigon sft`: the model (``AutoModelForImageTextToText``) and its
processor (``AutoProcessor``) from the model directory, chats with images turned into training
rows (loss on the assistant turns only, never on an image's tokens), batches the processor makes
again from each row's text and images, the vision tower and projector frozen or not, LoRA on the
language model, and sample answers about images before and after training.

A row's tokens come from the processor (which expands each image's placeholder into as many tokens
as the image has patches): an assistant turn's tokens start where the processor's tokens of the
chat before it (with the generation prompt) stop, and end where those of the chat through it end,
so that every family's expansion is its own processor's business."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tigon.train.batching import NUM_TOKENS
from tigon.train.config import SFTConfig, SFTError
from tigon.train.template import IGNORE
from tigon.train.vision_data import ImageRef, VideoRef, VisionSample, bounded, image_ref, open_image
from tigon.train.vision_video import video_inputs

log = logging.getLogger("tigon.train")

# The attribute names under which the families' models hold their vision encoder and projector
# (Qwen-VL's projector, its "merger", sits inside its encoder).
TOWERS = ("visual", "vision_tower", "vision_model", "vision_encoder")
PROJECTORS = ("merger", "multi_modal_projector", "connector", "mm_projector", "multimodal_projector")
LANGUAGE_MODELS = ("language_model", "text_model")


def is_vision_config(config: Any) -> bool:
    """Whether a model config is a vision-language model's (it has a vision_config)."""
    return getattr(config, "vision_config", None) is not None


def model_config(model_id: str) -> Any:
    """The model's config (an SFTError line when there is none to read)."""
    from transformers import AutoConfig

    from tigon.train.modeling import _not_found, source_kwargs

    source = source_kwargs(model_id)  # its own line for a model that is nowhere
    try:
        return AutoConfig.from_pretrained(model_id, **source)
    except (OSError, ValueError) as err:
        raise _not_found(model_id, err) from None


# --- processor ----------------------------------------------------------------------------------

def image_only(cls: type) -> type:
    """`cls` (a processor class) without its video processor: transformers builds those on
    torchvision alone, and a processor class with one refuses to exist without it, images or not.
    Its other sub-processors (Gemma 4's audio feature extractor) are given by keyword."""
    from transformers import ProcessorMixin

    class _NoVideo(ProcessorMixin):
        # Between `cls` and ProcessorMixin: takes away the video processor (None) that `cls` passes
        # on by name (one passed by position, the mixin drops: its attributes do not name it).
        def __init__(self, *args, **kwargs):
            kwargs.pop("video_processor", None)
            super().__init__(*args, **kwargs)

    attributes = [a for a in cls.get_attributes() if a != "video_processor"]

    def __init__(self, chat_template=None, **kwargs):
        cls.__init__(self, **kwargs, video_processor=None, chat_template=chat_template)

    return type(cls.__name__, (cls, _NoVideo), {"__init__": __init__, "__module__": cls.__module__,
                                                "get_attributes": classmethod(lambda _: list(attributes))})


def _saved_chat_template(folder: Path, tokenizer: Any) -> str | None:
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    for name in ("chat_template.json", "processor_config.json"):
        if (folder / name).is_file():
            template = json.loads((folder / name).read_text()).get("chat_template")
            if template:
                return template
    return getattr(tokenizer, "chat_template", None)


def load_processor(model_id: str, config: Any) -> Any:
    """The model's processor (``AutoProcessor``); where its video processor cannot be built (no
    torchvision), the same processor without it, from the image processor (PIL backend), the
    tokenizer and the chat template saved in the directory."""
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    from tigon.train.modeling import _not_found, source_kwargs

    kwargs = source_kwargs(model_id, marks=("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"))
    try:
        processor = AutoProcessor.from_pretrained(model_id, **kwargs)
    except (ImportError, OSError, ValueError) as err:
        name = PROCESSOR_MAPPING_NAMES.get(config.model_type)
        import transformers

        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if cls is None or not Path(model_id).is_dir():
            raise _not_found(model_id, err) from None
        cls = image_only(cls)
        try:
            parts = {"image_processor": AutoImageProcessor.from_pretrained(model_id, **kwargs),
                     "tokenizer": AutoTokenizer.from_pretrained(model_id, **kwargs)}
            if "feature_extractor" in cls.get_attributes():  # Gemma 4's (audio): its processor takes one
                parts["feature_extractor"] = AutoFeatureExtractor.from_pretrained(model_id, **kwargs)
        except (ImportError, OSError, ValueError) as inner:
            raise _not_found(model_id, inner) from None
        processor = cls(**parts, chat_template=_saved_chat_template(Path(model_id), parts["tokenizer"]))
        log.info("processor: %s without its video processor (it needs torchvision): images only", name)
    if not hasattr(processor, "image_processor"):
        raise SFTError(f"{model_id}: its processor ({type(processor).__name__}) has no image processor")
    if not getattr(processor, "chat_template", None):
        raise SFTError(f"{model_id}: its processor has no chat template (chat_template.jinja) to lay out the chats")
    processor.tokenizer.padding_side = "right"
    if processor.tokenizer.pad_token_id is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    return processor


def is_dynamic_resolution(processor: Any) -> bool:
    """Whether the image processor sizes images by their pixel count (Qwen-VL's), which
    --min-pixels / --max-pixels set, rather than to a fixed size."""
    return hasattr(processor.image_processor, "merge_size") and "longest_edge" in _size_keys(processor)


def _size_keys(processor: Any) -> set[str]:
    size = getattr(processor.image_processor, "size", None)
    items = size.items() if isinstance(size, dict) else vars(size).items() if size is not None else ()
    return {k for k, v in items if v is not None}


def bound_pixels(processor: Any, family: str, min_pixels: int | None, max_pixels: int | None) -> None:
    """Give a Qwen-VL image processor --min-pixels / --max-pixels (the bounds of its dynamic
    resolution); --min-pixels for another family is an SFTError (its processor sizes images
    itself; --max-pixels still scales images down before it)."""
    if min_pixels is None and max_pixels is None:
        return
    if not is_dynamic_resolution(processor):
        if min_pixels is not None:
            raise SFTError(f"--min-pixels: {family}'s image processor resizes every image to its own size; "
                           "--min-pixels bounds Qwen-VL's dynamic resolution only")
        return
    ip = processor.image_processor
    size = dict(ip.size.items()) if isinstance(ip.size, dict) else {k: v for k, v in vars(ip.size).items() if v is not None}
    size["shortest_edge"] = min_pixels if min_pixels is not None else size["shortest_edge"]
    size["longest_edge"] = max_pixels if max_pixels is not None else size["longest_edge"]
    if size["shortest_edge"] > size["longest_edge"]:
        raise SFTError(f"--min-pixels {size['shortest_edge']} is more than --max-pixels {size['longest_edge']}")
    ip.size = {"shortest_edge": size["shortest_edge"], "longest_edge": size["longest_edge"]}
    for name in ("min_pixels", "max_pixels"):  # older image processors read these
        if hasattr(ip, name):
            setattr(ip, name, size["shortest_edge" if name == "min_pixels" else "longest_edge"])


def takes_video(processor: Any) -> bool:
    return getattr(processor, "video_token", None) is not None


def vision_token_ids(processor: Any) -> set[int]:
    """The ids of the tokens that stand for images or video or frame them: never scored."""
    tokenizer = processor.tokenizer
    ids = set()
    for name in ("image_token", "video_token", "boi_token", "eoi_token", "vision_start_token", "vision_end_token",
                 "fake_image_token", "global_image_token", "image_start_token", "image_end_token"):
        token = getattr(processor, name, None) or getattr(tokenizer, name, None)
        if isinstance(token, str):
            token_id = tokenizer.convert_tokens_to_ids(token)
            if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
                ids.add(token_id)
    for name in ("image_token_id", "video_token_id"):
        if isinstance(getattr(processor, name, None), int):
            ids.add(getattr(processor, name))
    return ids


# --- rows ---------------------------------------------------------------------------------------

@dataclass
class VisionEncoder:
    """Chats with images to token rows and batches, with one processor and image bounds."""

    processor: Any
    max_pixels: int | None = None
    image_size: int | None = None
    family: str | None = None  # the model type: how a video's frames are laid out (`vision_video`)

    def __post_init__(self) -> None:
        self.unscored = vision_token_ids(self.processor)

    def images(self, refs: tuple[Any, ...] | list[Any]) -> list[Any]:
        """`refs` (images, and videos as `VideoRef`s of frames) opened and bounded."""
        return [VideoRef(tuple(self.images(ref.frames)), ref.fps) if isinstance(ref, VideoRef)
                else bounded(open_image(ref), self.max_pixels, self.image_size) for ref in refs]

    def render(self, messages: Any, add_generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def inputs(self, texts: list[str], images: list[list[Any]]) -> Any:
        """The processor's batch of `texts` with their `images` (right-padded); with videos, the
        same batch with the videos' frames laid out by `vision_video`."""
        if any(isinstance(m, VideoRef) for row in images for m in row):
            return video_inputs(self.processor, self.family, texts, images)
        nested = images if any(images) else None
        return self.processor(text=texts, images=nested, padding=True, return_tensors="pt")

    def prompt(self, messages: Any, images: list[Any]) -> Any:
        """The processor's batch of one chat up to a generation prompt, with its (opened) images:
        what a model answering it is given."""
        return self.inputs([self.render(messages, True)], [images])

    def token_ids(self, text: str, images: list[Any]) -> list[int]:
        return self.inputs([text], [images])["input_ids"][0].tolist()

    def encode(self, sample: VisionSample, max_length: int) -> dict[str, Any] | None:
        """The row of `sample`: its ``input_ids`` (the processor's), ``labels`` (the assistant
        turns' tokens, IGNORE elsewhere and on every vision token), its rendered ``text`` and
        ``images``. Truncated to `max_length` unless that cuts an image's tokens (then None, as
        for a row left with nothing to learn)."""
        messages = sample.messages
        try:
            images = self.images(sample.images)
            full = self.render(messages, False)
            ids = self.token_ids(full, images)
            labels = [IGNORE] * len(ids)
            seen = 0  # images in the turns before the current one
            for i, message in enumerate(messages):
                if message["role"] == "assistant":
                    start = _common(ids, self.token_ids(self.render(messages[:i], True), images[:seen]))
                    through = self.token_ids(self.render(messages[: i + 1], False),
                                             images[: seen + _count_images(message)])
                    end = _common(ids, through)
                    end += end < len(through)  # the token that straddles the turn's end is the turn's
                    for j in range(start, min(end, len(ids))):
                        if ids[j] not in self.unscored:
                            labels[j] = ids[j]
                seen += _count_images(message)
        except SFTError:
            raise
        except Exception as err:  # a template or processor raises whatever its author chose
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise SFTError(f"{sample.where}: the processor failed on this row: {type(err).__name__}: {reason}") from None
        if len(ids) > max_length:
            if any(t in self.unscored for t in ids[max_length:]):
                return None  # an image's tokens cut in two would no longer match its pixels
            ids, labels = ids[:max_length], labels[:max_length]
        labels[0] = IGNORE
        if all(label == IGNORE for label in labels):
            return None
        return {"input_ids": ids, "labels": labels, "text": full, "images": tuple(sample.images)}

    def encode_all(self, samples: list[VisionSample], max_length: int, what: str) -> list[dict[str, Any]]:
        """Every sample's row; those with nothing to learn within `max_length` (or whose image
        tokens it would cut) dropped with a count."""
        rows = [self.encode(s, max_length) for s in samples]
        kept = [r for r in rows if r is not None]
        if len(kept) < len(rows):
            log.warning("%s: %d of %d samples have no assistant tokens within --max-length %d, or an image cut by "
                        "it: dropped", what, len(rows) - len(kept), len(rows), max_length)
        if not kept:
            raise SFTError(f"{what}: no sample has a trainable token (and whole images) within --max-length {max_length}")
        return kept


def _count_images(message: dict[str, Any]) -> int:
    """The images and videos in `message` (a sample's `images` holds both, in order)."""
    return sum(p.get("type") in ("image", "video") for p in message["content"])


def _common(a: list[int], b: list[int]) -> int:
    """The length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class VisionCollator:
    """A batch of rows as the model takes it: the processor run again over the rows' texts and
    images (so that pixels and image tokens always match, in any family's layout), cut back to the
    rows' (possibly truncated) lengths, with their labels, right-padded, and NUM_TOKENS."""

    def __init__(self, encoder: VisionEncoder):
        self.encoder = encoder

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        if "samples" in rows[0]:
            return self.packed(rows)
        batch = dict(self.encoder.inputs([r["text"] for r in rows], [self.encoder.images(r["images"]) for r in rows]))
        lengths = [len(r["input_ids"]) for r in rows]
        width = max(lengths)
        ids = batch["input_ids"]
        for i, row in enumerate(rows):
            if ids[i, : lengths[i]].tolist() != row["input_ids"]:
                raise ValueError(f"the processor tokenized row {i} of this batch otherwise than when the data was read")
        per_token = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.shape[:2] == ids.shape]
        for key in per_token:
            batch[key] = batch[key][:, :width].clone()
        lengths_t = torch.tensor(lengths)
        mask = torch.arange(width)[None, :] < lengths_t[:, None]
        batch["attention_mask"] = mask.long()
        batch["input_ids"] = torch.where(mask, batch["input_ids"], self.encoder.processor.tokenizer.pad_token_id)
        batch["labels"] = torch.tensor([r["labels"] + [IGNORE] * (width - n) for r, n in zip(rows, lengths)])
        batch[NUM_TOKENS] = sum(lengths)
        return batch

    def packed(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Packed rows (`batching.pack` with their samples kept): the processor run over every
        sample, each sample's tokens cut back to its length and laid end to end in its row, the
        rows right-padded with the padding as one more sample, ``position_ids`` restarting at
        each, and no attention mask: from those positions the model builds a block-diagonal
        causal mask (`pack_positions` adds Qwen-VL's 3-D ones)."""
        samples = [s for r in rows for s in r["samples"]]
        batch = dict(self.encoder.inputs([s["text"] for s in samples], [self.encoder.images(s["images"]) for s in samples]))
        ids = batch.pop("input_ids")
        batch.pop("attention_mask", None)
        per_token = {k: batch.pop(k) for k in [k for k, v in batch.items() if isinstance(v, torch.Tensor) and
                                               v.shape[:2] == ids.shape]}
        width = max(len(r["input_ids"]) for r in rows)
        pad_id = self.encoder.processor.tokenizer.pad_token_id
        laid: dict[str, list[torch.Tensor]] = {k: [] for k in ("input_ids", *per_token)}
        at = 0
        for i, row in enumerate(rows):
            spans = range(at, at + len(row["samples"]))
            at += len(row["samples"])
            short = width - len(row["input_ids"])
            for key, values in (("input_ids", ids), *per_token.items()):
                cut = [values[j, : samples[j]["length"]] for j in spans]
                laid[key].append(torch.cat([*cut, values.new_full((short, *values.shape[2:]),
                                                                  pad_id if key == "input_ids" else 0)]))
            if laid["input_ids"][-1][: len(row["input_ids"])].tolist() != row["input_ids"]:
                raise ValueError(f"the processor tokenized packed row {i} of this batch otherwise than when the data "
                                 "was read")
        batch.update({k: torch.stack(v) for k, v in laid.items()})
        batch["labels"] = torch.tensor([r["labels"] + [IGNORE] * (width - len(r["labels"])) for r in rows])
        batch["position_ids"] = torch.tensor([r["position_ids"] + list(range(width - len(r["position_ids"])))
                                              for r in rows])
        batch[NUM_TOKENS] = sum(len(r["input_ids"]) for r in rows)
        return batch


# --- model --------------------------------------------------------------------------------------

def load_vision_model(model_id: str, dtype: torch.dtype) -> torch.nn.Module:
    """The vision-language model in `dtype` (``AutoModelForImageTextToText``)."""
    from transformers import AutoModelForImageTextToText

    from tigon.train.modeling import _not_found, quiet_transformers, source_kwargs

    quiet_transformers()
    try:
        return AutoModelForImageTextToText.from_pretrained(model_id, dtype=dtype, attn_implementation="sdpa",
                                                           **source_kwargs(model_id))
    except (OSError, ValueError) as err:
        raise _not_found(model_id, err) from None


def _find(model: torch.nn.Module, names: tuple[str, ...], within: str = "") -> str | None:
    """The qualified name of the first module (under `within`) whose own name is one of `names`."""
    for name, _ in model.named_modules():
        if name.startswith(within) and name.rsplit(".", 1)[-1] in names:
            return name
    return None


@dataclass(frozen=True)
class Parts:
    """Where a vision-language model's parts are (qualified module names)."""

    tower: str | None
    projector: str | None
    language: str | None


def model_parts(model: torch.nn.Module) -> Parts:
    tower = _find(model, TOWERS)
    projector = _find(model, PROJECTORS)
    return Parts(tower, projector, _find(model, LANGUAGE_MODELS))


def _under(name: str, prefix: str | None) -> bool:
    return prefix is not None and (name == prefix or name.startswith(prefix + "."))


def freeze(model: torch.nn.Module, parts: Parts, freeze_vision: bool, freeze_projector: bool) -> None:
    """Stop the vision encoder's (less the projector) and/or the projector's weights training."""
    for name, param in model.named_parameters():
        in_projector = _under(name, parts.projector)
        if (freeze_projector and in_projector) or (freeze_vision and _under(name, parts.tower) and not in_projector):
            param.requires_grad_(False)


def lora_targets(model: torch.nn.Module, parts: Parts, cfg: SFTConfig) -> list[str]:
    """The linears LoRA adapts: the language model's (less the LM head), with the vision encoder's
    and the projector's when --no-freeze-vision / --no-freeze-projector; --target-modules names
    (q_proj,v_proj) keep only the linears so named among those."""
    names = None if cfg.target_modules == "all-linear" else {t.strip() for t in cfg.target_modules.split(",") if t.strip()}
    targets = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name.rsplit(".", 1)[-1] == "lm_head":
            continue
        in_projector = _under(name, parts.projector)
        in_tower = _under(name, parts.tower) and not in_projector
        scope = ((not cfg.freeze_projector) if in_projector else (not cfg.freeze_vision) if in_tower
                 else parts.language is None or _under(name, parts.language))
        if scope and (names is None or name.rsplit(".", 1)[-1] in names):
            targets.append(name)
    if not targets:
        raise SFTError(f"--target-modules {cfg.target_modules}: no linear layer of the language model has those names")
    return targets


# --- samples ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class VisionPrompt:
    """A chat up to its first assistant turn, with its images: asked before and after training.
    `shown` is what the log says of it."""

    messages: tuple[dict[str, Any], ...]
    images: tuple[ImageRef, ...]
    shown: str

    def __str__(self) -> str:
        return self.shown


def pick_vision_prompts(samples: list[VisionSample], n: int, label: Any = None) -> list[VisionPrompt]:
    """Up to `n` prompts with distinct texts or images; `label(sample)` (default: the image file
    names) describes each image in the log."""
    prompts: list[VisionPrompt] = []
    for s in samples:
        if len(prompts) == n:
            break
        first = next(i for i, m in enumerate(s.messages) if m["role"] == "assistant")
        messages = s.messages[:first]
        count = sum(_count_images(m) for m in messages)
        if not messages:
            continue
        images = s.images[:count]
        names = label(s) if label else ", ".join(r.name if isinstance(r, Path) else "video" if isinstance(r, VideoRef)
                                                 else "image" for r in images)
        text = " ".join("".join(p.get("text", "") for p in m["content"] if p["type"] == "text") for m in messages)
        prompt = VisionPrompt(messages, images, f"[{names}] {text.strip()}" if names else text.strip())
        if all(p.shown != prompt.shown for p in prompts):
            prompts.append(prompt)
    return prompts


@torch.no_grad()
def vision_generate(model: Any, encoder: VisionEncoder, prompt: VisionPrompt, max_new_tokens: int,
                    temperature: float = 0.0) -> str:
    """The model's answer to `prompt` (its chat and images), greedy at `temperature` 0."""
    inputs = encoder.prompt(prompt.messages, encoder.images(prompt.images)).to(next(model.parameters()).device)
    was_training = model.training
    model.eval()
    tokenizer = encoder.processor.tokenizer
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    try:
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, use_cache=True,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **sampling)
    finally:
        model.train(was_training)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def image_files(paths: list[str], flag: str = "--image") -> list[ImageRef]:
    """The image files `paths` (relative to the working directory), each opened once to check it
    decodes; what is wrong is an SFTError naming `flag` and the path."""
    refs = []
    for path in paths:
        try:
            ref = image_ref(path, Path.cwd())
            open_image(ref)
        except (ValueError, OSError) as err:  # PIL's errors are OSErrors
            raise SFTError(f"{flag} {path}: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
        refs.append(ref)
    return refs


def vision_config_of(path: str, base: str | None = None) -> Any:
    """The config of the model in `path` (of its base, for a LoRA adapter) when it is a
    vision-language model's, else None."""
    from tigon.train.infer import _adapter_base, is_adapter

    return vision_config((base or _adapter_base(path)) if is_adapter(path) else path)


def vision_config(model_id: str) -> Any:
    """`model_id`'s config if it is a vision-language model's, else None."""
    config = model_config(model_id)
    return config if is_vision_config(config) else None


def load_vision_for_inference(path: str, dtype: torch.dtype, base: str | None = None,
                              what: str = "--image") -> tuple[Any, VisionEncoder]:
    """The vision-language model in `path` (a model directory, or a LoRA adapter merged on its
    base) in eval mode on the GPU if there is one, and an encoder over its processor (the
    adapter's, else the base's). A text-only model is an SFTError naming `what`."""
    from tigon.train.infer import _adapter_base, is_adapter, load_for_inference

    adapter = is_adapter(path)
    source = (base or _adapter_base(path)) if adapter else path
    config = vision_config(source)
    if config is None:
        raise SFTError(f"{what}: {path} is not a vision-language model (its config has no vision_config)")
    if adapter:
        model, _ = load_for_inference(path, dtype, base, dequantize=True)
        model = model.merge_and_unload()
    else:
        model = load_vision_model(path, dtype)
    has_processor = any((Path(path) / name).is_file() for name in ("processor_config.json", "preprocessor_config.json"))
    processor = load_processor(path if has_processor else source, config)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return model.to(device).eval(), VisionEncoder(processor)


def user_turn(text: str, images: int) -> dict[str, Any]:
    """A user message in the processors' form: `images` image parts, then the text."""
    return {"role": "user", "content": [*({"type": "image"} for _ in range(images)), {"type": "text", "text": text}]}


def answer_about_images(model_id: str, prompts: list[str], images: list[str], dtype: torch.dtype,
                        max_new_tokens: int) -> list[str]:
    """`tigon infer MODEL --image PATH`: the vision-language model in `model_id` (a saved model
    directory) answers each prompt about `images` (files, shown in order before the prompt),
    greedily. Every image is opened before the model loads; what is wrong is an SFTError."""
    if vision_config_of(model_id) is None:
        raise SFTError(f"--image: {model_id} is not a vision-language model (its config has no vision_config)")
    refs = image_files(images)
    model, encoder = load_vision_for_inference(model_id, dtype)
    return [vision_generate(model, encoder, VisionPrompt((user_turn(prompt, len(refs)),), tuple(refs), prompt),
                            max_new_tokens) for prompt in prompts]


# How a family's packed rows take their positions: "text", 1-D, restarting at each sample (the
# model builds its block-diagonal mask from them); "mrope", Qwen-VL's 3-D ones as well, under
# those (`pack_positions`). A family not here is refused --packing.
PACKING = {"qwen2_vl": "mrope", "qwen2_5_vl": "mrope", "qwen3_vl": "mrope", "qwen3_vl_moe": "mrope", "llava": "text"}


def packing_refusal(family: str) -> SFTError:
    return SFTError(f"--packing: rows with images cannot be packed exactly for {family} yet (packing takes "
                    f"{', '.join(PACKING)}): train without --packing")


def pack_positions(model: torch.nn.Module) -> Any:
    """Make `model` (of a family in PACKING) take packed rows: a forward pre-hook on its inner
    model runs a packed batch (1-D ``position_ids`` restarting at each sample) without a cache,
    which would keep the model from building the block-diagonal mask from those positions; for
    Qwen-VL ("mrope") it also puts them over the 3-D positions, as Qwen-VL takes packed rows. The
    3-D ones are the model's own for the whole row, each sample's shifted back by its first
    token's: exactly the sample's alone, since the model starts every sample after the last one's
    largest position. Steps aside in generation (a cache) and where positions are not 1-D.
    Returns the hook's handle."""
    import inspect

    inner = next(m for m in model.modules() if hasattr(m, "language_model") and m is not model and
                 not hasattr(m, "lm_head"))
    mrope = PACKING[model.config.model_type] == "mrope"
    takes = set(inspect.signature(inner.get_rope_index).parameters) if mrope else set()

    def packed(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        text = kwargs.get("position_ids")
        if text is None or text.ndim != 2 or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            return None
        if not mrope:
            return args, {**kwargs, "use_cache": False}
        given = {k: kwargs.get(k) for k in ("input_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts",
                                            "mm_token_type_ids") if k in takes}
        if given.get("image_grid_thw") is None and given.get("video_grid_thw") is None:
            row = text[None].expand(3, -1, -1)
        else:
            row = inner.get_rope_index(**given, attention_mask=None)[0].to(text.device)
        tokens = torch.arange(text.shape[1], device=text.device).expand_as(text)
        starts = torch.where(text == 0, tokens, 0).cummax(-1).values  # each token's sample's first token
        own = row - row.gather(-1, starts[None].expand_as(row))
        return args, {**kwargs, "position_ids": torch.cat([text[None], own]), "use_cache": False}

    return inner.register_forward_pre_hook(packed, with_kwargs=True)
