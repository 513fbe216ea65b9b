"""PPO's arithmetic over per-token tensors ``(completions, tokens)`` with a mask of the scored
tokens (each completion's first, then padding): the KL-penalised rewards, GAE, whitening and the
clipped value loss (`tigon.train.ppo` and the PPO step benchmark use them). Plain PyTorch: they are
O(B T), next to the model's work."""

from __future__ import annotations

import torch


def token_rewards(scores: torch.Tensor, log_probs: torch.Tensor, ref_log_probs: torch.Tensor | None,
                  mask: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards ``(B, T)`` of B completions: ``-beta (logp - ref)`` on each scored token
    (none without a reference), plus each completion's `scores` at its last scored token; and that
    KL term's part alone (the non-score reward), 0 where unscored. `mask` holds each completion's
    scored tokens first (right padding)."""
    mask = mask.to(log_probs.dtype)
    penalty = torch.zeros_like(log_probs) if ref_log_probs is None else -beta * (log_probs - ref_log_probs) * mask
    last = (mask.sum(1).long() - 1).clamp(min=0)
    rewards = penalty.clone()
    rewards[torch.arange(rewards.shape[0], device=rewards.device), last] += scores.to(rewards.dtype)
    return rewards, penalty


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over ``(B, T)`` per-token rewards
    and value estimates, the episode ending after each completion's last scored token (values past
    it are 0): ``(advantages, returns)``, both 0 where unscored."""
    mask = mask.to(values.dtype)
    values, rewards = values * mask, rewards * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        following = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(running)
        running = rewards[:, t] + gamma * following - values[:, t] + gamma * lam * running
        advantages[:, t] = running
    return advantages * mask, (advantages + values) * mask


def whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`x` less its mean over the scored tokens, over their standard deviation (unbiased, as TRL
    PPOv2's ``masked_whiten``); 0 where unscored."""
    scored = mask != 0
    n = scored.sum().clamp(min=1)
    mean = torch.where(scored, x, 0.0).sum() / n
    var = torch.where(scored, (x - mean) ** 2, 0.0).sum() / (n - 1).clamp(min=1)
    return torch.where(scored, (x - mean) * torch.rsqrt(var + 1e-8), 0.0)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss, ``0.5 * mean over scored tokens of max((V - R)^2, (V_clip - R)^2)``
    with ``V_clip = V_old + clip(V - V_old, -clip, clip)``, and the fraction of tokens where the
    clipped term is the larger."""
    scored = mask != 0
    n = scored.sum().clamp(min=1)
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    plain, kept = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * torch.where(scored, torch.maximum(plain, kept), 0.0).sum() / n
    return loss, torch.where(scored & (kept > plain), 1.0, 0.0).sum() / n
