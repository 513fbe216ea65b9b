"""The forwards and functions tigon puts in place of Hugging Face's.

Each factory returns one function per table entry and returns the *same* function for the same
entry (``lru_cache``), so patching twice installs an identical object and torch.compile sees a
stable callee. A forward reads only the attributes the HF module already has, so it can be bound
to a live module (instance patching) or set on the class (class patching) alike.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from tigon import functional as F
from tigon.patch.families import Norm


@functools.lru_cache(maxsize=None)
def rms_norm_forward(norm: Norm) -> Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]:
    """Forward for an HF RMSNorm module: its `weight` and epsilon through :func:`tigon.functional.rms_norm`."""

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(
            hidden_states, self.weight, getattr(self, norm.eps), offset=norm.offset, casting=norm.casting
        )

    forward.__qualname__ = f"tigon_{norm.cls}.forward"
    return forward
