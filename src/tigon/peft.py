"""Run PEFT LoRA layers through tigon's fused LoRA ops, in place, keeping PEFT in charge of everything else.

:func:`apply_lora_kernels` rebinds ``forward`` on the live modules of a PEFT model:

* every ``peft.tuners.lora.layer.Linear`` runs :func:`tigon.functional.lora_linear`;
* every gated MLP (``down(act(gate(x)) * up(x))``, the Llama/Mistral/Qwen/Gemma MLP) whose three
  projections are such layers runs :func:`tigon.functional.lora_gated_mlp`;
* every attention whose ``q_proj``, ``k_proj`` and ``v_proj`` are such layers, called on the same
  hidden states (Hugging Face's attention forwards), computes the three in one
  :func:`tigon.functional.lora_linear_group` when ``q_proj`` is called; ``k_proj`` and ``v_proj``
  are still called and hand back their part.

Each call checks that the fused path computes what PEFT would: one active adapter, not merged, not
disabled, no DoRA or other LoRA variant, no ``lora_bias``, no ``fan_in_fan_out``, dropout 0 (or
the module in eval mode), a plain ``nn.Linear`` base, no hooks that the fused path would bypass,
no extra forward arguments, and dtypes that ``F.linear`` would accept. Anything else runs the
forward that was there before, so toggling adapters, merging, ``disable_adapter()`` and PEFT's
mixed-batch inference keep working. Parameters, the state dict and therefore PEFT's own
``save_pretrained`` / ``from_pretrained`` are untouched.

Adapters kept in float32 on a half-precision model (PEFT's default ``autocast_adapter_dtype``) run
their GEMMs in the model's dtype, as they do under autocast; their gradients come back in float32.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from tigon import functional as F
from tigon._checks import has_hooks
from tigon.ops import LoraProjection, autocast_dtype
from tigon.patch.families import QKV_PROJECTIONS

log = logging.getLogger("tigon")

# The attribute holding the forward that a patched module falls back to (None: its class's).
_PREVIOUS = "_tigon_lora_previous_forward"
_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# How Hugging Face's gated MLPs (LlamaMLP and ~130 others) spell their forward.
_GATED_MLP_SOURCE = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"
# How Hugging Face's attention forwards call them: q, k and v, in that order, on one tensor.
_QKV_SOURCE = tuple(f"self.{name}(hidden_states)" for name in QKV_PROJECTIONS)
# On a q_proj: weak references to the k_proj and v_proj computed with it.
_GROUP = "_tigon_lora_group"
# On the input of a grouped q_proj call: {k_proj: its output, v_proj: its output} until they take it.
_GROUP_OUTPUTS = "_tigon_lora_group_outputs"


@dataclass(frozen=True)
class LoraKernels:
    """What :func:`apply_lora_kernels` did; ``str()`` is the line it logged.

    Attributes:
        linears: PEFT LoRA linears now running tigon's path.
        gated_mlps: gated MLPs (three of those linears each) running as one fused op.
        qkv_groups: attentions whose q/k/v linears run as one op.
        left: LoRA layers left on PEFT's path, counted by reason (for the current adapter
            settings; the patched ones re-check on every call).
    """

    linears: int
    gated_mlps: int
    left: dict[str, int] = field(default_factory=dict)
    qkv_groups: int = 0

    def __str__(self) -> str:
        total = self.linears + sum(self.left.values())
        line = (
            f"tigon: fused LoRA on {self.linears} of {total} LoRA layers "
            f"({3 * self.gated_mlps} of them as {self.gated_mlps} gated MLPs"
            + (f", {3 * self.qkv_groups} as {self.qkv_groups} q/k/v groups)" if self.qkv_groups else ")")
        )
        if self.left:
            reasons = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.left.items()))
            line += f"; left on PEFT's path: {reasons}"
        return line


def _lora_linear_class() -> type:
    from peft.tuners.lora.layer import Linear

    return Linear


def _dropout_is_identity(dropout: nn.Module) -> bool:
    if type(dropout) is nn.Identity:
        return True
    return type(dropout) is nn.Dropout and (dropout.p == 0 or not dropout.training)


def _active_adapter(layer: nn.Module) -> tuple[str | None, str | None]:
    """(the single active adapter of a PEFT LoRA linear, None) or (None, why PEFT's path must run)."""
    if layer.disable_adapters:
        return None, "adapters disabled"
    if layer.merged:
        return None, "merged"
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    if len(active) != 1:
        return None, f"{len(active)} active adapters"
    name = active[0]
    if name in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(name, False):
        return None, "DoRA or another LoRA variant"
    if getattr(layer, "lora_bias", {}).get(name, False):
        return None, "lora_bias"
    if getattr(layer, "fan_in_fan_out", False):
        return None, "fan_in_fan_out"
    if not _dropout_is_identity(layer.lora_dropout[name]):
        return None, "lora_dropout > 0 in training"
    base = layer.get_base_layer()
    if type(base) is not nn.Linear:
        return None, f"base layer is {type(base).__name__}, not nn.Linear"
    if any(has_hooks(m) for m in (base, layer.lora_A[name], layer.lora_B[name])):
        return None, "hooks on the base or adapter modules"
    return name, None


def _projection(layer: nn.Module, x: torch.Tensor) -> LoraProjection | None:
    """The layer's weights for the fused path on input `x`, or None when PEFT's path must run."""
    name, _ = _active_adapter(layer)
    if name is None or not x.is_floating_point():
        return None
    scaling = layer.scaling[name]
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        return None
    base = layer.get_base_layer()
    weight, bias = base.weight, base.bias
    lora_a, lora_b = layer.lora_A[name].weight, layer.lora_B[name].weight
    tensors = (weight, lora_a, lora_b) if bias is None else (weight, lora_a, lora_b, bias)
    if any(t.device != x.device for t in tensors):
        return None
    if autocast_dtype(x) is None and (weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype)):
        return None  # F.linear would refuse it: let PEFT's path raise its own error
    return LoraProjection(weight, lora_a, lora_b, scaling, bias)


