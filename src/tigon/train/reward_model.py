"""A reward model as a reward function: ``--reward-model PATH`` scores each prompt + completion
with a sequence-classification model of one output (``AutoModelForSequenceClassification``, as
`tigon rlhf --method rm` and TRL's RewardTrainer save one), called as TRL calls any reward
function, so that the online methods take it beside --reward-funcs' functions.

The conversation is the prompt's turns and the completion as the assistant's, written out by the
reward model's own chat template (its tokenizer's; plain concatenation for one without), and the
model's score is its output at the last token that is not padding (transformers' rule)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tigon.train.rewards import Reward, RewardError, text_of

NAME = "reward_model"  # what TRL logs its rewards under: rewards/reward_model/mean
BATCH = 16  # completions scored per forward


def _conversation(tokenizer: Any, prompt: Any, completion: Any) -> str:
    answer = text_of(completion)
    if isinstance(prompt, str):
        return prompt + answer
    turns = [*prompt, {"role": "assistant", "content": answer}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(turns, tokenize=False)
    return "".join(turn["content"] for turn in turns)


def reward_model_reward(path: str, device: torch.device | str | None = None) -> Reward:
    """The reward function scoring completions with the reward model in directory `path`, on
    `device` (default: the GPU when there is one). A directory that holds no model of one output
    is a RewardError."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    where = Path(path).expanduser()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(where))
        model = AutoModelForSequenceClassification.from_pretrained(str(where))
    except (OSError, ValueError) as err:
        raise RewardError(f"--reward-model {path}: cannot load a sequence-classification model from it: "
                          f"{str(err).splitlines()[0]}") from None
    if model.config.num_labels != 1:
        raise RewardError(f"--reward-model {path}: a reward model has one output (a score), this one has "
                          f"{model.config.num_labels} (a classifier?)")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model.to(device).eval().requires_grad_(False)

    def reward_model(prompts: list, completions: list, **kwargs: Any) -> list[float]:
        texts = [_conversation(tokenizer, p, c) for p, c in zip(prompts, completions)]
        scores: list[float] = []
        for start in range(0, len(texts), BATCH):
            batch = tokenizer(texts[start:start + BATCH], padding=True, return_tensors="pt",
                              add_special_tokens=False).to(device)
            with torch.no_grad():
                scores += model(**batch).logits[:, 0].float().tolist()
        return scores

    return Reward(NAME, f"--reward-model {path}", reward_model)
