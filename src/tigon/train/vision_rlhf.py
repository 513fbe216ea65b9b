"""`tigon rlhf` on a vision-language model: preference pairs (KTO: judged answers) whose prompt
shows images, which the chosen and the rejected answer share, trained on TRL's trainers as the
text methods are (`tigon.train.rlhf`: dpo, ipo, kto, orpo, simpo, cpo, the loss tigon's fused
`linear_preference_loss` on the language head) with TRL's vision collators making the batches:
the processor expands each image into its tokens, and only the answers' tokens are scored (never
an image's, the prompt's or padding).

Rows: tigon rlhf's layouts (prompt/chosen/rejected, chosen/rejected chats, messages +
rejected_response or rejected_messages, KTO's prompt/completion/label) with an ``images`` list, one
image per ``<image>`` placeholder of the prompt in order, or OpenAI messages with image parts. A
prompt with neither placeholders nor image parts shows its images before the first user turn's
text (TRL's convention). Images are read as `tigon sft` reads them (`tigon.train.vision_data`).

With no --model the policy is the built-in tiny Qwen2-VL after its sft stage (`tigon sft --modality
vision`, into OUTPUT_DIR/sft), and with no --dataset the shapes task's pairs: the right shape and
colour chosen, a wrong one rejected."""

from __future__ import annotations

import copy
import dataclasses
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from transformers import set_seed
from trl.trainer.dpo_trainer import DataCollatorForVisionPreference
from trl.trainer.kto_trainer import DataCollatorForVisionUnpairedPreference

from tigon.train import preference, tiny_vlm
from tigon.train.batching import NUM_TOKENS
from tigon.train.builtin import builtin_after_sft
from tigon.train.config import PREFERENCE_METHODS, REFERENCE_METHODS, RLHFConfig, SFTError
from tigon.train.data import RowError, read_file, turn_list
from tigon.train.preference import Judged, Pair
from tigon.train.rlhf import (KTO_METRICS, PAIRED_METRICS, TigonDPOTrainer, TigonKTOTrainer, loss_options,
                              trl_arguments)
from tigon.train.run import Built, Job, split_off, start, train
from tigon.train.vision import VisionEncoder, bound_pixels, load_processor, pick_vision_prompts, vision_generate
from tigon.train.vision_data import (VideoRef, VisionSample, content_parts, count_parts, listed_media, matched_images,
                                     resolve_images)
from tigon.train.vision_run import build_vision_model, vision_settings

log = logging.getLogger("tigon.train")

BUILTIN_PAIRS = 192  # the shapes task's preference pairs (each shape and colour 16 times)
HELD_OUT_ROWS = 12  # its held-out prompts, answered before and after


@dataclass(frozen=True)
class VisionPair(Pair):
    """A preference pair whose prompt shows `images` (its image parts' sources, in order)."""

    images: tuple[Any, ...] = ()
    videos: int = 0


@dataclass(frozen=True)
class VisionJudged(Judged):
    """KTO's judged answer to a prompt that shows `images`."""

    images: tuple[Any, ...] = ()
    videos: int = 0


# --- rows ---------------------------------------------------------------------------------------

def _turns(value: Any, key: str, sources: list[Any], role: str) -> list[dict[str, Any]]:
    """Messages with parts (a list, or a CSV cell holding one), or a text as one `role` turn."""
    if isinstance(value, str) and not value.lstrip().startswith("["):
        return [{"role": role, "content": content_parts(sources)(value, key)}]
    return turn_list(value, key, content=content_parts(sources))


def _answer(value: Any, key: str) -> tuple[dict[str, Any], ...]:
    shown: list[Any] = []
    turns = preference._answer(_turns(value, key, shown, "assistant"), key)
    if shown or count_parts(turns, "image"):
        raise RowError(f"{key} holds an image: a row's images belong to its prompt, which both answers share")
    return turns


def _prompt(value: Any, key: str, sources: list[Any]) -> list[dict[str, Any]]:
    turns = _turns(value, key, sources, "user")
    if turns[-1]["role"] == "assistant":
        raise RowError(f"{key} ends with an assistant turn; the answers go in the answer fields")
    return turns


