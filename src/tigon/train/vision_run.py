"""`tigon sft` on a vision-language model: the run's stages (`tigon.train.run`) with the model's
processor in place of a tokenizer, image + text rows (`tigon.train.vision_data`), the model built
by `build_vision_model`, and answers about images before and after training. Everything that can
be wrong with the settings, data and images is found before the output directory is touched."""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from tigon.train import tiny_vlm
from tigon.train.batching import TokenDataset, pack
from tigon.train.config import VISION_KEYS, SFTConfig, SFTError, check_sequence_parallel
from tigon.train.run import (BASE_DIR, Built, Job, split_off, start, train, training_arguments)
from tigon.train.trainer import TOKEN_ACCURACY, TigonTrainer
from tigon.train.vision import (VisionCollator, VisionEncoder, bound_pixels, freeze, is_vision_config, load_processor,
                                load_vision_model, lora_targets, model_config, model_parts, PACKING, pack_positions, packing_refusal,
                                pick_vision_prompts, takes_video, vision_generate)
from tigon.train.vision_data import VisionSample, check_videos, load_vision_samples
from tigon.train.vision_video import VIDEO_LAYOUTS

log = logging.getLogger("tigon.train")

BUILTIN_ROWS = 480  # the shapes task's training rows (each shape and colour 40 times)
HELD_OUT_ROWS = 12  # its held-out rows (each shape and colour once), asked before and after
BUILTIN_NAME = "built-in tiny Qwen2-VL"


def wants_vision(cfg: SFTConfig) -> bool:
    """Whether `cfg` is a vision-language run: --modality vision, or a --model whose config has a
    vision_config (a model that cannot be read is left to the text run to report)."""
    if cfg.modality is not None or cfg.model is None:
        return cfg.modality == "vision"
    try:
        return is_vision_config(model_config(cfg.model))
    except SFTError:
        return False


def check_text_run(cfg: SFTConfig) -> None:
    """Refuse, in one line, the vision settings on a text-only run."""
    given = [k for k in VISION_KEYS if k != "modality" and getattr(cfg, k) is not None]
    if given:
        what = cfg.model or "the built-in model (--modality vision: the built-in vision-language one)"
        raise SFTError(f"--{given[0].replace('_', '-')}: only for vision-language models, and {what} is text-only")


def vision_family(cfg: SFTConfig) -> tuple[str, Any]:
    """The model's family and config (the built-in one's: qwen2_vl, None); an SFTError for a
    --model that is text-only."""
    if cfg.model is None:
        return "qwen2_vl", None
    config = model_config(cfg.model)
    if not is_vision_config(config):
        raise SFTError(f"--modality vision: {cfg.model} is a text-only model (its config has no vision_config)")
    return config.model_type, config


def vision_settings(cfg: SFTConfig) -> tuple[Any, str, Any]:
    """`cfg` with the vision defaults filled (the tower and projector frozen with LoRA), the
    model's family and config (`vision_family`), the settings checked (`check_vision_settings`)."""
    lora = cfg.tuner == "lora"
    cfg = dataclasses.replace(cfg, modality="vision",
                              freeze_vision=lora if cfg.freeze_vision is None else cfg.freeze_vision,
                              freeze_projector=lora if cfg.freeze_projector is None else cfg.freeze_projector)
    family, config = vision_family(cfg)
    check_vision_settings(cfg, family)
    return cfg, family, config


def check_vision_settings(cfg: SFTConfig, family: str) -> None:
    """Refuse, in one line, the settings a vision-language run does not take."""
    check_sequence_parallel(cfg)
    if cfg.packing and family not in PACKING:
        raise packing_refusal(family)
    if cfg.quant is not None:
        raise SFTError(f"--quant {cfg.quant}: tigon sft does not quantise vision-language models yet; train without "
                       "--quant")
    if cfg.cuda_graphs:
        raise SFTError("--cuda-graphs: batches with images change shape with every image's size; train without "
                       "--cuda-graphs")
    for name in ("offload_activations", "tiled_mlp", "recompute_mlp"):
        if getattr(cfg, name):
            raise SFTError(f"--{name.replace('_', '-')}: not for vision-language models yet (tigon.patch applies it "
                           "to text families)")


def _data(cfg: SFTConfig) -> tuple[list[VisionSample], list[VisionSample]]:
    """The training and evaluation rows: the data files', or the shapes task's."""
    if cfg.dataset:
        samples = load_vision_samples(cfg.dataset, cfg.seed, cfg.max_pixels)
    else:
        samples = tiny_vlm.shapes_task(BUILTIN_ROWS, cfg.seed)
        log.info("data: the synthetic shapes task: %d rows (a %s, %s shape; what shape and colour is it?)",
                 len(samples), "/".join(tiny_vlm.COLOURS), "/".join(tiny_vlm.SHAPES))
    if cfg.eval_dataset:
        return samples, load_vision_samples(cfg.eval_dataset, cfg.seed, cfg.max_pixels)
    if cfg.eval_split:
        return split_off(samples, cfg.eval_split, cfg.seed)
    return samples, []


