"""`tigon rlhf --method grpo` on a vision-language model: TRL's GRPOTrainer samples answers to
prompts that show images (the processor as its processing class: each prompt's images go into
generation) and tigon's fused policy loss scores them through the language head, its forward
given the same pixels (`tigon.train.grpo.TigonGRPOTrainer`).

Data: rows of a ``prompt`` (a text with one ``<image>`` per image, or messages with image parts)
with an ``images`` list (paths relative to the file, ``data:`` URLs, bytes; read and checked as
`tigon sft` reads them; a prompt without placeholders shows its images before its first user turn's
text), and whatever other columns the reward functions read (``answer`` for the default reward).

With no --model the policy is the built-in tiny Qwen2-VL (random weights) and with no --dataset
the prompts are the shapes task's images asked "What colour is the shape?". The default reward is 1
where the answer names the row's ``answer`` as a word and, when the row lists ``choices``, no other
of them (`names_answer`)."""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tigon.train import tiny_vlm
from tigon.train.config import RLHFConfig, SFTError
from tigon.train.grpo import GRPO, _columns, _completions
from tigon.train.rewards import load_rewards, text_of
from tigon.train.run import Built, Job, start, train
from tigon.train.vision import VisionEncoder, bound_pixels, load_processor, pick_vision_prompts, vision_generate
from tigon.train.vision_data import VisionSample
from tigon.train.vision_rlhf import _prompt, prompt_images, read_image_rows
from tigon.train.vision_run import build_vision_model, vision_settings

log = logging.getLogger("tigon.train")

BUILTIN_PROMPTS = 48  # the shapes task's images (each shape and colour 4 times)
HELD_OUT_ROWS = 12
COLOUR_QUESTION = "What colour is the shape?"


def _named(word: Any, text: str) -> bool:
    return re.search(rf"\b{re.escape(str(word).lower())}\b", text) is not None


def names_answer(prompts: list, completions: list, answer: list, choices: list | None = None,
                 **kwargs: Any) -> list[float | None]:
    """1 where the completion names the row's answer as a word of its own (any case) and, when the
    row lists `choices`, no other of them (naming every colour earns nothing); else 0. None
    (unscored) for a row without an answer."""
    scores: list[float | None] = []
    for i, (completion, right) in enumerate(zip(completions, answer)):
        text = text_of(completion).lower()
        wrong = [c for c in (choices[i] if choices and choices[i] else []) if str(c).lower() != str(right).lower()]
        scores.append(None if right is None else float(_named(right, text) and not any(_named(c, text) for c in wrong)))
    return scores


def colour_samples(n: int, seed: int) -> list[VisionSample]:
    """`n` shapes-task images asked their colour, the colour as the answer."""
    samples = []
    for sample in tiny_vlm.shapes_task(n, seed):
        colour = tiny_vlm.drawn(sample).split(" ")[1]
        samples.append(VisionSample(sample.where, (
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": COLOUR_QUESTION}]},
            {"role": "assistant", "content": [{"type": "text", "text": colour}]}), sample.images))
    return samples


@dataclass(frozen=True)
class ImagePrompt(VisionSample):
    """A prompt with images (`messages`: the turns the answer follows) and the row's other columns."""

    columns: dict[str, Any] = dataclasses.field(default_factory=dict)


def _from_prompt(row: dict) -> ImagePrompt:
    sources: list[Any] = []
    prompt = _prompt(row["prompt"], "prompt", sources)
    images, videos = prompt_images(row, prompt, sources)
    others = {k: v for k, v in row.items() if k not in ("images", "videos")}  # the media are read above
    return ImagePrompt("", tuple(prompt), images, videos, _columns(others, ("prompt",)))


FORMATS = [("prompt + images (+ columns)", ("prompt",), _from_prompt)]


def load_image_prompts(specs: list[str], seed: int, max_pixels: int | None) -> list[ImagePrompt]:
    """The rows of every file in `specs`, their images found and checked; a video refused."""
    items = read_image_rows(specs, seed, FORMATS, max_pixels)
    video = next((item for item in items if item.videos), None)
    if video is not None:
        raise SFTError(f"{video.where}: a video: tigon rlhf trains on images only; give the video's frames as images")
    return items