def _previous_forward(module: nn.Module) -> Callable[..., Any]:
    previous = vars(module)[_PREVIOUS]
    return previous if previous is not None else types.MethodType(type(module).forward, module)


def _lora_linear_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    outputs = None if torch.compiler.is_compiling() else x.__dict__.get(_GROUP_OUTPUTS)
    if outputs is not None and self in outputs and not args and not kwargs:
        out = outputs.pop(self)
        if not outputs:
            del x.__dict__[_GROUP_OUTPUTS]
        return out
    projection = None if args or kwargs else _projection(self, x)
    if projection is None:
        return _previous_forward(self)(x, *args, **kwargs)
    members = _group_members(self)
    if members:
        rest = [_projection(member, x) for member in members]
        if all(p is not None for p in rest):
            first, *others = F.lora_linear_group(x, [projection, *rest])
            x.__dict__[_GROUP_OUTPUTS] = dict(zip(members, others))
            return first
    return F.lora_linear(x, *projection)


def _group_members(layer: nn.Module) -> list[nn.Module]:
    """The k_proj and v_proj to compute with the q_proj `layer`, if it heads a live group that is
    still ours (not under torch.compile, whose traced code reads no tensor attributes)."""
    refs = vars(layer).get(_GROUP)
    if refs is None or torch.compiler.is_compiling():
        return []
    members = [ref() for ref in refs]
    if any(m is None or _PREVIOUS not in vars(m) for m in members):
        return []
    return members


def _activation(act_fn: nn.Module) -> str | None:
    """tigon's name for the gated MLP's activation module, or None for one it does not fuse."""
    name = type(act_fn).__name__
    if isinstance(act_fn, nn.SiLU) or name == "SiLUActivation":
        return "silu"
    if isinstance(act_fn, nn.GELU):
        return "gelu_tanh" if act_fn.approximate == "tanh" else "gelu"
    if name in ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation"):
        return "gelu_tanh"
    if name == "GELUActivation":
        return "gelu"
    return None


def _gated_mlp_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    activation = _activation(self.act_fn)
    if activation is not None and not args and not kwargs and not has_hooks(self.act_fn):
        layers = [getattr(self, name) for name in _MLP_PROJECTIONS]
        if not any(has_hooks(layer, _lora_linear_forward) for layer in layers):
            projections = [_projection(layer, x) for layer in layers]
            if all(p is not None for p in projections):
                return F.lora_gated_mlp(x, *projections, activation=activation)
    return _previous_forward(self)(x, *args, **kwargs)