def build_vision_model(cfg: SFTConfig, processor: Any, dtype: torch.dtype, args: Any,
                       resume_from: Path | None, reference: bool = False) -> Built:
    """The model stage for a vision-language model: loaded (or the built-in one built), its vision
    encoder and projector frozen as asked, LoRA on the language model's linears (and theirs, when
    not frozen), tigon's kernels where tigon.patch takes the family. With `reference`, also a
    frozen copy of the weights as loaded (patched too, in eval mode)."""
    from tigon.train.modeling import add_lora, apply_kernels, count_parameters

    builtin = cfg.model is None
    model = tiny_vlm.build_model(processor, cfg.seed).to(dtype) if builtin else load_vision_model(cfg.model, dtype)
    base_model = None
    if builtin and cfg.tuner == "lora":
        # The adapter needs its base on disk to be loadable, and a resumed run the same base.
        base = Path(cfg.output_dir) / BASE_DIR
        if resume_from is not None and base.is_dir():
            model = load_vision_model(str(base), dtype)
        model.name_or_path = str(base.resolve())
        base_model = copy.deepcopy(model)
    use_cache = getattr(model.config, "use_cache", True)
    model.config.use_cache = False
    copied = copy.deepcopy(model).eval().requires_grad_(False) if reference else None  # before LoRA and patching
    parts = model_parts(model)
    if parts.tower is None:
        log.warning("model: no vision encoder found by name (%s): --freeze-vision has nothing to freeze",
                    type(model).__name__)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.tuner == "lora":
        targets = lora_targets(model, parts, cfg)
        model = add_lora(model, dataclasses.replace(cfg, target_modules=",".join(targets)))
    else:
        freeze(model, parts, cfg.freeze_vision, cfg.freeze_projector)
    trainable, total = count_parameters(model)
    frozen = [what for what, on in (("vision encoder", cfg.freeze_vision), ("projector", cfg.freeze_projector)) if on]
    log.info("model: %s, %s, %s tuning%s: %.2fM of %.2fM parameters trainable", cfg.model or BUILTIN_NAME,
             str(dtype).replace("torch.", ""), cfg.tuner, f" ({' and '.join(frozen)} frozen)" if frozen else "",
             trainable / 1e6, total / 1e6)
    if cfg.packing:
        pack_positions(model)
    apply_kernels(model, cfg)  # (a family tigon.patch lacks trains without them, said in one line)
    model.to(args.device)
    if copied is not None:
        apply_kernels(copied, cfg, role="the frozen reference")
        copied.to(args.device)
    return Built(model, base_model, use_cache, copied)


def run_vision(cfg: SFTConfig) -> Path:
    """`tigon sft` for a vision-language model (`cfg` resolved): the built-in one on the shapes
    task without --model (or any model on it without --dataset)."""
    builtin = cfg.model is None
    cfg, family, config = vision_settings(cfg)
    resume_from = start(cfg)
    samples, eval_samples = _data(cfg)
    processor = tiny_vlm.build_processor() if builtin else load_processor(cfg.model, config)
    bound_pixels(processor, family, cfg.min_pixels, cfg.max_pixels)
    check_videos(samples + eval_samples, family, takes_video(processor), tuple(VIDEO_LAYOUTS))
    encoder = VisionEncoder(processor, cfg.max_pixels, cfg.image_size, family)
    train_rows = encoder.encode_all(samples, cfg.max_length, "training data")
    eval_rows = encoder.encode_all(eval_samples, cfg.max_length, "evaluation data") if eval_samples else None
    log.info("tokens: %d training rows, %d images and videos, %d tokens, max length %d", len(train_rows),
             sum(len(r["images"]) for r in train_rows), sum(len(r["input_ids"]) for r in train_rows), cfg.max_length)
    if cfg.packing:
        train_rows, eval_rows = (pack(rows, cfg.max_length, cfg.seed, keep=("text", "images")) if rows else rows
                                 for rows in (train_rows, eval_rows))
        log.info("packing: into %d rows of up to %d tokens", len(train_rows), cfg.max_length)
    train_data = TokenDataset(train_rows)
    eval_data = TokenDataset(eval_rows) if eval_rows else None
    collator = VisionCollator(encoder)

    def trainer(built: Built, args: Any) -> TigonTrainer:
        return TigonTrainer(model=built.model, args=args, train_dataset=train_data, eval_dataset=eval_data,
                            data_collator=collator, processing_class=processor, save_limit=cfg.save_limit,
                            token_accuracy=True)

    def prompts() -> list[Any]:
        if cfg.dataset:
            return pick_vision_prompts(samples, cfg.samples)
        held_out = tiny_vlm.shapes_task(HELD_OUT_ROWS, cfg.seed + 1)
        return pick_vision_prompts(held_out, cfg.samples, label=tiny_vlm.drawn)

    job = Job("sft", train_data, train_data.num_tokens(), len(train_data),
              arguments=lambda dtype: training_arguments(cfg, dtype, eval_data is not None), trainer=trainer,
              prompts=prompts, metrics={TOKEN_ACCURACY: "acc"},
              build=lambda dtype, args, resume: build_vision_model(cfg, processor, dtype, args, resume),
              answer=lambda model, prompt: vision_generate(model, encoder, prompt, cfg.max_new_tokens))
    return train(cfg, resume_from, processor, job)
