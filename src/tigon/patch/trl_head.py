"""TRL's per-token log-probs on tigon's kernel (switch ``trl_log_probs``).

TRL 1.16's trainers (DPO, KTO, GRPO, RLOO, and SFT's entropy metric) give the model a fused LM head
(``trl.trainer.utils.add_fused_lm_head``): called with ``fused_lm_head=True`` it runs the backbone
and hands the last hidden states, the head's weight and the labels to
``trl.trainer.utils._ChunkedLogProbFunction.apply``, a name that forward looks up in that module on
every call. The switch puts a :class:`_ChunkedLogProbs` there, whose ``apply`` takes the same
arguments and returns the same five fields (log-probs, entropy, ``log sum p^2``, mean logit,
top-1), computed by :func:`tigon.functional.linear_log_probs` (``return_stats`` for the three
without gradient) in one pass over chunks of the logits, so the trainers' log-probs (policy and
reference, forward and backward) never hold the logits and run tigon's kernels.

TRL's own path keeps a call, with one line saying why, that the op cannot take: logits under a
final softcap (Gemma 2) or a non-positive ``logit_scale`` (a positive one folds into the
temperature: ``x * s / T == x / (T / s)``), and a DeepSpeed ZeRO-3 head (whole only inside TRL's
gathers, in backward too).

Like a family's RoPE function, it is a module-wide swap, shared by every patched model and undone
with the last patch that holds it; so while one is patched, every model's TRL log-probs run it.
tigon.patch never imports TRL: the swap is planned only when ``trl.trainer.utils`` is already
imported (as it is once a TRL trainer class is), and only for a model instance.
"""

from __future__ import annotations

import functools
import logging
import numbers
import sys
import types
from contextlib import nullcontext
from typing import Any

import torch

from tigon import functional as F
from tigon.patch.modules import zero3_partitioned

log = logging.getLogger("tigon")

MODULE = "trl.trainer.utils"
NAME = "_ChunkedLogProbFunction"
_STATS = ("log_sum_sq_probs", "mean_logits", "is_top1")
_said: set[str] = set()


def loaded_module() -> types.ModuleType | None:
    """TRL's module holding the chunked log-prob function, when TRL is imported and has it."""
    module = sys.modules.get(MODULE)
    return module if module is not None and hasattr(module, NAME) else None


def _trl_only(weight: torch.Tensor, softcap: float | None, logit_scale: Any) -> str | None:
    """Why a call stays on TRL's path (None: it runs tigon's op)."""
    if softcap is not None:
        return "logits under a final softcap (linear_log_probs has none)"
    if isinstance(logit_scale, bool) or not isinstance(logit_scale, numbers.Real) or not logit_scale > 0:
        return f"logit_scale {logit_scale!r} (only a positive scale folds into the temperature)"
    if zero3_partitioned(weight):
        return "a DeepSpeed ZeRO-3 head (whole only inside TRL's gathers)"
    return None


class _ChunkedLogProbs:
    """What ``trl.trainer.utils._ChunkedLogProbFunction`` is while the switch holds: the same
    ``apply``, on :func:`tigon.functional.linear_log_probs`; `original` is TRL's."""

    def __init__(self, original: Any):
        self.original = original

    def apply(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
              temperature: float, chunk_size: int, final_logit_softcapping: float | None = None,
              logit_scale: float = 1.0, outputs: tuple[str, ...] = ("log_probs",)) -> tuple[Any, ...]:
        """TRL's ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)`` of
        ``softmax(x * logit_scale / temperature)``, ``x = hidden @ weight.T + bias``; None for the
        fields not in `outputs`. `chunk_size` (TRL's vocabulary tile) has no counterpart: the op
        chunks over tokens."""
        reason = _trl_only(weight, final_logit_softcapping, logit_scale)
        if reason is not None:
            if reason not in _said:
                _said.add(reason)
                log.warning("tigon: trl_log_probs: %s stays on TRL's chunked log-probs", reason)
            return self.original.apply(hidden, weight, bias, targets, temperature, chunk_size,
                                       final_logit_softcapping, logit_scale, outputs)
        device = hidden.device.type
        autocast = torch.is_autocast_enabled(device)
        # TRL's compute dtype: autocast's, else the hidden states'.
        dtype = torch.get_autocast_dtype(device) if autocast else hidden.dtype
        entropy = "entropy" in outputs
        stats = any(name in outputs for name in _STATS)
        with torch.autocast(device, enabled=False) if autocast else nullcontext():
            out = F.linear_log_probs(
                hidden.to(dtype), weight.to(dtype), targets, None if bias is None else bias.to(dtype),
                temperature=temperature / logit_scale, return_entropy=entropy, return_stats=stats,
            )
        out = list(out) if entropy or stats else [out]
        log_probs = out.pop(0)
        entropies = out.pop(0) if entropy else None
        extra = out.pop(0) if stats else None

        def stat(name: str) -> torch.Tensor | None:
            return getattr(extra, name) if name in outputs else None

        return log_probs, entropies, stat("log_sum_sq_probs"), stat("mean_logits"), stat("is_top1")


@functools.lru_cache(maxsize=None)
def chunked_log_probs(original: Any) -> _ChunkedLogProbs:
    """The stand-in for TRL's `original` function (one per original, so that every patch
    holding the swap holds the same object)."""
    return _ChunkedLogProbs(original)
