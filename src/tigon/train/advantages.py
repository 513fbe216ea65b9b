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


GAE_CHUNK = 128


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over ``(B, T)`` per-token rewards
    and value estimates, the episode ending after each completion's last scored token (values past
    it are 0): ``(advantages, returns)``, both 0 where unscored.

    ``A_t = delta_t + gamma lam A_{t+1}`` is a discounted sum of the TD errors to go, taken
    ``GAE_CHUNK`` tokens at a time as one product with the ``(chunk, chunk)`` matrix of powers of
    ``gamma lam``: a token-by-token loop is ~7 kernel launches per token, which for a few hundred
    completion tokens costs more than the step's scoring GEMMs. In float64, so TF32 matmuls (where a
    user enabled them) cannot round it."""
    mask = mask.to(values.dtype)
    values, rewards = values * mask, rewards * mask
    following = torch.nn.functional.pad(values[:, 1:], (0, 1))
    deltas = (rewards + gamma * following - values).double()
    decay = torch.tensor(gamma * lam, dtype=torch.float64, device=values.device)
    tokens = values.shape[1]
    span = max(min(GAE_CHUNK, tokens), 1)  # (no tokens: no chunk, nothing to sum)
    steps = torch.arange(span, device=values.device, dtype=torch.float64)
    # powers[j, i] = decay^(j - i) for j >= i: how much the TD error j tokens on adds to A_i
    lag = steps[:, None] - steps[None, :]
    powers = torch.where(lag >= 0, decay ** lag.clamp(min=0), 0.0)
    advantages = torch.empty_like(deltas)
    carried = deltas.new_zeros(deltas.shape[0])
    for end in range(tokens, 0, -span):
        start = max(end - span, 0)
        width = end - start
        # decay^(width - i): how much A at `end` (the next chunk's first) adds to A_i
        tail = decay ** (width - steps[:width])
        chunk = deltas[:, start:end] @ powers[:width, :width] + carried[:, None] * tail
        advantages[:, start:end] = chunk
        carried = chunk[:, 0]
    advantages = advantages.to(values.dtype)
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
