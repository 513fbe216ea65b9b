"""What a patched forward may assume about a module before reading its weights without calling it,
and which kernel computes an activation module it would skip."""

from __future__ import annotations

from typing import Any, Callable

import torch

from tigon.nn.activations import ACTIVATIONS


def forward_attr(module: torch.nn.Module) -> str:
    """The attribute holding the forward that calling `module` ends in: accelerate's hooks (device
    map loading, offload) own `forward` and call `_old_forward`."""
    return "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"


def has_hooks(module: torch.nn.Module, own_forward: Callable[..., Any] | None = None) -> bool:
    """True when calling `module` would do more than its class's forward (hooks, or a forward
    set on the instance, as accelerate's wrapper is), which a fused path that reads its weights
    without calling it would skip. A rebound forward made as `own_forward` was (tigon's own, made
    for this module's plan from the same code) does not count."""
    forward = vars(module).get("forward")
    return bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
        or getattr(module, "_backward_pre_hooks", None)
        or (forward is not None and getattr(getattr(forward, "__func__", None), "__code__", None)
            is not getattr(own_forward, "__code__", False))
    )


def zero3_partitioned(param: torch.Tensor) -> bool:
    """A DeepSpeed ZeRO-3 parameter (DeepSpeed's own test: it has a `ds_id`). Its data is whole
    only while its own module's forward runs, so no other forward may read it directly."""
    return hasattr(param, "ds_id")


def readable(module: torch.nn.Module, own_forward: Callable[..., Any] | None = None) -> bool:
    """Whether a fused op may read `module`'s weight instead of calling it: calling it would run
    nothing but its forward (:func:`has_hooks`) and its weight is whole here (not ZeRO-3's)."""
    weight = getattr(module, "weight", None)
    return not has_hooks(module, own_forward) and not (weight is not None and zero3_partitioned(weight))


def plain_linear(linear: Any) -> bool:
    """An nn.Linear whose weights a fused op may read directly: not a LoRA or quantised wrapper,
    and nothing (hooks, accelerate's offload wrapper) that calling it would run."""
    return type(linear) is torch.nn.Linear and not has_hooks(linear)


# Filled on first use (not an lru_cache: torch.compile traces the patched forwards that read it,
# and warns of any cache wrapper it traces through).
_MODULE_CLASSES: dict[type, str] = {}


def _module_classes() -> dict[type, str]:
    """The module class transformers builds (``ACT2CLS``) for each name of :data:`ACTIVATIONS`, and
    torch's SiLU, mapped to the kernel's activation."""
    if _MODULE_CLASSES:
        return _MODULE_CLASSES
    classes: dict[type, str] = {torch.nn.SiLU: "silu"}
    try:
        from transformers.activations import ACT2CLS
    except ImportError:
        ACT2CLS = {}
    for name, activation in ACTIVATIONS.items():
        cls = ACT2CLS.get(name)
        if isinstance(cls, type):  # a (class, arguments) entry is a variant the kernels do not compute
            classes.setdefault(cls, activation)
    _MODULE_CLASSES.update(classes)
    return _MODULE_CLASSES


def module_activation(module: Any) -> str | None:
    """The kernel's name for an activation module (by exact class), or None for one no kernel computes."""
    if type(module) is torch.nn.GELU:
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    return _module_classes().get(type(module))
