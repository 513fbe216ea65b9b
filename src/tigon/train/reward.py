"""`tigon rlhf --method rm`: a Bradley-Terry reward model, a sequence classifier with one output
(`tigon.train.classify`, tigon's kernels in its backbone) trained on preference pairs, and that
model as a reward function of `tigon rlhf --method grpo --reward-model PATH`.

The data are those the preference methods read (`tigon.train.preference`), with an optional
``margin`` column; each pair becomes two sequences, the prompt with each answer, as TRL's
`RewardTrainer` takes them. The loss is TRL's, ``-log sigmoid(r_chosen - r_rejected - margin)``
averaged over the pairs (plus ``c * mean((r_chosen + r_rejected)^2)`` with TRL's
``center_rewards_coefficient``), the rewards read at each sequence's last token alone
(:func:`tigon.train.classify.pooled_scores`). The Trainer is TRL's `RewardTrainer` with tigon's
step loop (`TigonTrainer`): its metrics are summed on the device, under the preference methods'
names (``rewards/accuracies``: the share of pairs whose chosen answer scores higher).

With no --model the reward model is the built-in tiny Llama after `tigon sft` (as the preference
methods' policy, `tigon.train.builtin`) with a new head: a model that has read the bundled
instructions tells their right answers from wrong ones, where one trained from nothing only
learns which answers the training pairs prefer. With no --dataset the bundled preference pairs, a
tenth of them held out to show the accuracy rise.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
from trl import RewardConfig, RewardTrainer
from trl.trainer.reward_trainer import DataCollatorForPreference

from tigon.train import preference
from tigon.train.batching import NUM_TOKENS
from tigon.train.builtin import builtin_after_sft, builtin_tokenizer
from tigon.train.callbacks import ACCURACY, MARGIN
from tigon.train.classify import ScoringTrainer
from tigon.train.config import RLHFConfig, SFTError
from tigon.train.fused import checkpointing_off
from tigon.train.modeling import classifier_options, is_classifier, load_tokenizer
from tigon.train.rewards import Reward, text_of
from tigon.train.template import ensure_chat_template
from tigon.train.trainer import TigonTrainer

log = logging.getLogger("tigon.train")

REWARD_LABEL = "reward"  # the one output's name in the config's id2label
METRICS = {MARGIN: "margin", ACCURACY: "acc", "rewards/chosen": "", "rewards/rejected": ""}


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                       center: float | None = None) -> torch.Tensor:
    """The mean over pairs of ``-log sigmoid(chosen - rejected - margin)``, in fp32, plus
    ``center * mean((chosen + rejected)^2)`` (keeps the rewards centred on 0) when given."""
    difference = chosen.float() - rejected.float()
    if margin is not None:
        difference = difference - margin.float()
    loss = -torch.nn.functional.logsigmoid(difference).mean()
    if center:
        loss = loss + center * ((chosen.float() + rejected.float()) ** 2).mean()
    return loss


class TigonRewardTrainer(ScoringTrainer, TigonTrainer, RewardTrainer):
    """TRL's RewardTrainer on rows tokenized by tigon, its rewards read at each sequence's last
    token alone, with tigon's checkpoints and step loop (its metrics summed on the device)."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset  # tokenized already

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        mode = "train" if self.model.training else "eval"
        rewards = self._scores(model, inputs)
        chosen, rejected = rewards.squeeze(-1).chunk(2)
        loss = bradley_terry_loss(chosen, rejected, inputs.get("margin"), self.args.center_rewards_coefficient)
        pairs = chosen.shape[0]
        with torch.no_grad():
            self._add(mode, ACCURACY, (chosen > rejected).sum(), pairs)
            self._add(mode, MARGIN, (chosen - rejected).sum(), pairs)
            self._add(mode, "rewards/chosen", chosen.sum(), pairs)
            self._add(mode, "rewards/rejected", rejected.sum(), pairs)
        return (loss, SequenceClassifierOutput(loss=loss, logits=rewards)) if return_outputs else loss


class RewardCollator:
    """TRL's reward collator (chosen sequences, then their rejected ones, right-padded; the margins),
    less the attention mask where no row is padded, and the batch's token count (`NUM_TOKENS`)."""

    def __init__(self, pad_token_id: int):
        self.collate = DataCollatorForPreference(pad_token_id)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collate(features)
        if bool(batch["attention_mask"].all()):
            del batch["attention_mask"]
        batch[NUM_TOKENS] = sum(len(f["chosen_ids"]) + len(f["rejected_ids"]) for f in features)
        return batch


