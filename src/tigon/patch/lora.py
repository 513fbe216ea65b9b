"""PEFT LoRA layers on tigon's fused LoRA ops, with PEFT in charge of everything else.

:func:`tigon.patch` of a PEFT model (switch ``lora``) plans, from the family table:

* every PEFT LoRA linear (``peft.tuners.lora.layer.Linear``, and on a bitsandbytes base
  ``peft.tuners.lora.bnb.Linear4bit`` / ``Linear8bitLt``) runs :func:`tigon.functional.lora_linear`
  (:func:`linear_forward`);
* the family's gated MLP, when its gate/up/down projections are such layers, runs as one
  :func:`tigon.functional.lora_gated_mlp` (:func:`tigon.patch.forwards.mlp_forward`);
* the family's attention, when its q/k/v projections are such layers, computes the three as one
  :func:`tigon.functional.lora_linear_group` at the first of their calls on its hidden states, and
  the other two hand back their parts (:func:`tigon.patch.forwards.attention_forward`).

Each call checks that the fused path computes what PEFT would (:func:`active_adapter`,
:func:`projection`): one active adapter, not merged, not disabled, plain LoRA or DoRA (no other
LoRA variant), no ``lora_bias``, no ``fan_in_fan_out``, dropout 0 (or the module in eval mode), a
plain ``nn.Linear`` base, a bitsandbytes 4-bit / 8-bit one or tigon's FP8 one (:mod:`tigon.patch.quantized`), no
hooks that the fused path would bypass, no extra forward arguments, and dtypes that PEFT's path
would compute in. Anything else runs PEFT's forward, so toggling adapters, merging,
``disable_adapter()`` and PEFT's mixed-batch inference keep working. Parameters, the state dict and
therefore PEFT's own ``save_pretrained`` / ``from_pretrained`` are untouched.

Adapters kept in float32 on a half-precision model (PEFT's default ``autocast_adapter_dtype``) run
their GEMMs in the model's dtype, as they do under autocast; their gradients come back in float32.
A 4-bit base runs in its compute dtype (`bnb_4bit_compute_dtype`), dequantised bit for bit as
bitsandbytes does; an 8-bit base as ``x · dequant(W)ᵀ`` in x's dtype (bitsandbytes' own training
path on a CPU; on a GPU bitsandbytes also rounds x to int8, so the fused result is the more
precise one). DoRA's weight norm is taken in fp32 (PEFT takes it in x's dtype) and its output stays
in x's dtype (PEFT's is float32 under autocast).
"""

from __future__ import annotations

import functools
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import torch
from torch import nn

from tigon import functional as F
from tigon.ops import LoraProjection, autocast_dtype
from tigon.patch import quantized
from tigon.patch.modules import forward_attr, has_hooks


@dataclass(frozen=True)
class LoraSummary:
    """What the LoRA part of a :func:`tigon.patch` found; ``str()`` is the line it logged.

    Attributes:
        linears: PEFT LoRA linears that run tigon's path with the adapters as they are now.
        gated_mlps: gated MLPs (three of those linears each) that run as one fused op.
        left: LoRA layers left on PEFT's path, counted by reason (for the current adapter
            settings; the patched forwards re-check on every call).
        qkv_groups: attentions whose q/k/v linears run as one op.
        quantized: of the fused linears, those on a bitsandbytes base, by kind (nf4, fp4, int8).
        dora: of the fused linears, the DoRA ones.
    """

    linears: int
    gated_mlps: int
    left: dict[str, int] = field(default_factory=dict)
    qkv_groups: int = 0
    quantized: dict[str, int] = field(default_factory=dict)
    dora: int = 0

    def __str__(self) -> str:
        total = self.linears + sum(self.left.values())
        line = (
            f"tigon: fused LoRA on {self.linears} of {total} LoRA layers "
            f"({3 * self.gated_mlps} of them as {self.gated_mlps} gated MLPs"
            + (f", {3 * self.qkv_groups} as {self.qkv_groups} q/k/v groups)" if self.qkv_groups else ")")
        )
        kinds = [f"{n} on {kind} bases" for kind, n in sorted(self.quantized.items())]
        if kinds or self.dora:
            line += "; " + ", ".join(kinds + ([f"{self.dora} DoRA"] if self.dora else []))
        if self.left:
            reasons = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.left.items()))
            line += f"; left on PEFT's path: {reasons}"
        return line