def _chats(first: str, second: str) -> Callable[[dict, list[Any]], tuple[list[dict[str, Any]], dict[str, Any]]]:
    """Two whole chats: the turns they share are the prompt (its images the first chat's)."""

    def split(row: dict, sources: list[Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        others: list[Any] = []
        chosen, rejected = _turns(row[first], first, sources, "user"), _turns(row[second], second, others, "user")
        pair = preference._shared_prompt(chosen, rejected, (first, second))
        if count_parts(pair.chosen + pair.rejected, "image"):
            raise RowError(f"{first} and {second} hold images in their answers: a row's images belong to its prompt")
        if others != sources:
            raise RowError(f"{first} and {second} show different images in the prompt they share")
        return list(pair.prompt), {"chosen": pair.chosen, "rejected": pair.rejected}

    return split


def _prompt_chosen_rejected(row: dict, sources: list[Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    return _prompt(row["prompt"], "prompt", sources), {k: _answer(row[k], k) for k in ("chosen", "rejected")}


def _messages_rejected_response(row: dict, sources: list[Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    messages = _turns(row["messages"], "messages", sources, "user")
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        raise RowError("messages must hold a prompt and end with the chosen answer (an assistant turn)")
    return messages[:-1], {"chosen": _answer(messages[-1:], "messages"),
                           "rejected": _answer(row["rejected_response"], "rejected_response")}


def _kto(row: dict, sources: list[Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    return (_prompt(row["prompt"], "prompt", sources),
            {"completion": _answer(row["completion"], "completion"), "label": preference._label(row["label"])})


def prompt_images(row: dict, prompt: list[dict[str, Any]], sources: list[Any]) -> tuple[tuple[Any, ...], int]:
    """The images of `row`'s `prompt` (its image parts' `sources`, or the row's images list, put
    before the first user turn's text when the prompt has no placeholder: `prompt` is changed in
    place) and its number of videos; a RowError when they do not match."""
    listed, listed_videos = listed_media(row)
    videos = len(listed_videos) + count_parts(prompt, "video")
    sources = [s for s in sources if not isinstance(s, VideoRef)]  # counted above, refused by the caller
    slots = count_parts(prompt, "image")
    if not slots and (listed or sources):
        first = next((i for i, m in enumerate(prompt) if m["role"] == "user"), None)
        if first is None:
            raise RowError("has images but its prompt has no user turn to show them in")
        n = len(listed or sources)
        prompt[first] = {**prompt[first], "content": [{"type": "image"}] * n + prompt[first]["content"]}
        slots = n
    return matched_images(slots, sources, listed), videos


def _with_images(split: Callable[[dict, list[Any]], tuple[list[dict[str, Any]], dict[str, Any]]]) -> Callable[[dict], Any]:
    """A layout's converter: its prompt and answers, with the row's images matched to the prompt's
    placeholders or image parts (put before the first user turn's text when it has none)."""

    def converted(row: dict) -> VisionPair | VisionJudged:
        sources: list[Any] = []
        prompt, answers = split(row, sources)
        images, videos = prompt_images(row, prompt, sources)
        if "label" in answers:
            return VisionJudged("", tuple(prompt), answers["completion"], answers["label"], images, videos)
        return VisionPair("", tuple(prompt), answers["chosen"], answers["rejected"], images=images, videos=videos)

    return converted


FORMATS = [
    ("ms-swift messages + rejected_response with images", ("messages", "rejected_response"),
     preference._pair_format(_with_images(_messages_rejected_response))),
    ("ms-swift messages + rejected_messages with images", ("messages", "rejected_messages"),
     preference._pair_format(_with_images(_chats("messages", "rejected_messages")))),
    ("KTO prompt/completion/label with images", ("prompt", "completion", "label"), _with_images(_kto)),
    ("prompt/chosen/rejected with images", ("prompt", "chosen", "rejected"),
     preference._pair_format(_with_images(_prompt_chosen_rejected))),
    ("chosen/rejected chats with images", ("chosen", "rejected"),
     preference._pair_format(_with_images(_chats("chosen", "rejected")))),
]


def judged(pair: VisionPair, desirable: bool) -> VisionJudged:
    return VisionJudged(pair.where, pair.prompt, pair.chosen if desirable else pair.rejected, desirable, pair.images,
                        pair.videos)


def read_image_rows(specs: list[str], seed: int, formats: list[Any], max_pixels: int | None) -> list[Any]:
    """The rows of every file in `specs` in one of `formats`, their images found and checked
    (`resolve_images`); each file's layout and counts logged."""
    items: list[Any] = []
    for spec in specs:
        rows, fmt = read_file(spec, seed, formats)
        rows, large = resolve_images(rows, spec, max_pixels)
        log.info("data: %s: %d rows, %s, %d images%s", spec, len(rows), fmt, sum(len(r.images) for r in rows),
                 f" ({large} larger than --max-pixels {max_pixels}: scaled down to it)" if large else "")
        items += rows
    return items


def load_vision_preferences(specs: list[str], seed: int, method: str, max_pixels: int | None = None) -> list[Any]:
    """The rows of every file in `specs`, their images found and checked (`read_image_rows`): pairs,
    or for kto judged answers (each pair giving a desirable and an undesirable one)."""
    return preference.for_method(read_image_rows(specs, seed, FORMATS, max_pixels), method, judged)


def shapes_pairs(n: int, seed: int) -> list[VisionPair]:
    """`n` pairs of the shapes task: the right answer chosen, a wrong shape or colour rejected."""
    rng = random.Random(seed)
    pairs = []
    for sample in tiny_vlm.shapes_task(n, seed):
        colour, shape = tiny_vlm.drawn(sample).split(" ", 1)[1].split(" ")
        if rng.random() < 0.5:
            colour = rng.choice([c for c in tiny_vlm.COLOURS if c != colour])
        else:
            shape = rng.choice([s for s in tiny_vlm.SHAPES if s != shape])
        wrong = ({"role": "assistant", "content": [{"type": "text", "text": f"a {colour} {shape}"}]},)
        pairs.append(VisionPair(sample.where, sample.messages[:1], sample.messages[1:], wrong, images=sample.images))
    return pairs


def as_sample(item: VisionPair | VisionJudged) -> VisionSample:
    answer = item.chosen if isinstance(item, Pair) else item.completion
    return VisionSample(item.where, item.prompt + answer, item.images)


class VisionPreferenceCollator:
    """TRL's collator of image preference rows (``DataCollatorForVisionPreference``, KTO's
    ``DataCollatorForVisionUnpairedPreference`` with its KL sequences: each prompt with the next
    row's answer), given each row's images opened and bounded here, and the batch's token count
    (`NUM_TOKENS`). Its attention mask stays: without one, Qwen-VL would not place its 3-D
    positions. The datasets hold each row's index in `items` (TRL's trainers take a datasets'
    Dataset, whose columns cannot hold the images' sources as they are)."""

    def __init__(self, encoder: VisionEncoder, kto: bool, max_length: int):
        processor = encoder.processor
        self.collate = (DataCollatorForVisionUnpairedPreference(processor, max_length=max_length, calculate_kl=True)
                        if kto else DataCollatorForVisionPreference(processor, max_length=max_length))
        self.encoder = encoder
        self.items: list[VisionPair | VisionJudged] = []

    def dataset(self, items: list[VisionPair | VisionJudged]) -> Any:
        """A Dataset of `items`, which this collator makes batches of."""
        from datasets import Dataset

        start = len(self.items)
        self.items += items
        return Dataset.from_dict({"index": list(range(start, len(self.items)))})

    def example(self, item: VisionPair | VisionJudged) -> dict[str, Any]:
        """TRL's form of `item` (its collators fill the image parts in place: a copy)."""
        answers = ({"chosen": list(item.chosen), "rejected": list(item.rejected)} if isinstance(item, Pair)
                   else {"completion": list(item.completion), "label": item.desirable})
        return copy.deepcopy({"prompt": list(item.prompt), **answers}) | {"images": self.encoder.images(item.images)}

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        batch = dict(self.collate([self.example(self.items[row["index"]]) for row in rows]))  # not a BatchFeature
        batch[NUM_TOKENS] = int(batch["attention_mask"].sum())
        return batch

    def lengths(self, item: VisionPair | VisionJudged) -> tuple[int, int]:
        """(prompt tokens, all tokens) of `item` as the collator lays it out, at any length."""
        collate = self.collate
        whole = dataclasses.replace(collate, max_length=None)
        batch = whole([self.example(item)])
        prompt = int((batch["attention_mask"][0] - batch["completion_mask"][0]).sum())
        return prompt, int(batch["attention_mask"].sum())


def encode_all(collator: VisionPreferenceCollator, items: list[Any], max_length: int, what: str
               ) -> tuple[list[Any], int]:
    """The items that fit `max_length`, and their tokens; each one laid out once here, so that
    a row the processor cannot take stops the run before it starts. Rows whose prompt (and so
    its images) does not fit `max_length` are dropped with a count; answers are cut to fit."""
    rows, tokens = [], 0
    for item in items:
        try:
            prompt, total = collator.lengths(item)
        except Exception as err:  # a template or processor raises whatever its author chose
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise SFTError(f"{item.where}: the processor failed on this row: {type(err).__name__}: {reason}") from None
        if prompt >= max_length:
            continue
        sequences = 1 if isinstance(item, Judged) else 2
        rows.append(item)
        tokens += min(total, sequences * max_length)
    if len(rows) < len(items):
        log.warning("%s: %d of %d rows have a prompt (with its images' tokens) of --max-length %d tokens or more: "
                    "dropped", what, len(items) - len(rows), len(items), max_length)
    if not rows:
        raise SFTError(f"{what}: no row leaves room for an answer within --max-length {max_length}")
    return rows, tokens


def check(cfg: RLHFConfig) -> None:
    """What tigon rlhf does not do with images yet, refused in one line."""
    if cfg.method not in (*PREFERENCE_METHODS, "grpo"):
        raise SFTError(f"--method {cfg.method}: tigon rlhf trains vision-language models with the preference methods "
                       f"({', '.join(PREFERENCE_METHODS)}) and grpo only for now")
    if cfg.nll_on_prompt:
        raise SFTError("--nll-on-prompt: a prompt with images holds their tokens, which are never scored; leave it out")
    if cfg.precompute_ref_log_probs:
        raise SFTError("--precompute-ref-log-probs: not for images (TRL's vision trainers process them batch by "
                       "batch); leave it out")


def run(cfg: RLHFConfig) -> Path:
    """`tigon rlhf` for a vision-language model (`cfg` resolved)."""
    check(cfg)
    if cfg.method == "grpo":
        from tigon.train import vision_grpo

        return vision_grpo.run(cfg)
    cfg, family, config = vision_settings(cfg)
    builtin = cfg.model is None
    kto = cfg.method == "kto"
    resume_from = start(cfg)
    if cfg.dataset:
        items = load_vision_preferences(cfg.dataset, cfg.seed, cfg.method, cfg.max_pixels)
    else:
        items = preference.for_method(shapes_pairs(BUILTIN_PAIRS, cfg.seed), cfg.method, judged)
        log.info("data: the synthetic shapes task's pairs: %d (a %s, %s shape; the right shape and colour chosen, "
                 "a wrong one rejected)", BUILTIN_PAIRS, "/".join(tiny_vlm.COLOURS), "/".join(tiny_vlm.SHAPES))
    if cfg.eval_dataset:
        eval_items = load_vision_preferences(cfg.eval_dataset, cfg.seed, cfg.method, cfg.max_pixels)
    else:
        items, eval_items = split_off(items, cfg.eval_split, cfg.seed) if cfg.eval_split else (items, [])
    if any(item.videos for item in items + eval_items):
        where = next(item.where for item in items + eval_items if item.videos)
        raise SFTError(f"{where}: a video: tigon rlhf trains on images only; give the video's frames as images")
    processor = tiny_vlm.build_processor() if builtin else load_processor(cfg.model, config)
    bound_pixels(processor, family, cfg.min_pixels, cfg.max_pixels)
    encoder = VisionEncoder(processor, cfg.max_pixels, cfg.image_size)
    collator = VisionPreferenceCollator(encoder, kto, cfg.max_length)
    train_rows, tokens = encode_all(collator, items, cfg.max_length, "training data")
    if kto:
        train_rows = preference.shuffled(train_rows, cfg.seed)
    eval_rows = encode_all(collator, eval_items, cfg.max_length, "evaluation data")[0] if eval_items else None
    sequences = len(train_rows) * (1 if kto else 2)
    log.info("tokens: %d training %s, %d images, %d tokens, max length %d", len(train_rows),
             "answers" if kto else "pairs", sum(len(r.images) for r in train_rows), tokens, cfg.max_length)
    train_data = collator.dataset(train_rows)
    eval_data = collator.dataset(eval_rows) if eval_rows else None
    reference = cfg.method in REFERENCE_METHODS
    if builtin:  # everything is checked: the sft stage may write now (preferences of random weights teach nothing)
        cfg = dataclasses.replace(cfg, model=str(builtin_after_sft(cfg, None, vision=True)))
        set_seed(cfg.seed)  # as a run that found the sft stage done

    def trainer(built: Built, args: Any) -> Any:
        cls = TigonKTOTrainer if kto else TigonDPOTrainer
        return cls(model=built.model, ref_model=built.reference, args=args, train_dataset=train_data,
                   eval_dataset=eval_data, processing_class=processor, data_collator=collator,
                   save_limit=cfg.save_limit, method=cfg.method, loss=loss_options(cfg),
                   nll_on_prompt=cfg.nll_on_prompt)

    def prompts() -> list[Any]:
        if cfg.dataset:
            return pick_vision_prompts([as_sample(item) for item in items], cfg.samples)
        held_out = tiny_vlm.shapes_task(HELD_OUT_ROWS, cfg.seed + 1)
        return pick_vision_prompts(held_out, cfg.samples, label=tiny_vlm.drawn)

    job = Job("rlhf", train_data, tokens, sequences,
              arguments=lambda dtype: trl_arguments(cfg, dtype, eval_data is not None), trainer=trainer,
              prompts=prompts, metrics=KTO_METRICS if kto else PAIRED_METRICS,
              build=lambda dtype, args, resume: build_vision_model(cfg, processor, dtype, args, resume,
                                                                   reference=reference and cfg.tuner == "full"),
              answer=lambda model, prompt: vision_generate(model, encoder, prompt, cfg.max_new_tokens))
    return train(cfg, resume_from, processor, job)
