"""`tigon rlhf --method rloo`: REINFORCE leave-one-out (Ahmadian et al. 2024) on TRL's
RLOOTrainer, its loss computed by tigon's fused `linear_policy_loss` from the policy's hidden
states, as `tigon rlhf --method grpo` does GRPO's.

What stays TRL's: sampling, the rewards, the KL penalty in the reward (beta times the summed
per-token ``logp - ref`` of the sampling policy), the leave-one-out baseline of each prompt's
--num-generations completions, metrics and logging. TRL's loss is, per completion s of B,

    -min(rho_s A_s, clip(rho_s, 1 - eps, 1 + eps_high) A_s),  rho_s = exp(sum_t (logp_t - old_t))

averaged over B. tigon runs RLOO as TRL does by default: one optimizer step per generation batch
(``num_iterations = 1``, ``steps_per_generation`` = the accumulation steps), so the old policy is
the current one and rho_s = 1 exactly. Its gradient is then ``-A_s / B`` for every scored token,
which `linear_policy_loss` gives without an old policy (ratio 1, its gradient kept) at token
level with Dr. GRPO's normalisation over L = 1, ``1 / B``; its value is ``-mean(A)``, set in
closed form. (A ratio off 1 would need the op to take a sequence-level ratio from the sum of the
token log-ratios; it has GSPO's, from their mean.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from trl import RLOOConfig, RLOOTrainer

import tigon.functional as TF
from tigon.train import grpo
from tigon.train.config import RLHFConfig
from tigon.train.fused import checkpointing_off
from tigon.train.run import training_arguments
from tigon.train.trainer import TigonTrainer


class TigonRLOOTrainer(grpo.OnlineFused, TigonTrainer, RLOOTrainer):
    """TRL's RLOOTrainer computing its loss with `linear_policy_loss` (TRL's `_compute_loss`
    replaced, everything else TRL's), with tigon's checkpoints and step loop."""

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        weight, bias = self._head(model)
        hidden = self._completion_hidden(model, inputs).to(weight.dtype)
        advantages = inputs["advantages"]
        loss, metrics = TF.linear_policy_loss(
            hidden, weight, inputs["completion_ids"], None, advantages, epsilon=self.epsilon_low,
            epsilon_high=self.epsilon_high, loss_type="dr_grpo", max_completion_length=1,
            temperature=self.temperature, mask=inputs["completion_mask"], bias=bias,
        )
        loss = loss + (-advantages.mean() - loss).detach()  # the value at ratio 1, the fused gradient kept
        for key, value in metrics.items():
            self._add(mode, key, value, 1)
        return loss


def trl_arguments(cfg: RLHFConfig, dtype: torch.dtype, has_eval: bool) -> Any:
    """TRL's RLOOConfig for `cfg`: tigon's Trainer arguments and RLOO's own, on-policy."""
    extra: dict[str, Any] = dict(
        num_generations=cfg.num_generations, max_completion_length=cfg.max_completion_length,
        temperature=cfg.temperature, beta=cfg.beta, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
        num_iterations=1, disable_dropout=True, log_completions=False, **checkpointing_off(RLOOConfig),
    )
    return training_arguments(cfg, dtype, has_eval, cls=RLOOConfig, **extra)


RLOO = grpo.Method(TigonRLOOTrainer, trl_arguments, grpo.METRICS)


def run(cfg: RLHFConfig) -> Path:
    """`tigon rlhf --method rloo` for a resolved `cfg`; returns the final model's (or adapter's) directory."""
    return grpo.run(cfg, RLOO)