def _linear_classes() -> tuple[type, ...]:
    """PEFT's LoRA linear classes: ``Linear``, and the bitsandbytes ones where bitsandbytes is
    imported (PEFT defines them only then)."""
    from peft.tuners.lora.layer import Linear

    bnb = sys.modules.get("peft.tuners.lora.bnb") if "bitsandbytes" in sys.modules else None
    extra = tuple(getattr(bnb, name) for name in ("Linear4bit", "Linear8bitLt") if hasattr(bnb, name))
    return (Linear, *extra)


def lora_classes_in(model: nn.Module) -> tuple[type, ...]:
    """PEFT's LoRA linear classes (see :func:`_linear_classes`) when `model` holds any PEFT LoRA
    layer, else ()."""
    if "peft" not in sys.modules:  # nothing can hold a PEFT layer without PEFT imported
        return ()
    from peft.tuners.lora import LoraLayer

    return _linear_classes() if any(isinstance(module, LoraLayer) for module in model.modules()) else ()


def _is_dora(layer: nn.Module, name: str) -> bool | None:
    """True for a DoRA adapter, False for plain LoRA, None for another LoRA variant."""
    variant = getattr(layer, "lora_variant", {}).get(name)
    if variant is None:
        return False if not getattr(layer, "use_dora", {}).get(name, False) else None
    from peft.tuners.lora.variants import DoraLinearVariant

    return True if type(variant) is DoraLinearVariant else None


def _dropout_is_identity(dropout: nn.Module) -> bool:
    if type(dropout) is nn.Identity:
        return True
    return type(dropout) is nn.Dropout and (dropout.p == 0 or not dropout.training)


class _Adapter(NamedTuple):
    """A PEFT LoRA linear's single active adapter, the modules its fused path reads."""

    name: str
    base: nn.Module
    lora_a: nn.Module
    lora_b: nn.Module
    magnitude: nn.Module | None


def _submodules(module: nn.Module, name: str) -> dict[str, nn.Module]:
    """The modules a ModuleDict attribute of `module` holds, read from the dicts that hold them:
    every forward of every LoRA linear asks, and nn.Module's __getattr__ (the path `module.name`
    takes for a submodule) costs about a microsecond a call."""
    return module._modules[name]._modules


def _base_of(layer: nn.Module) -> nn.Module:
    """PEFT's ``layer.get_base_layer()`` (the innermost ``base_layer`` of nested tuner layers),
    walking the submodule dicts instead of testing ``hasattr``, which raises and catches inside
    nn.Module's __getattr__ at the innermost layer."""
    base = layer
    while (inner := base._modules.get("base_layer")) is not None:
        base = inner
    return base


def _checked(layer: nn.Module) -> tuple[_Adapter | None, str | None]:
    """(the layer's adapter, None), or (None, why PEFT's path must run): see :func:`active_adapter`."""
    if layer.disable_adapters:
        return None, "adapters disabled"
    if layer.merged:
        return None, "merged"
    lora_as = _submodules(layer, "lora_A")
    active = [name for name in layer.active_adapters if name in lora_as]
    if len(active) != 1:
        return None, f"{len(active)} active adapters"
    name = active[0]
    dora = _is_dora(layer, name)
    if dora is None:
        return None, "a LoRA variant other than DoRA"
    if getattr(layer, "lora_bias", {}).get(name, False):
        return None, "lora_bias"
    if getattr(layer, "fan_in_fan_out", False):
        return None, "fan_in_fan_out"
    if not _dropout_is_identity(_submodules(layer, "lora_dropout")[name]):
        return None, "lora_dropout > 0 in training"
    base = _base_of(layer)
    if quantized.is_quantized_linear(base):
        reason = quantized.why_not(base)
        if reason is not None:
            return None, reason
    elif type(base) is not nn.Linear:
        return None, f"base layer is {type(base).__name__}, not nn.Linear"
    adapter = _Adapter(name, base, lora_as[name], _submodules(layer, "lora_B")[name],
                       _submodules(layer, "lora_magnitude_vector").get(name))
    if dora and adapter.magnitude is None:
        return None, "a DoRA adapter without its magnitude vector"
    if any(m is not None and has_hooks(m) for m in (base, adapter.lora_a, adapter.lora_b, adapter.magnitude)):
        return None, "hooks on the base or adapter modules"
    return adapter, None


