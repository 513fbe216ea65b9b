"""`tigon rlhf --method grpo` on a vision-language model: TRL's GRPOTrainer samples answers to
prompts that show images (the processor as its processing class: each prompt's images go into
generation) and tigon's fused policy loss scores them through the language head, its forward
given the same pixels (`tigon.train.grpo.TigonGRPOTrainer`).

With no --model the policy is the built-in tiny Qwen2-VL (random weights: its answers rarely name a
colour, so the default shows the pipeline, not learning). The prompts are the shapes task's images
asked "What colour is the shape?", rewarded 1 where the answer names the colour drawn
(`names_answer`) or by --reward-funcs. Prompt files with images are not read yet: --dataset is
refused."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from tigon.train import tiny_vlm
from tigon.train.config import RLHFConfig, SFTError
from tigon.train.grpo import GRPO, _completions
from tigon.train.rewards import load_rewards, text_of
from tigon.train.run import Built, Job, start, train
from tigon.train.vision import VisionEncoder, bound_pixels, load_processor, pick_vision_prompts, vision_generate
from tigon.train.vision_data import VisionSample
from tigon.train.vision_run import build_vision_model, vision_settings

log = logging.getLogger("tigon.train")

BUILTIN_PROMPTS = 48  # the shapes task's images (each shape and colour 4 times)
HELD_OUT_ROWS = 12
COLOUR_QUESTION = "What colour is the shape?"


def names_answer(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float]:
    """1 where the completion names the row's answer as a word of its own (any case), else 0."""
    return [float(re.search(rf"\b{re.escape(str(a).lower())}\b", text_of(c).lower()) is not None)
            for c, a in zip(completions, answer)]


def colour_samples(n: int, seed: int) -> list[VisionSample]:
    """`n` shapes-task images asked their colour, the colour as the answer."""
    samples = []
    for sample in tiny_vlm.shapes_task(n, seed):
        colour = tiny_vlm.drawn(sample).split(" ")[1]
        samples.append(VisionSample(sample.where, (
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": COLOUR_QUESTION}]},
            {"role": "assistant", "content": [{"type": "text", "text": colour}]}), sample.images))
    return samples


def check(cfg: RLHFConfig) -> None:
    """What GRPO with images does not do yet, refused in one line."""
    if cfg.dataset or cfg.eval_dataset:
        raise SFTError("--dataset: tigon rlhf --method grpo reads no prompt files with images yet; leave it out for "
                       "the built-in shapes task")
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
    samples = colour_samples(BUILTIN_PROMPTS, cfg.seed)
    rows = [{"prompt": [{"role": "user", "content": COLOUR_QUESTION}], "images": encoder.images(s.images),
             "answer": s.messages[1]["content"][0]["text"]} for s in samples]
    log.info("data: the synthetic shapes task's images asked their colour: %d prompts (%s); reward: %s",
             len(rows), "/".join(tiny_vlm.COLOURS), ", ".join(r.spec for r in rewards) or "names the right colour")
    from datasets import Dataset

    train_data = Dataset.from_list(rows)

    def trainer(built: Built, args: Any) -> Any:
        return GRPO.trainer(model=built.model, reward_funcs=reward_fns, args=args, train_dataset=train_data,
                            processing_class=processor, save_limit=cfg.save_limit)

    def prompts() -> list[Any]:
        return pick_vision_prompts(colour_samples(HELD_OUT_ROWS, cfg.seed + 1), cfg.samples, label=tiny_vlm.drawn)

    completions = _completions(len(rows), cfg, 1)
    prompt_tokens = len(encoder.token_ids(encoder.render(samples[0].messages[:1], True), encoder.images(samples[0].images)))
    job = Job("rlhf", train_data, (prompt_tokens + cfg.max_completion_length) * completions, completions,
              arguments=lambda dtype: GRPO.arguments(cfg, dtype, False), trainer=trainer, prompts=prompts,
              metrics={**GRPO.metrics, **{f"rewards/{getattr(fn, '__name__', 'reward')}/mean": "" for fn in reward_fns}},
              build=lambda dtype, args, resume: build_vision_model(cfg, processor, dtype, args, resume),
              answer=lambda model, prompt: vision_generate(model, encoder, prompt, cfg.max_new_tokens))
    return train(cfg, resume_from, processor, job)