@functools.lru_cache(maxsize=None)
def _forward_source(cls: type) -> str:
    """The source of the class that defines `cls`'s forward, as written in its file (so a forward
    patched in at run time does not hide it); empty when it cannot be read."""
    for klass in cls.__mro__:
        if klass is nn.Module:
            break
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            return ""
        if "def forward" in source:
            return source
    return ""


def _is_qkv_attention(module: nn.Module, lora_linear: type) -> bool:
    if not all(type(getattr(module, name, None)) is lora_linear for name in QKV_PROJECTIONS):
        return False
    source = _forward_source(type(module))
    return all(call in source for call in _QKV_SOURCE)


def _is_gated_mlp(module: nn.Module, lora_linear: type, mlp_classes: frozenset[str]) -> bool:
    if not all(type(getattr(module, name, None)) is lora_linear for name in _MLP_PROJECTIONS):
        return False
    if not isinstance(getattr(module, "act_fn", None), nn.Module):
        return False
    cls = type(module)
    return cls.__name__ in mlp_classes or _GATED_MLP_SOURCE in _forward_source(cls)


def _rebind(module: nn.Module, forward: Callable[..., Any]) -> bool:
    """Set `forward` on `module`, remembering what was there; False if it is already set."""
    if _PREVIOUS in vars(module):
        return False
    setattr(module, _PREVIOUS, vars(module).get("forward"))
    module.forward = types.MethodType(forward, module)
    return True


def apply_lora_kernels(
    model: nn.Module, *, gated_mlp: bool = True, mlp_classes: Iterable[str] = ()
) -> LoraKernels:
    """Make the PEFT LoRA linears of `model` (and the gated MLPs built of them) run tigon's fused
    LoRA ops, in place. Call it after any other patching of the same modules.

    Args:
        model: a PEFT model (``get_peft_model`` / ``PeftModel.from_pretrained``) or any module
            containing PEFT LoRA layers; on any device.
        gated_mlp: also fuse each gated MLP whose gate/up/down projections are all LoRA linears
            into one op (:func:`tigon.functional.lora_gated_mlp`).
        mlp_classes: names of further MLP classes that compute ``down(act(gate(x)) * up(x))``
            (Hugging Face's are recognised from their source).

    Returns:
        A :class:`LoraKernels` summary, also logged as one line: how many layers run tigon's path
        with the adapters as they are now, and why the others stay on PEFT's. The patched forwards
        re-check on every call, so later adapter changes are honoured either way.

    Undo with :func:`remove_lora_kernels`. Calling it twice patches nothing twice.
    """
    lora_linear = _lora_linear_class()
    from peft.tuners.lora.layer import LoraLayer

    mlp_classes = frozenset(mlp_classes)
    linears = gated_mlps = qkv_groups = 0
    left: Counter[str] = Counter()
    for module in model.modules():
        if type(module) is lora_linear:
            _rebind(module, _lora_linear_forward)
            _, reason = _active_adapter(module)
            if reason is None:
                linears += 1
            else:
                left[reason] += 1
        elif isinstance(module, LoraLayer):
            left[f"{type(module).__name__} layer"] += 1
        elif gated_mlp and _is_gated_mlp(module, lora_linear, mlp_classes):
            _rebind(module, _gated_mlp_forward)
            layers = [getattr(module, name) for name in _MLP_PROJECTIONS]
            if _activation(module.act_fn) and all(_active_adapter(layer)[1] is None for layer in layers):
                gated_mlps += 1
        elif _is_qkv_attention(module, lora_linear):
            q_proj, *members = (getattr(module, name) for name in QKV_PROJECTIONS)
            vars(q_proj).setdefault(_GROUP, tuple(weakref.ref(m) for m in members))
            if all(_active_adapter(getattr(module, name))[1] is None for name in QKV_PROJECTIONS):
                qkv_groups += 1
    summary = LoraKernels(linears, gated_mlps, dict(left), qkv_groups)
    log.info("%s", summary)
    return summary


def remove_lora_kernels(model: nn.Module) -> int:
    """Restore the forwards :func:`apply_lora_kernels` replaced on `model`; returns how many."""
    restored = 0
    for module in model.modules():
        vars(module).pop(_GROUP, None)
        if _PREVIOUS not in vars(module):
            continue
        previous = vars(module)[_PREVIOUS]
        delattr(module, _PREVIOUS)
        if previous is None:
            del module.forward
        else:
            module.forward = previous
        restored += 1
    return restored