def reward_rows(tokenizer: Any, pairs: list[preference.Pair], cfg: RLHFConfig, what: str) -> list[dict[str, Any]]:
    """Each pair as RewardTrainer's row: the prompt with each answer (within --max-length), and its
    margin where the data give margins (then every row must have one)."""
    with_margin = next((p for p in pairs if p.margin is not None), None)
    if with_margin is not None:
        missing = next((p for p in pairs if p.margin is None), None)
        if missing is not None:
            raise SFTError(f"{missing.where}: no margin, where {with_margin.where} has one: give every row a margin "
                           "or none")
    rows = []
    for pair, row in preference.encoded_items(tokenizer, pairs, cfg.max_length, cfg.max_prompt_length, what):
        out: dict[str, Any] = {"chosen_ids": row["prompt_ids"] + row["chosen_ids"],
                               "rejected_ids": row["prompt_ids"] + row["rejected_ids"]}
        if with_margin is not None:
            out["margin"] = pair.margin
        rows.append(out)
    return rows


def trl_arguments(cfg: RLHFConfig, dtype: torch.dtype, has_eval: bool) -> Any:
    from tigon.train.run import training_arguments

    return training_arguments(cfg, dtype, has_eval, cls=RewardConfig, **checkpointing_off(RewardConfig),
                              max_length=None, center_rewards_coefficient=cfg.center_rewards or None)


def run(cfg: RLHFConfig) -> Path:
    """`tigon rlhf --method rm` for a resolved `cfg`; returns the final model's (or adapter's) directory."""
    from datasets import Dataset

    from tigon.train.rlhf import load_split
    from tigon.train.run import Job, start, train

    resume_from = start(cfg)
    pairs, eval_pairs = load_split(cfg)
    if cfg.model is None:
        tokenizer = builtin_tokenizer()
    else:
        tokenizer = load_tokenizer(cfg.model)
        ensure_chat_template(tokenizer)
        if tokenizer.pad_token is None:  # a sequence's end is found past its last token that is not padding
            tokenizer.pad_token = tokenizer.eos_token
    train_rows = reward_rows(tokenizer, pairs, cfg, "training data")
    eval_rows = reward_rows(tokenizer, eval_pairs, cfg, "evaluation data") if eval_pairs else None
    tokens = sum(len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in train_rows)
    log.info("tokens: %d training pairs, %d tokens, max length %d%s", len(train_rows), tokens, cfg.max_length,
             ", with margins" if "margin" in train_rows[0] else "")
    if cfg.model is None:  # everything is checked: the sft stage may write now
        from transformers import set_seed

        cfg = dataclasses.replace(cfg, model=str(builtin_after_sft(cfg, tokenizer, role="reward model")))
        set_seed(cfg.seed)
    train_data = Dataset.from_list(train_rows)
    eval_data = Dataset.from_list(eval_rows) if eval_rows else None

    def trainer(built: Any, args: Any) -> TigonRewardTrainer:
        return TigonRewardTrainer(model=built.model, args=args, train_dataset=train_data, eval_dataset=eval_data,
                                  processing_class=tokenizer, data_collator=RewardCollator(tokenizer.pad_token_id),
                                  save_limit=cfg.save_limit)

    job = Job("rlhf", train_data, tokens, 2 * len(train_rows),
              arguments=lambda dtype: trl_arguments(cfg, dtype, eval_data is not None), trainer=trainer,
              prompts=lambda: [], metrics=METRICS, classifier=classifier_options([REWARD_LABEL]))
    return train(cfg, resume_from, tokenizer, job)


# --- the reward model as GRPO's reward function --------------------------------------------------

def model_reward(path: str, batch_size: int = 16) -> Reward:
    """The reward function (TRL's call) scoring each prompt + completion by the reward model at
    `path` (a model directory or LoRA adapter of one output, as `tigon rlhf --method rm` saves
    it), through its own chat template; loaded now, so that a wrong path fails before training."""
    from tigon.train.infer import load_for_inference
    from tigon.train.modeling import pick_dtype
    from tigon.train.template import render

    model, tokenizer = load_for_inference(path, pick_dtype("auto"))
    if not is_classifier(model) or model.config.num_labels != 1:
        raise SFTError(f"--reward-model {path}: not a reward model (a sequence classifier with one output, as "
                       "tigon rlhf --method rm saves it)")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    device = next(model.parameters()).device

    def text(prompt: Any, completion: Any) -> str:
        if isinstance(prompt, str):
            return prompt + text_of(completion)
        return render(tokenizer, [*prompt, {"role": "assistant", "content": text_of(completion)}], False)

    @torch.no_grad()
    def reward_model(prompts: list, completions: list, **kwargs: Any) -> list[float]:
        scores: list[float] = []
        texts = [text(p, c) for p, c in zip(prompts, completions)]
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start:start + batch_size], add_special_tokens=False, padding=True,
                              return_tensors="pt").to(device)
            scores += model(**batch).logits[:, 0].float().tolist()
        return scores

    return Reward("reward_model", f"--reward-model {path}", reward_model)