def check(cfg: RLHFConfig) -> None:
    """What GRPO with images does not do yet, refused in one line."""
    if cfg.eval_dataset or cfg.eval_split:
        raise SFTError("--eval-dataset / --eval-split: tigon rlhf --method grpo does not evaluate on images yet; leave "
                       "them out")
    if cfg.use_vllm:
        raise SFTError("--use-vllm: tigon rlhf --method grpo samples vision-language models with transformers' "
                       "generate only; leave it out")
    if cfg.beta and cfg.tuner != "lora":
        raise SFTError(f"--beta {cfg.beta}: a full fine-tune of a vision-language model has no reference model here; "
                       "use --tuner lora (the adapter switched off) or --beta 0")


def run(cfg: RLHFConfig) -> Path:
    """`tigon rlhf --method grpo` for a vision-language model (`cfg` resolved)."""
    check(cfg)
    cfg, family, config = vision_settings(cfg)
    resume_from = start(cfg)
    rewards = load_rewards(cfg.reward_funcs, cfg.format_regex, cfg.max_completion_length) if cfg.reward_funcs else []
    reward_fns = [r.fn for r in rewards] or [names_answer]
    processor = tiny_vlm.build_processor() if cfg.model is None else load_processor(cfg.model, config)
    bound_pixels(processor, family, cfg.min_pixels, cfg.max_pixels)
    encoder = VisionEncoder(processor, cfg.max_pixels, cfg.image_size)
    if cfg.dataset:
        samples = load_image_prompts(cfg.dataset, cfg.seed, cfg.max_pixels)
    else:
        samples = [ImagePrompt(s.where, s.messages[:1], s.images, columns={
            "answer": s.messages[1]["content"][0]["text"], "choices": list(tiny_vlm.COLOURS)})
            for s in colour_samples(BUILTIN_PROMPTS, cfg.seed)]
        log.info("data: the synthetic shapes task's images asked their colour: %d prompts (%s)", len(samples),
                 "/".join(tiny_vlm.COLOURS))
    names = sorted({k for s in samples for k in s.columns})
    if not rewards and "answer" not in names:
        raise SFTError(f"{cfg.dataset[0]}: no answer column for the default reward (the answer named); add one, or "
                       "give --reward-funcs")
    # TRL fills each image part of a prompt from the row's images, in order.
    rows = [{"prompt": list(s.messages), "images": encoder.images(s.images), **{k: s.columns.get(k) for k in names}}
            for s in samples]
    log.info("reward: %s", ", ".join(r.spec for r in rewards) or "names the answer column's word")
    from datasets import Dataset

    train_data = Dataset.from_list(rows)

    def trainer(built: Built, args: Any) -> Any:
        return GRPO.trainer(model=built.model, reward_funcs=reward_fns, args=args, train_dataset=train_data,
                            processing_class=processor, save_limit=cfg.save_limit)

    def prompts() -> list[Any]:
        if cfg.dataset:
            return pick_vision_prompts([dataclasses.replace(s, messages=(*s.messages, {"role": "assistant"}))
                                        for s in samples], cfg.samples)
        return pick_vision_prompts(colour_samples(HELD_OUT_ROWS, cfg.seed + 1), cfg.samples, label=tiny_vlm.drawn)

    completions = _completions(len(rows), cfg, 1)
    prompt_tokens = len(encoder.token_ids(encoder.render(samples[0].messages, True), encoder.images(samples[0].images)))
    job = Job("rlhf", train_data, (prompt_tokens + cfg.max_completion_length) * completions, completions,
              arguments=lambda dtype: GRPO.arguments(cfg, dtype, False), trainer=trainer, prompts=prompts,
              metrics={**GRPO.metrics, **{f"rewards/{getattr(fn, '__name__', 'reward')}/mean": "" for fn in reward_fns}},
              build=lambda dtype, args, resume: build_vision_model(cfg, processor, dtype, args, resume),
              answer=lambda model, prompt: vision_generate(model, encoder, prompt, cfg.max_new_tokens))
    return train(cfg, resume_from, processor, job)
