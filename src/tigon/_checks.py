"""A check of the patch layer: whether calling a module would do more than its forward."""

from __future__ import annotations

from typing import Any, Callable

import torch


def has_hooks(module: torch.nn.Module, own_forward: Callable[..., Any] | None = None) -> bool:
    """True when calling `module` would do more than its class's forward (hooks, or a forward
    set on the instance, as accelerate's wrapper is), which a fused path that reads its weights
    without calling it would skip. `own_forward` is a rebound forward that does not count (tigon's
    own)."""
    forward = vars(module).get("forward")
    return bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
        or getattr(module, "_backward_pre_hooks", None)
        or (forward is not None and getattr(forward, "__func__", None) is not own_forward)
    )
