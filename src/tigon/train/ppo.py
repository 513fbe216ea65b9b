"""`tigon rlhf --method ppo`: PPO with a value head, GAE and a KL penalty in the reward (the
recipe of Ziegler et al. 2019 and TRL's PPOv2 trainer, which TRL 1.16 no longer ships), built on
`tigon rlhf --method grpo`'s machinery: TRL's GRPOTrainer samples the completions, calls the
reward functions (--reward-funcs, and --reward-model's scores) and the reference, and reuses each
rollout batch for several optimizer steps; tigon replaces the advantages and the loss.

Per rollout batch (``--batch-size x --grad-accum x --mini-batches`` completions, each prompt
``--num-generations`` times), with no gradient:

    logp_t, V_t   the policy's log-prob of each completion token and the value head's estimate at
                  the position that predicts it, from one forward (the value head reads the same
                  last hidden states as the LM head)
    r_t           -beta (logp_t - ref_t) per token (k1, TRL PPOv2's default), plus the sequence's
                  score (its rewards summed, weighted) at its last token
    A_t, R_t      GAE: delta_t = r_t + gamma V_{t+1} - V_t (V = 0 past the end),
                  A_t = delta_t + gamma lam A_{t+1}; returns R_t = A_t + V_t; A whitened over the
                  batch's tokens

Then --ppo-epochs passes over it in --mini-batches optimizer steps, each micro-batch's loss

    pg   = mean over tokens of max(-A_t rho_t, -A_t clip(rho_t, 1 - eps, 1 + eps)),
           rho_t = exp(logp_t - old_t)         linear_policy_loss (bnpo: the batch's token mean)
    vf   = 0.5 mean over tokens of max((V_t - R_t)^2, (clip(V_t, V_old -+ c) - R_t)^2)
    loss = pg + vf_coef vf

The policy's term runs through tigon's fused `linear_policy_loss`, which takes per-token
advantages and never holds the logits; the value head, a ``hidden -> 1`` linear layer (fp32,
zero at the start), is plain PyTorch. It sits on the policy: one backbone, one forward, its loss
training the backbone too (the LoRA adapter, or every weight of a full fine-tune), as TRL's
earlier ``AutoModelForCausalLMWithValueHead`` did; it is saved beside the model as
``value_head.safetensors`` in every checkpoint and in final/, and read back on --resume. The
rollouts' order is shuffled once per batch (TRL's buffer), not once per pass. One process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import tigon.functional as TF
from tigon.train import grpo
from tigon.train.advantages import gae, token_rewards, value_loss, whiten
from tigon.train.config import RLHFConfig, SFTError

VALUE_HEAD_FILE = "value_head.safetensors"
# TRL's GRPO metrics the progress bar shows, and PPO's own.
METRICS = {**grpo.METRICS, "value_loss": "vf", "policy_loss": "", "value_clipfrac": "", "value": "",
           "non_score_reward": ""}


# --- the trainer --------------------------------------------------------------------------------

class TigonPPOTrainer(grpo.TigonGRPOTrainer):
    """TRL's GRPOTrainer's sampling, rewards, reference and rollout buffer, with PPO's advantages
    (GAE over a value head's estimates and the KL-penalised rewards) and loss (clipped policy term
    through `linear_policy_loss`, clipped value term). TRL's ``beta`` is the KL penalty's weight
    in the reward (TRL scores the reference when it is not 0); it never enters the loss."""

    def __init__(self, *, gamma: float, lam: float, vf_coef: float, cliprange_value: float, **kwargs: Any):
        super().__init__(**kwargs)
        if self.accelerator.num_processes > 1:
            raise SFTError("--method ppo trains its value head in one process: run it without torchrun / accelerate")
        self.gamma, self.lam, self.vf_coef, self.cliprange_value = gamma, lam, vf_coef, cliprange_value
        hidden_size = self._head(self.model)[0].shape[1]
        self.value_head = torch.nn.Linear(hidden_size, 1, device=self.args.device, dtype=torch.float32)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)
        self._scores: torch.Tensor | None = None

    def _values(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.value_head(hidden.float()).squeeze(-1)

    # The value head trains beside the model: in the optimizer, the clipping and the zeroing of
    # gradients (TigonTrainer's list of trainable parameters), and in every save.
    def _trainable_parameters(self, model) -> list:
        if self._trainable is None:
            self._trainable = [p for p in model.parameters() if p.requires_grad] + list(self.value_head.parameters())
        return self._trainable

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if id(self.value_head.weight) not in held:
            optimizer.add_param_group({"params": list(self.value_head.parameters()), "weight_decay": 0.0})
        return optimizer

    def _save(self, output_dir: str | None = None, state_dict=None):
        super()._save(output_dir, state_dict)
        if self.args.should_save:
            from safetensors.torch import save_file

            tensors = {k: v.detach().contiguous().cpu() for k, v in self.value_head.state_dict().items()}
            save_file(tensors, str(Path(output_dir or self.args.output_dir) / VALUE_HEAD_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        path = Path(resume_from_checkpoint) / VALUE_HEAD_FILE
        if path.is_file():
            from safetensors.torch import load_file

            self.value_head.load_state_dict(load_file(str(path), device=str(self.args.device)))

    # --- rollouts ---

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        self._scores = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._scores

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        start = self.accelerator.process_index * len(inputs)
        per_function = self._scores[start:start + len(inputs)]
        # A completion no reward function scored (all None: NaN) gets 0, as TRL's sum gives it.
        scores = (per_function * self.reward_weights.to(per_function.device)).nansum(dim=1)
        completion_ids, mask = batch["completion_ids"], batch["completion_mask"]
        with torch.no_grad():
            weight, bias = self._head(self.model)
            hidden = self._completion_hidden(self.model, batch)
            log_probs = TF.linear_log_probs(hidden.to(weight.dtype), weight, completion_ids.masked_fill(mask == 0, -100),
                                            bias, temperature=self.temperature)
            values = self._values(hidden)
        rewards, penalty = token_rewards(scores, log_probs, batch.get("ref_per_token_logps"), mask, self.beta)
        advantages, returns = gae(rewards, values, mask, self.gamma, self.lam)
        scored = mask.float()
        tokens = scored.sum().clamp(min=1)
        batch.update(old_per_token_logps=log_probs, values=values * scored, returns=returns,
                     advantages=whiten(advantages, mask))
        self._metrics[mode]["value"].append(((values * scored).sum() / tokens).item())
        self._metrics[mode]["non_score_reward"].append(penalty.sum(1).mean().item())
        if "ref_per_token_logps" in batch:
            kl = (log_probs - batch["ref_per_token_logps"]) * scored
            self._metrics[mode]["kl"].append((kl.sum() / tokens).item())
        return batch

    # --- the loss ---

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        mask = inputs["completion_mask"]
        weight, bias = self._head(model)
        hidden = self._completion_hidden(model, inputs)
        policy, metrics = TF.linear_policy_loss(
            hidden.to(weight.dtype), weight, inputs["completion_ids"], inputs["old_per_token_logps"], inputs["advantages"],
            epsilon=self.epsilon_low, epsilon_high=self.epsilon_high, loss_type="bnpo",
            temperature=self.temperature, mask=mask, bias=bias,
        )
        value, clipped = value_loss(self._values(hidden), inputs["values"], inputs["returns"], mask,
                                    self.cliprange_value)
        loss = policy + self.vf_coef * value
        if mode == "train":  # TRL's GRPO divides by the accumulation steps itself
            loss = loss / self.current_gradient_accumulation_steps
        metrics.update(policy_loss=policy.detach(), value_loss=value.detach(), value_clipfrac=clipped)
        for key, item in metrics.items():
            self._add(mode, key, item, 1)
        return loss


# --- the run ------------------------------------------------------------------------------------

def trl_arguments(cfg: RLHFConfig, dtype: torch.dtype, has_eval: bool) -> Any:
    """TRL's GRPOConfig for PPO: GRPO's, with --ppo-epochs passes over each rollout batch of
    --mini-batches optimizer steps."""
    return grpo.trl_arguments(cfg, dtype, has_eval, num_iterations=cfg.ppo_epochs,
                              steps_per_generation=cfg.mini_batches * cfg.grad_accum)


def _options(cfg: RLHFConfig) -> dict[str, Any]:
    return dict(gamma=cfg.gamma, lam=cfg.lam, vf_coef=cfg.vf_coef, cliprange_value=cfg.cliprange_value)


PPO = grpo.Method(TigonPPOTrainer, trl_arguments, METRICS, trainer_options=_options,
                  mini_batches=lambda cfg: cfg.mini_batches, passes=lambda cfg: cfg.ppo_epochs,
                  extra_rewards=grpo.reward_model_rewards)


def run(cfg: RLHFConfig) -> Path:
    """`tigon rlhf --method ppo` for a resolved `cfg`; returns the final model's (or adapter's) directory."""
    return grpo.run(cfg, PPO)