def active_adapter(layer: nn.Module) -> tuple[str | None, str | None]:
    """(the single active adapter of a PEFT LoRA linear, None) or (None, why PEFT's path must run)."""
    adapter, reason = _checked(layer)
    return (None, reason) if adapter is None else (adapter.name, None)


def projection(layer: nn.Module, x: torch.Tensor) -> LoraProjection | None:
    """The layer's weights for the fused path on input `x`, or None when PEFT's path must run."""
    adapter, _ = _checked(layer)
    if adapter is None or not x.is_floating_point():
        return None
    scaling = layer.scaling[adapter.name]
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        return None
    base = adapter.base
    weight, bias = base.weight, base.bias
    lora_a, lora_b = adapter.lora_a._parameters["weight"], adapter.lora_b._parameters["weight"]
    magnitude = None if adapter.magnitude is None else adapter.magnitude.weight
    device = x.device
    if any(t is not None and t.device != device for t in (weight, lora_a, lora_b, bias, magnitude)):
        return None
    autocast = autocast_dtype(x) is not None
    if quantized.is_quantized_linear(base):
        # bitsandbytes computes a 4-bit base in its compute dtype: fused only where that is x's.
        compute = getattr(base, "compute_dtype", None) or x.dtype
        if not autocast and (compute != x.dtype or (bias is not None and bias.dtype != x.dtype)):
            return None
        weight = quantized.module_weight(base)
    elif not autocast and (weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype)):
        return None  # F.linear would refuse it: let PEFT's path raise its own error
    return LoraProjection(weight, lora_a, lora_b, scaling, bias, magnitude)


def runs(module: nn.Module, forward: Callable[..., Any]) -> bool:
    """Whether calling `module` ends in `forward`, bound to it by tigon.patch (and nothing else
    set on the instance in its place)."""
    return getattr(vars(module).get(forward_attr(module)), "__func__", None) is forward


@functools.lru_cache(maxsize=None)
def linear_forward(originals: tuple[tuple[type, Callable[..., torch.Tensor]], ...]) -> Callable[..., torch.Tensor]:
    """Forward for PEFT's LoRA linears, one function for every class in `originals` (pairs of
    class and PEFT's forward for it): :func:`tigon.functional.lora_linear` when the layer
    qualifies (:func:`projection`), else PEFT's forward of its class."""
    by_class = dict(originals)

    def forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        weights = None if args or kwargs else projection(self, x)
        if weights is None:
            return by_class[type(self)](self, x, *args, **kwargs)
        return F.lora_linear(x, *weights)

    forward.__qualname__ = "tigon_lora_Linear.forward"
    return forward


def summarize(
    model: nn.Module,
    classes: Sequence[type],
    gated_mlps: Iterable[Sequence[nn.Module]],
    qkv_groups: Iterable[Sequence[nn.Module]],
) -> LoraSummary:
    """Count the LoRA layers of `model` that qualify now (of `classes`, PEFT's LoRA linears), and
    why the others do not, those on quantised bases and the DoRA ones; and the `gated_mlps` and
    `qkv_groups` (each the projections that would run as one op) all of whose projections are
    qualifying LoRA linears."""
    from peft.tuners.lora import LoraLayer

    linears = dora = 0
    left: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    for module in model.modules():
        if type(module) in classes:
            name, reason = active_adapter(module)
            if reason is not None:
                left[reason] += 1
                continue
            linears += 1
            base = module.get_base_layer()
            if quantized.is_quantized_linear(base):
                kinds[quantized.kind(base)] += 1
            dora += bool(_is_dora(module, name))
        elif isinstance(module, LoraLayer):
            left[f"{type(module).__name__} layer"] += 1

    def qualifying(groups: Iterable[Sequence[nn.Module]]) -> int:
        return sum(all(type(p) in classes and active_adapter(p)[1] is None for p in group) for group in groups)

    return LoraSummary(linears, qualifying(gated_mlps), dict(left), qualifying(qkv_groups), dict(kinds), dora)
