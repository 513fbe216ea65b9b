"""Apply and undo the family table: on transformers' classes, or on a live model's modules.

Two ways in, one plan:

* ``patch("llama")`` sets the replacement forwards on the classes of
  ``transformers.models.llama.modeling_llama`` (and swaps its module-level functions), so every
  model of that family built afterwards, and every one already built, runs tigon's code.
* ``patch(model)`` rebinds ``forward`` on the matching modules of that one model (plain, on any
  device, or inside a PEFT wrapper); parameters, buffers and the state dict are untouched.
  Module-level functions (RoPE) have no per-model home, so those are swapped in the family's module
  and restored when the last patch that needed them is undone.

Everything is planned and checked before anything changes, so an error leaves nothing half-patched.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from tigon import offload, tiled
from tigon.patch import forwards
from tigon.patch.families import FAMILIES, Family

log = logging.getLogger("tigon")

SWITCHES = (
    "rms_norm", "rope", "swiglu", "geglu", "layer_norm", "add_rms_norm", "qkv_group",
    "linear_cross_entropy", "cross_entropy", "lora",
)


@dataclass(frozen=True)
class Patched:
    """What one :func:`patch` call applied; ``str()`` is the line it logged."""

    target: str
    model_type: str
    applied: tuple[str, ...]
    layers: int | None = None

    def __str__(self) -> str:
        what = ", ".join(self.applied) if self.applied else "nothing"
        layers = f" ({self.layers} layers)" if self.layers is not None else ""
        return f"tigon: applied {what} to {self.target}{layers}"


@dataclass(frozen=True)
class _Replacement:
    switch: str
    owner: Any  # a class (its `name` attribute is a method) or the family's modeling module
    name: str
    new: Callable[..., Any]
    also: tuple[str, ...] = ()  # further switches `new` wraps in (tiled_mlp, offload_activations)

    @property
    def per_module(self) -> bool:
        """Whether instance patching binds it per module (methods) or swaps it module-wide."""
        return isinstance(self.owner, type)


# Class- and module-level swaps, shared by every patch that needs them: (owner, name) ->
# [owner, original, replacement, holders].
_MISSING = object()
_shared: dict[tuple[int, str], list[Any]] = {}
# model_type -> the shared swaps a class patch holds.
_class_patches: dict[str, list[tuple[int, str]]] = {}
# model -> (instance swaps [(module, attr, previous)], shared swaps it holds, whether tigon.peft's
# LoRA kernels were applied).
_instance_patches: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[list, list]]" = weakref.WeakKeyDictionary()


def _original(owner: Any, name: str) -> Any:
    """`owner.name` as transformers defines it, even while a class patch replaces it."""
    entry = _shared.get((id(owner), name))
    return getattr(owner, name) if entry is None else entry[1]


def _acquire(owner: Any, name: str, new: Callable[..., Any]) -> tuple[int, str]:
    key = (id(owner), name)
    entry = _shared.get(key)
    if entry is None:
        entry = _shared[key] = [owner, vars(owner).get(name, _MISSING), new, 0]
        setattr(owner, name, new)
    elif entry[2] is not new:
        raise RuntimeError(f"tigon: {owner.__name__}.{name} is already replaced by {entry[2]!r}")
    entry[3] += 1
    return key


def _release(key: tuple[int, str]) -> None:
    entry = _shared[key]
    entry[3] -= 1
    if entry[3]:
        return
    owner, original, _, _ = _shared.pop(key)
    if original is _MISSING:
        delattr(owner, key[1])
    else:
        setattr(owner, key[1], original)


def _family(model_type: str) -> tuple[Family, types.ModuleType]:
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"tigon.patch does not support model_type {model_type!r}; supported: "
            f"{', '.join(sorted(FAMILIES))}"
        )
    module = importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")
    return family, module


def _wrap(plan: list[_Replacement], switch: str, owner: Any, wrap: Callable[..., Any]) -> None:
    """Wrap `owner.forward` in `wrap`: the forward planned for it if any, else the original."""
    for i, replacement in enumerate(plan):
        if replacement.owner is owner and replacement.name == "forward":
            plan[i] = _Replacement(
                replacement.switch, owner, "forward", wrap(replacement.new), (*replacement.also, switch)
            )
            return
    plan.append(_Replacement(switch, owner, "forward", wrap(_original(owner, "forward"))))


def _plan(family: Family, module: types.ModuleType, switches: dict[str, bool]) -> list[_Replacement]:
    """The replacements the switches turn on for `family`, checked against `module`."""
    missing: list[str] = []

    def find(name: str) -> Any:
        if not hasattr(module, name):
            missing.append(name)
        return getattr(module, name, None)

    plan: list[_Replacement] = []
    if switches["rms_norm"]:
        plan.append(_Replacement("rms_norm", find(family.norm.cls), "forward", forwards.rms_norm_forward(family.norm)))
    if switches["rope"] and find(family.rope.function) is not None:
        original = _original(module, family.rope.function)
        plan.append(_Replacement("rope", module, family.rope.function, forwards.rope_function(family.rope, original)))
    patched_mlp = None
    if family.mlp is not None and switches[family.mlp.switch]:
        cls = find(family.mlp.cls)
        if cls is not None:
            patched_mlp = forwards.mlp_forward(family.mlp, _original(cls, "forward"))
            plan.append(_Replacement(family.mlp.switch, cls, "forward", patched_mlp))
    loss_switch = next((name for name in ("linear_cross_entropy", "cross_entropy") if switches[name]), None)
    causal_lm = find(family.causal_lm)
    aux_loss = find(family.head.aux_loss) if family.head.aux_loss else None
    if loss_switch is not None and causal_lm is not None:
        original = _original(causal_lm, "forward")
        fused = loss_switch == "linear_cross_entropy"
        forward = forwards.causal_lm_forward(family.head, fused, original, aux_loss)
        plan.append(_Replacement(loss_switch, causal_lm, "forward", forward))
        masking = sys.modules.get("transformers.masking_utils")
        if fused and masking is not None and hasattr(masking, "find_packed_sequence_indices"):
            finder = forwards.packed_sequence_finder(_original(masking, "find_packed_sequence_indices"))
            plan.append(_Replacement(loss_switch, masking, "find_packed_sequence_indices", finder))
    layer = find(family.layer.cls)
    if switches["add_rms_norm"] and family.layer.fuse is not None and layer is not None:
        # The layer runs its MLP in one op with the add + RMSNorm before it only where that MLP runs
        # tigon's own forward (not under tiled_mlp, which wraps it).
        joins_mlp = patched_mlp is not None and not switches["tiled_mlp"]
        fused = forwards.decoder_layer_forward(
            family.layer, family.norm, _original(layer, "forward"),
            family.mlp if joins_mlp else None, patched_mlp if joins_mlp else None,
        )
        plan.append(_Replacement("add_rms_norm", layer, "forward", fused))
    if switches["qkv_group"] and family.attention is not None:
        cls = find(family.attention)
        if cls is not None:
            grouped = forwards.attention_forward(family.attention, _original(cls, "forward"))
            plan.append(_Replacement("qkv_group", cls, "forward", grouped))
    mlp_cls = find(family.mlp.cls) if switches["tiled_mlp"] and family.mlp is not None else None
    if mlp_cls is not None:
        _wrap(plan, "tiled_mlp", mlp_cls, tiled.tiled_forward)
    if switches["offload_activations"] and causal_lm is not None:
        _wrap(plan, "offload_activations", causal_lm, offload.offloaded_forward)
    if missing:
        raise ValueError(
            f"tigon.patch: {module.__name__} has no {', '.join(missing)} "
            "(an unsupported transformers version?); nothing was patched"
        )
    return plan


def _switches(kwargs: dict[str, bool]) -> dict[str, bool]:
    if kwargs["linear_cross_entropy"] and kwargs["cross_entropy"]:
        raise ValueError(
            "linear_cross_entropy and cross_entropy are exclusive: linear_cross_entropy already "
            "computes the loss from the hidden states without logits; pass cross_entropy=False"
        )
    return kwargs


def _find_hf_model(model: torch.nn.Module) -> torch.nn.Module:
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise ValueError(
        f"tigon.patch: {type(model).__name__} contains no Hugging Face PreTrainedModel to patch"
    )


def _patch_classes(model_type: str, switches: dict[str, bool]) -> Patched:
    family, module = _family(model_type)
    plan = _plan(family, module, switches)
    unpatch(model_type)
    held = []
    try:
        for replacement in plan:
            held.append(_acquire(replacement.owner, replacement.name, replacement.new))
    except BaseException:
        for key in held:
            _release(key)
        raise
    _class_patches[model_type] = held
    applied = (name for r in plan for name in (r.switch, *r.also))
    return Patched(f"{model_type} classes", model_type, tuple(dict.fromkeys(applied)))


def _forward_attr(module: torch.nn.Module) -> str:
    # accelerate's hooks (device_map loading, offload) own `forward` and call `_old_forward`.
    return "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"


def _patch_instance(model: torch.nn.Module, switches: dict[str, bool]) -> Patched:
    hf_model = _find_hf_model(model)
    model_type = hf_model.config.model_type
    family, module = _family(model_type)
    plan = _plan(family, module, switches)
    unpatch(model)
    bound: list[tuple[torch.nn.Module, str, Any]] = []
    held: list[tuple[int, str]] = []
    applied: dict[str, None] = {}
    lora = False
    try:
        for replacement in plan:
            if not replacement.per_module:
                held.append(_acquire(replacement.owner, replacement.name, replacement.new))
                applied.update(dict.fromkeys((replacement.switch, *replacement.also)))
                continue
            for sub in model.modules():
                if isinstance(sub, replacement.owner):
                    attr = _forward_attr(sub)
                    bound.append((sub, attr, vars(sub).get(attr, _MISSING)))
                    setattr(sub, attr, types.MethodType(replacement.new, sub))
                    applied.update(dict.fromkeys((replacement.switch, *replacement.also)))
        if switches["lora"] and _has_lora_layers(model):
            lora = True
            # After the forwards above: the LoRA kernels fall back to whatever forward they replace.
            from tigon.peft import apply_lora_kernels

            mlp = family.mlp
            # A fused LoRA MLP would replace the tiled forward: under tiled_mlp the chunks run the
            # LoRA linears' kernels instead.
            summary = apply_lora_kernels(
                model, gated_mlp=not switches["tiled_mlp"], mlp_classes=[mlp.cls] if mlp and not mlp.packed else []
            )
            if summary.linears:
                applied["lora"] = None
    except BaseException:
        _undo_instance(model, bound, held, lora)
        raise
    if switches["add_rms_norm"] and family.layer.fuse is not None:
        _link_next_norms(model, family, module, switches["rms_norm"], bound)
    _instance_patches[model] = (bound, held, lora)
    layer_cls = getattr(module, family.layer.cls)
    layers = sum(isinstance(sub, layer_cls) for sub in model.modules())
    return Patched(type(hf_model).__name__, model_type, tuple(applied), layers)


def _link_next_norms(
    model: torch.nn.Module, family: Family, module: types.ModuleType, final_norm: bool,
    bound: list[tuple[torch.nn.Module, str, Any]],
) -> None:
    """Tell each decoder layer of `model` the norm its output goes through next (the following
    layer's input norm; after the last layer the model's final norm, when the rms_norm switch
    patched it to take what the layer leaves), so its closing residual add fuses with it."""
    layer_cls, norm_cls = getattr(module, family.layer.cls), getattr(module, family.norm.cls)
    for sub in model.modules():
        layers = getattr(sub, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList) or not layers:
            continue
        if not all(isinstance(layer, layer_cls) and isinstance(layer.input_layernorm, norm_cls) for layer in layers):
            continue
        final = getattr(sub, "norm", None)
        nexts = [layer.input_layernorm for layer in layers[1:]]
        nexts.append(final if final_norm and isinstance(final, norm_cls) else None)
        for layer, next_norm in zip(layers, nexts):
            if next_norm is not None:
                bound.append((layer, forwards.NEXT_NORM, vars(layer).get(forwards.NEXT_NORM, _MISSING)))
                setattr(layer, forwards.NEXT_NORM, weakref.ref(next_norm))


def _has_lora_layers(model: torch.nn.Module) -> bool:
    if "peft" not in sys.modules:  # nothing can hold a PEFT layer without PEFT imported
        return False
    from peft.tuners.lora import LoraLayer

    return any(isinstance(module, LoraLayer) for module in model.modules())


def _undo_instance(
    model: torch.nn.Module, bound: list[tuple[torch.nn.Module, str, Any]], held: list[tuple[int, str]], lora: bool
) -> None:
    if lora:
        from tigon.peft import remove_lora_kernels

        remove_lora_kernels(model)
    for sub, attr, previous in reversed(bound):
        if previous is _MISSING:
            delattr(sub, attr)
        else:
            setattr(sub, attr, previous)
    for key in held:
        _release(key)


def patch(
    target: str | torch.nn.Module,
    *,
    rms_norm: bool = True,
    rope: bool = True,
    swiglu: bool = True,
    geglu: bool = True,
    layer_norm: bool = True,
    add_rms_norm: bool = True,
    qkv_group: bool = True,
    linear_cross_entropy: bool = True,
    cross_entropy: bool = False,
    lora: bool = True,
    offload_activations: bool = False,
    tiled_mlp: bool = False,
) -> Patched:
    """Make a Hugging Face decoder model run tigon's kernels; outputs, loss and gradients unchanged.

    Args:
        target: a ``config.model_type`` (``"llama"``, ``"qwen2"``, ...) to patch that family's
            transformers classes, for models built before or after the call; or a model instance
            (plain, on any device, or wrapped by PEFT) to patch only its modules, in place.
        rms_norm ... lora: one switch per kernel; a switch a family has no use for is ignored.
            `linear_cross_entropy` (loss straight from the hidden states, logits never
            materialised) and `cross_entropy` (loss from materialised logits) are exclusive.
            `qkv_group` computes an attention's q/k/v projections as one op
            (:func:`tigon.functional.linear_group`), so that backward accumulates their input
            gradient in its GEMMs instead of adding three copies.
        offload_activations: under gradient checkpointing, keep each layer's checkpointed hidden
            states in pinned host memory, copied back one layer ahead in backward
            (:mod:`tigon.offload`). Exact; off by default.
        tiled_mlp: run the MLP over chunks of tokens so its tokens x intermediate tensors never
            exist whole, in forward or recomputation (:mod:`tigon.tiled`). Exact; costs one more
            MLP forward per step; off by default.

    Returns:
        What was applied; the same line is logged at INFO level on the ``tigon`` logger.
        Patching a target again first undoes its previous patch.

    Raises:
        ValueError: an unsupported model type (the message lists the supported ones), a target
            that is neither, or both loss switches; nothing is patched then.
    """
    switches = _switches(dict(
        rms_norm=rms_norm, rope=rope, swiglu=swiglu, geglu=geglu, layer_norm=layer_norm,
        add_rms_norm=add_rms_norm, qkv_group=qkv_group, linear_cross_entropy=linear_cross_entropy,
        cross_entropy=cross_entropy, lora=lora, offload_activations=offload_activations, tiled_mlp=tiled_mlp,
    ))
    if isinstance(target, str):
        result = _patch_classes(target, switches)
    elif isinstance(target, torch.nn.Module):
        result = _patch_instance(target, switches)
    else:
        raise ValueError(
            f"target must be a model_type string or a torch.nn.Module, got {type(target).__name__}"
        )
    log.info("%s", result)
    return result


def unpatch(target: str | torch.nn.Module | None = None) -> None:
    """Undo :func:`patch` for `target` (the same string or model), or for everything when None.

    Undoing something that was not patched does nothing.
    """
    if target is None:
        for model in list(_instance_patches):
            unpatch(model)
        for model_type in list(_class_patches):
            unpatch(model_type)
    elif isinstance(target, str):
        for key in _class_patches.pop(target, []):
            _release(key)
    elif isinstance(target, torch.nn.Module):
        undo = _instance_patches.pop(target, None)
        if undo is not None:
            _undo_instance(target, *undo)
    else:
        raise ValueError(
            f"target must be a model_type string, a torch.nn.Module or None, got {type(target).__name__}"
        )
