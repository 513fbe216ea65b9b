"""Apply and undo the family table: on transformers' classes, or on a live model's modules.

Two ways in, one plan:

* ``patch("llama")`` sets the replacement forwards on the classes of
  ``transformers.models.llama.modeling_llama`` (and swaps its module-level functions), so every
  model of that family built afterwards, and every one already built, runs tigon's code.
* ``patch(model)`` rebinds ``forward`` on the matching modules of that one model (plain, on any
  device, or inside a PEFT wrapper); parameters, buffers and the state dict are untouched.
  Module-level functions (RoPE) have no per-model home, so those are swapped in the family's module
  and restored when the last patch that needed them is undone. Modules of classes from outside the
  family's module (torch's LayerNorm, PEFT's LoRA layers: :mod:`tigon.patch.lora`) are replaced
  this way only, and so are mixture-of-experts experts, which the model's experts implementation
  (a setting of its config, which transformers' experts modules dispatch on) sends to tigon's op.

Everything is planned and checked before anything changes, so an error leaves nothing half-patched;
one record per patch says what to restore.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from tigon.patch import forwards, fp8 as float8, head, offload, tiled, trl_head, vision
from tigon.patch import lora as peft_lora
from tigon.patch.families import FAMILIES, VLM_FAMILIES, VLM_OVER_TEXT, Family, modeling_module, vision_over_text
from tigon.patch.handoff import LayerPlan, Relay
from tigon.patch.modules import forward_attr
from tigon.patch.rope import rope_function
from tigon.patch.switches import check_switch_names

log = logging.getLogger("tigon")


@dataclass(frozen=True)
class Patched:
    """What one :func:`patch` call applied; ``str()`` is the line it logged.

    Attributes:
        target: what was patched (the model's class, or ``"<model_type> classes"``).
        model_type: the family.
        applied: the switches that replaced something, in the order applied.
        layers: the model's decoder layers (instance patching only).
        lora: on a PEFT model with the ``lora`` switch on, what its LoRA layers run (its line is
            logged before this one).
        role: what the line calls the model besides its class (a run's frozen reference, say).
        fp8: what :mod:`tigon.patch.fp8` swapped for FP8 linears (``"fp8 rowwise (112 linears)"``).
    """

    target: str
    model_type: str
    applied: tuple[str, ...]
    layers: int | None = None
    lora: peft_lora.LoraSummary | None = None
    role: str | None = None
    fp8: str | None = None

    def __str__(self) -> str:
        what = ", ".join((*self.applied, *(() if self.fp8 is None else (self.fp8,)))) or "nothing"
        layers = f" ({self.layers} layers)" if self.layers is not None else ""
        role = f" ({self.role})" if self.role else ""
        return f"tigon: applied {what} to {self.target}{layers}{role}"


@dataclass(frozen=True)
class _Replacement:
    switch: str
    owner: Any  # a class (its `name` attribute is a method) or the family's modeling module
    name: str
    # The replacement; with `planned`, what makes it for a plan: new(plan) -> forward.
    new: Callable[..., Any]
    also: tuple[str, ...] = ()  # further switches `new` wraps in (tiled_mlp, offload_activations)
    # A class from outside the family's module (torch's LayerNorm, PEFT's LoRA Linear): bound only on
    # a model instance, on modules of exactly that class. A class patch would reach every model of
    # the process; a subclass may compute something else. A module outside transformers (TRL's)
    # is swapped for model instances only, too.
    foreign: bool = False
    planned: bool = False
    # A module-wide swap that serves its switch's per-module replacement before it in the plan: on a
    # model instance, taken only if that one bound a module (a sequence classifier has no LM head).
    companion: bool = False

    def made(self, plan: LayerPlan) -> Callable[..., Any]:
        """The replacement, bound to `plan` where it reads one."""
        return self.new(plan) if self.planned else self.new

    @property
    def per_module(self) -> bool:
        """Whether instance patching binds it per module (methods) or swaps it module-wide."""
        return isinstance(self.owner, type)

    def binds_on(self, module: torch.nn.Module) -> bool:
        return type(module) is self.owner if self.foreign else isinstance(module, self.owner)


# Class- and module-level swaps, shared by every patch that needs them: (owner, name) ->
# [owner, original, replacement, holders].
_MISSING = object()
_shared: dict[tuple[int, str], list[Any]] = {}


@dataclass
class _ClassPatch:
    """What a class patch holds: the shared swaps, and the relay its forwards share, the
    forwards made for it and the switches they were made for (patching again with the same
    switches installs the identical functions: stable for torch.compile)."""

    switches: dict[str, bool]
    relay: Relay
    made: list[Callable[..., Any]]
    held: list[tuple[int, str]] = field(default_factory=list)


_class_patches: dict[str, _ClassPatch] = {}  # by model_type


@dataclass
class _Undo:
    """What one instance patch changed (and what :func:`add_hidden_output` and :func:`lent_methods`
    rebound on the model), for :func:`unpatch` to restore, with the plan the model's forwards are
    bound to. The modules changed are held by weak reference: the record is the value of a
    weak-keyed map from the model, and a strong reference to the model (or to any module that is
    it) would keep a patched model alive after its user let go of it. (The layer plans hold the
    norms after each layer, which hold nothing above them.)"""

    relay: Relay | None = None  # the one channel of the model's patched forwards (None: not patched, only lent methods)
    layers: list[LayerPlan] = field(default_factory=list)  # the decoder layers' plans, in order
    hidden_output: bool = False  # add_hidden_output rebound the causal LM's forward
    forwards: list[tuple[weakref.ref, str, Any]] = field(default_factory=list)  # (module, attr, previous)
    shared: list[tuple[int, str]] = field(default_factory=list)
    experts: tuple[weakref.ref, str] | None = None  # (the HF model, its experts implementation before)
    hub_kernels: weakref.ref | None = None  # the HF model whose transformers hub kernels were switched off
    fp8: float8.Conversion | None = None  # the linears swapped for FP8 ones

    def run(self) -> None:
        if self.fp8 is not None:
            float8.restore(self.fp8)
        if self.experts is not None:
            hf_model, previous = self.experts[0](), self.experts[1]
            if hf_model is not None:
                hf_model.set_experts_implementation(previous)
        for ref, attr, previous in reversed(self.forwards):
            module = ref()
            if module is None:
                continue
            if previous is _MISSING:
                delattr(module, attr)
            else:
                setattr(module, attr, types.MethodType(previous.func, module) if isinstance(previous, _Rebound)
                        else previous)
        _release_all(self.shared)
        hf_model = self.hub_kernels() if self.hub_kernels is not None else None
        if hf_model is not None:
            hf_model.use_kernels = True


@dataclass(frozen=True)
class _Rebound:
    """A forward bound to its own module (PEFT's, a trainer's), kept as its function: the bound
    method would hold the module strongly."""

    func: Any


def _previous(module: torch.nn.Module, attr: str) -> Any:
    """What `module` holds as `attr` itself (not through its class), to restore on undo."""
    previous = vars(module).get(attr, _MISSING)
    if isinstance(previous, types.MethodType) and previous.__self__ is module:
        return _Rebound(previous.__func__)
    return previous


def _release_all(keys: list[tuple[int, str]]) -> None:
    """Give back the replacements shared beyond one model (a class's or a module's function, e.g.
    TRL's)."""
    for key in keys:
        _release(key)
    keys.clear()


# What the models collected while patched held, given back at the next patch or unpatch call: the
# collector runs at any allocation, and a module function swapped back between another model's
# forward and its checkpoint recomputation would recompute that forward with other tensors.
_collected_holds: list[tuple[int, str]] = []


def _hold_until_next_call(keys: list[tuple[int, str]]) -> None:
    _collected_holds.extend(keys)
    keys.clear()


def release_collected() -> None:
    """Give back the module functions that patched models since collected held (:func:`patch` and
    :func:`unpatch` do it first), for a caller that knows no forward still awaits its backward (a
    test harness between tests): the models built next run their family's own functions."""
    _release_all(_collected_holds)


def holds_shared_functions() -> bool:
    """Whether a patched model, alive or awaiting the collector, still holds a replaced class or
    module function (a family's RoPE, TRL's log-probs): when not, no collection can change what
    the next model runs."""
    return bool(_shared)


_instance_patches: "weakref.WeakKeyDictionary[torch.nn.Module, _Undo]" = weakref.WeakKeyDictionary()


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


def _family(model_type: str, text_type: str | None = None) -> tuple[Family, types.ModuleType]:
    """The family of `model_type` and its modeling module; for a multimodal model over a text
    family's language model (:data:`VLM_OVER_TEXT`), `text_type` names that family."""
    if model_type in VLM_OVER_TEXT:
        if text_type is None:
            raise ValueError(
                f"tigon.patch({model_type!r}): the language model of a {model_type} model is of the family its "
                "config's text_config names; patch the model instance instead"
            )
        text, module = _family(text_type)
        return vision_over_text(model_type, text), module
    family = FAMILIES.get(model_type) or VLM_FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"tigon.patch does not support model_type {model_type!r}; supported: "
            f"{', '.join(sorted((*FAMILIES, *VLM_FAMILIES, *VLM_OVER_TEXT)))}"
        )
    return family, _modeling(model_type, modeling_module(family))


def _modeling(model_type: str, name: str) -> types.ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if not err.name or not name.startswith(err.name):
            raise
        import transformers

        raise ValueError(
            f"tigon.patch: model_type {model_type!r} needs {name}, which transformers "
            f"{transformers.__version__} does not have; nothing was patched"
        ) from None


def _wrap(plan: list[_Replacement], switch: str, owner: Any, wrap: Callable[..., Any]) -> None:
    """Wrap `owner.forward` in `wrap`: the forward planned for it if any, else the original."""
    for i, replacement in enumerate(plan):
        if replacement.owner is owner and replacement.name == "forward":
            inner = replacement.new
            new = (lambda plan: wrap(inner(plan))) if replacement.planned else wrap(inner)
            plan[i] = _Replacement(
                replacement.switch, owner, "forward", new, (*replacement.also, switch), planned=replacement.planned
            )
            return
    plan.append(_Replacement(switch, owner, "forward", wrap(_original(owner, "forward"))))


def _plan(
    family: Family, module: types.ModuleType, switches: dict[str, bool], lora_classes: tuple[type, ...] = ()
) -> list[_Replacement]:
    """The replacements the switches turn on for `family`, checked against `module`; with
    `lora_classes` (PEFT's LoRA linear classes, for a model holding LoRA layers and the lora
    switch on), those of the LoRA layers too."""
    missing: list[str] = []
    head_module = module if family.head_module is None else _modeling(family.head_module, modeling_module(family.head_module))

    def find(name: str, where: types.ModuleType = module) -> Any:
        if not hasattr(where, name):
            missing.append(f"{where.__name__}.{name}")
        return getattr(where, name, None)

    plan: list[_Replacement] = []
    for norm in family.norms:
        if not switches[norm.switch]:
            continue
        if norm.in_torch:
            layer_norm = forwards.layer_norm_forward(norm, _original(torch.nn.LayerNorm, "forward"))
            plan.append(_Replacement("layer_norm", torch.nn.LayerNorm, "forward", layer_norm, foreign=True))
            continue
        cls = find(norm.cls)
        if cls is None:
            continue
        if norm.kind == "rms":
            plan.append(_Replacement(norm.switch, cls, "forward", functools.partial(forwards.rms_norm_forward, norm),
                                     planned=True))
        else:
            layer_norm = forwards.layer_norm_forward(norm, _original(cls, "forward"))
            plan.append(_Replacement(norm.switch, cls, "forward", layer_norm))
    for rope in family.ropes if switches["rope"] else ():
        if find(rope.function) is not None:
            original = _original(module, rope.function)
            plan.append(_Replacement("rope", module, rope.function, rope_function(rope, original)))
    lora_forward = (
        peft_lora.linear_forward(tuple((cls, _original(cls, "forward")) for cls in lora_classes)) if lora_classes else None
    )
    mlp = family.mlp
    mlp_cls = find(mlp.cls) if mlp is not None else None
    glu_ops = mlp_cls is not None and mlp.gated and switches[mlp.switch]
    lora_mlp = lora_forward if mlp_cls is not None and _lora_mlp(family, switches) else None
    patched_mlp = None
    recompute = ("recompute_mlp",) if switches["recompute_mlp"] else ()
    if glu_ops or lora_mlp is not None:
        make_mlp = functools.partial(
            forwards.mlp_forward, mlp, _original(mlp_cls, "forward"), glu_ops, lora_mlp, lora_forward,
            switches["recompute_mlp"],
        )
        patched_mlp = make_mlp()  # how the decoder layer knows the MLP's forward as tigon's own
        plan.append(_Replacement(mlp.switch if glu_ops else "lora", mlp_cls, "forward", make_mlp, recompute,
                                 planned=True))
    for other in family.other_mlps:
        if not switches[other.switch]:
            continue
        cls = find(other.cls, module if other.module is None else _modeling(other.module, modeling_module(other)))
        if cls is None:
            continue
        original = _original(cls, "forward")
        if other.gated:
            plan.append(_Replacement(other.switch, cls, "forward", functools.partial(
                forwards.mlp_forward, other, original, True, None, lora_forward, switches["recompute_mlp"]),
                planned=True))
        else:
            plan.append(_Replacement(other.switch, cls, "forward", vision.gelu_mlp_forward(other, original)))
    embed_cls = find(family.patch_embed) if family.patch_embed is not None and switches["patch_embed"] else None
    if embed_cls is not None:
        plan.append(_Replacement("patch_embed", embed_cls, "forward",
                                 vision.patch_embed_forward(family.patch_embed, _original(embed_cls, "forward"))))
    attention_cls = (find(family.vision_attention) if family.vision_attention is not None and switches["vision_attention"]
                     else None)
    if attention_cls is not None:
        plan.append(_Replacement("vision_attention", attention_cls, "forward", vision.vision_attention_forward(
            family.vision_attention, _original(attention_cls, "forward")), planned=True))
    loss_switch = next((name for name in ("linear_cross_entropy", "cross_entropy") if switches[name]), None)
    causal_lm = find(family.causal_lm, head_module)
    aux_loss = find(family.head.aux_loss) if family.head.aux_loss else None
    if loss_switch is not None and causal_lm is not None:
        original = _original(causal_lm, "forward")
        fused = loss_switch == "linear_cross_entropy"
        forward = functools.partial(head.causal_lm_forward, family.head, fused, original, aux_loss)
        plan.append(_Replacement(loss_switch, causal_lm, "forward", forward, planned=True))
        masking = sys.modules.get("transformers.masking_utils")
        if fused and masking is not None and hasattr(masking, "find_packed_sequence_indices"):
            finder = head.packed_sequence_finder(_original(masking, "find_packed_sequence_indices"))
            plan.append(_Replacement(loss_switch, masking, "find_packed_sequence_indices", finder, companion=True))
        if masking is not None and hasattr(masking, "_ignore_causal_mask_sdpa"):
            skip = head.captured_causal_mask_skip(_original(masking, "_ignore_causal_mask_sdpa"))
            plan.append(_Replacement(loss_switch, masking, "_ignore_causal_mask_sdpa", skip, companion=True))
    layer = find(family.layer.cls)
    if switches["add_rms_norm"] and family.layer.fuse is not None and layer is not None:
        # The layer runs its MLP in one op with the add + RMSNorm before it only where that MLP runs
        # tigon's own forward (not under tiled_mlp, which wraps it).
        joins_mlp = glu_ops and not switches["tiled_mlp"]
        fused = functools.partial(
            forwards.decoder_layer_forward, family.layer, family.norm, _original(layer, "forward"),
            mlp if joins_mlp else None, patched_mlp if joins_mlp else None, switches["recompute_mlp"],
        )
        plan.append(_Replacement("add_rms_norm", layer, "forward", fused, recompute if joins_mlp else (), planned=True))
    if family.attention is not None and (switches["qkv_group"] or lora_forward is not None):
        cls = find(family.attention.cls)
        if cls is not None:
            grouped = functools.partial(
                forwards.attention_forward, family.attention, _original(cls, "forward"), switches["qkv_group"],
                lora_forward,
            )
            plan.append(_Replacement("qkv_group" if switches["qkv_group"] else "lora", cls, "forward", grouped,
                                     planned=True))
    if switches["tiled_mlp"] and mlp_cls is not None:
        _wrap(plan, "tiled_mlp", mlp_cls, tiled.tiled_forward)
    if switches["moe_experts"] and family.experts is not None:
        find(family.experts)  # set on an instance (_use_tigon_experts); here only checked
    if switches["offload_activations"] and causal_lm is not None:
        _wrap(plan, "offload_activations", causal_lm, offload.offloaded_forward)
    for cls in lora_classes:
        plan.append(_Replacement("lora", cls, "forward", lora_forward, foreign=True))
    trl_utils = trl_head.loaded_module() if switches["trl_log_probs"] else None
    if trl_utils is not None:
        log_probs = trl_head.chunked_log_probs(_original(trl_utils, trl_head.NAME))
        plan.append(_Replacement("trl_log_probs", trl_utils, trl_head.NAME, log_probs, foreign=True))
    if missing:
        raise ValueError(
            f"tigon.patch: transformers has no {', '.join(missing)} "
            "(an unsupported transformers version?); nothing was patched"
        )
    return plan


def _lora_mlp(family: Family, switches: dict[str, bool]) -> bool:
    """Whether the family's MLP gets the fused LoRA path: a gated one of three projections without
    multipliers, not under tiled_mlp (a fused LoRA MLP would replace the tiled forward: the chunks run the LoRA
    linears' kernels instead)."""
    mlp = family.mlp
    return (
        mlp is not None and mlp.gated and not mlp.packed and mlp.multipliers is None and not switches["tiled_mlp"]
    )


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
    plan = [r for r in _plan(family, module, switches) if not r.foreign]
    record = _class_patches.get(model_type)
    if record is None or record.switches != switches:
        relay = Relay()
        shared = LayerPlan(relay)  # no decoder layer is linked to the norm after it: a class has no "after"
        record = _ClassPatch(switches, relay, [replacement.made(shared) for replacement in plan])
    unpatch(model_type)
    try:
        for replacement, new in zip(plan, record.made):
            record.held.append(_acquire(replacement.owner, replacement.name, new))
    except BaseException:
        _release_all(record.held)
        raise
    _class_patches[model_type] = record
    applied = (name for r in plan for name in (r.switch, *r.also))
    return Patched(f"{model_type} classes", model_type, tuple(dict.fromkeys(applied)))


def _patch_instance(
    model: torch.nn.Module, switches: dict[str, bool], fp8: str | None = None, fp8_all_gather: bool = False
) -> Patched:
    hf_model = _find_hf_model(model)
    model_type = hf_model.config.model_type
    text_config = hf_model.config.get_text_config()
    family, module = _family(model_type, text_config.model_type if text_config is not hf_model.config else None)
    lora_classes = peft_lora.lora_classes_in(model) if switches["lora"] else ()
    plan = _plan(family, module, switches, lora_classes)
    unpatch(model)
    undo = _Undo(Relay())
    applied: dict[str, None] = {}
    try:
        if getattr(hf_model, "use_kernels", False):
            # transformers' hub kernels (the `kernels` package, on by default in from_pretrained
            # since transformers 5.25) re-kernelize at each train()/eval() switch, which drops
            # every forward set on a module instance, tigon's among them: off while patched.
            hf_model.use_kernels = False
            undo.hub_kernels = weakref.ref(hf_model)
        shared = LayerPlan(undo.relay)
        layer_plans = {}
        if switches["add_rms_norm"] and family.layer.fuse is not None:
            layer_plans = {layer: LayerPlan(undo.relay, next_norm)
                           for layer, next_norm in _next_norms(model, family, module, switches["rms_norm"])}
            undo.layers = list(layer_plans.values())
        bound: set[str] = set()
        for replacement in plan:
            if not replacement.per_module:
                if replacement.companion and replacement.switch not in bound:
                    continue
                undo.shared.append(_acquire(replacement.owner, replacement.name, replacement.new))
                applied.update(dict.fromkeys((replacement.switch, *replacement.also)))
                continue
            for sub in model.modules():
                if replacement.binds_on(sub):
                    _rebind(undo, sub, forward_attr(sub), replacement.made(layer_plans.get(sub, shared)))
                    applied.update(dict.fromkeys((replacement.switch, *replacement.also)))
                    bound.add(replacement.switch)
        if switches["moe_experts"] and family.experts is not None:
            before = _use_tigon_experts(model, hf_model, getattr(module, family.experts))
            if before is not None:
                undo.experts = (weakref.ref(before[0]), before[1])
                applied["moe_experts"] = None
        if fp8 is not None:
            decoder = [sub for sub in model.modules() if isinstance(sub, getattr(module, family.layer.cls))]
            mlp_cls = getattr(module, family.mlp.cls, None) if family.mlp is not None else None
            undo.fp8 = float8.convert(model, decoder, family.layer.mixers, mlp_cls, fp8, fp8_all_gather)
    except BaseException:
        undo.run()
        raise
    _instance_patches[model] = undo
    # Given the key list alone: a callback holding the record would keep the model alive.
    weakref.finalize(model, _hold_until_next_call, undo.shared)
    summary = _lora_summary(model, family, module, switches, lora_classes) if lora_classes else None
    if summary is not None:
        log.info("%s", summary)
    layer_cls = getattr(module, family.layer.cls)
    layers = sum(isinstance(sub, layer_cls) for sub in model.modules())
    return Patched(type(hf_model).__name__, model_type, tuple(applied), layers, summary,
                   fp8=None if undo.fp8 is None else str(undo.fp8))


def _use_tigon_experts(model: torch.nn.Module, hf_model: Any, experts_cls: type) -> tuple[Any, str] | None:
    """Set `hf_model`'s experts implementation to tigon's (:func:`tigon.patch.moe.register_experts_implementation`)
    when `model` holds an experts module of `experts_cls` that tigon's op computes; returns
    ``(hf_model, the implementation before)`` for the undo, or None when nothing was set. (An
    experts module the op cannot compute runs transformers' loop under that implementation,
    saying why once.)"""
    from tigon.patch import moe

    if not any(isinstance(sub, experts_cls) and moe.unsupported_reason(sub) is None for sub in model.modules()):
        return None
    previous = hf_model.config._experts_implementation
    hf_model.set_experts_implementation(moe.register_experts_implementation())
    return hf_model, previous


def _lora_summary(
    model: torch.nn.Module, family: Family, module: types.ModuleType, switches: dict[str, bool],
    lora_classes: tuple[type, ...],
) -> peft_lora.LoraSummary:
    """What the LoRA layers of `model` run now, counting the gated MLPs and the q/k/v groups
    that would run as one LoRA op."""
    def candidates(spec: Any, activation_fused: bool) -> list[tuple[torch.nn.Module, ...]]:
        cls = getattr(module, spec.cls)
        found = []
        for sub in model.modules():
            if isinstance(sub, cls) and (not activation_fused or forwards.mlp_activation(spec, sub) is not None):
                linears = tuple(getattr(sub, name, None) for name in spec.projections)
                # (Gemma 3n's and 4's attentions that reuse another layer's keys and values have a q
                # alone; Gemma 4's whose values are its keys, no v.)
                if None not in linears:
                    found.append(linears)
        return found

    mlps = candidates(family.mlp, True) if _lora_mlp(family, switches) else []
    groups = candidates(family.attention, False) if family.attention is not None else []
    return peft_lora.summarize(model, lora_classes, mlps, groups)


def _next_norms(
    model: torch.nn.Module, family: Family, module: types.ModuleType, final_norm: bool
) -> list[tuple[torch.nn.Module, torch.nn.Module | None]]:
    """Each decoder layer of `model` with the norm its output goes through next (the following
    layer's input norm; after the last layer the model's final norm when the rms_norm switch
    patched it to take what the layer leaves, else None), for its closing residual add to fuse with."""
    layer_cls, norm_cls = getattr(module, family.layer.cls), getattr(module, family.norm.cls)
    input_norm = family.layer.norms[0]
    planned = []
    for sub in model.modules():
        layers = getattr(sub, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList) or not layers:
            continue
        if not all(isinstance(layer, layer_cls) and isinstance(getattr(layer, input_norm), norm_cls) for layer in layers):
            continue
        final = getattr(sub, "norm", None)
        nexts = [getattr(layer, input_norm) for layer in layers[1:]]
        nexts.append(final if final_norm and isinstance(final, norm_cls) else None)
        planned += zip(layers, nexts)
    return planned


def _rebind(undo: _Undo, module: torch.nn.Module, attr: str, function: Callable[..., Any]) -> None:
    """Bind `function` as `module`'s `attr`, recorded in `undo` for :func:`unpatch`."""
    undo.forwards.append((weakref.ref(module), attr, _previous(module, attr)))
    setattr(module, attr, types.MethodType(function, module))


def layer_plans(model: torch.nn.Module) -> list[LayerPlan]:
    """The plans of `model`'s decoder layers, in order, as :func:`patch` made them ([] for a model
    it did not patch, or whose layers it did not fuse across)."""
    undo = _instance_patches.get(model)
    return [] if undo is None else undo.layers


def _relay_of(model: torch.nn.Module) -> Relay | None:
    """The relay of the patch `model` runs: its own, or that of the patched model it wraps (the
    walk stops at the first Hugging Face model, which a patched model is or holds), or its
    family's class patch."""
    from transformers import PreTrainedModel

    for sub in model.modules():
        undo = _instance_patches.get(sub)
        if undo is not None and undo.relay is not None:
            return undo.relay
        if isinstance(sub, PreTrainedModel):
            record = _class_patches.get(sub.config.model_type)
            return record.relay if record is not None else None
    return None


@contextlib.contextmanager
def token_accuracy(model: torch.nn.Module, hits: list) -> Iterator[None]:
    """For the duration of the block, the patched causal-LM forward of `model` (or of the patched
    model inside it) appends to `hits`, for each loss it computes from labels, ``(hits, count)``:
    0-dim device tensors, the targets its loss did not ignore that the model's argmax predicts,
    and their number, taken from the loss kernel's pass (no logits, no host sync). A model whose
    loss is not tigon's appends nothing."""
    relay = _relay_of(model)
    if relay is None:
        yield
        return
    relay.accuracy = hits
    try:
        yield
    finally:
        relay.accuracy = None


HIDDEN = "tigon_last_hidden_state"  # the keyword that makes a model return its last hidden states
_NOT_FOR_THE_BACKBONE = ("labels", "return_dict", "output_attentions", "output_hidden_states", "use_cache")


def add_hidden_output(model: torch.nn.Module) -> None:
    """Make `model` (a causal LM, or a PEFT model around one) return its backbone's last hidden
    states, ``(batch, tokens, hidden)``, when called with ``HIDDEN=True``, and nothing else: no
    LM head, no logits. Otherwise its forward is what it was. The flag passes through the call of
    every wrapper (PEFT, DDP, accelerate's autocast), which the backbone called directly would skip.
    Undone by :func:`unpatch` of `model` (and so by patching it again)."""
    undo = _record(model)
    if undo.hidden_output:
        return
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    forward = causal.forward

    # The class's signature, which `generate` checks its keywords against.
    @functools.wraps(type(causal).forward)
    def hidden_or_forward(self, *args, **kwargs):
        if not kwargs.pop(HIDDEN, False):
            return forward(*args, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if v is not None and k not in _NOT_FOR_THE_BACKBONE}
        return head.run_decoder(self.base_model, *args, use_cache=False, **kwargs).last_hidden_state

    _rebind(undo, causal, "forward", hidden_or_forward)
    undo.hidden_output = True


def _record(model: torch.nn.Module) -> _Undo:
    """The record of what tigon changed on `model`, made (with no relay) if it has none."""
    undo = _instance_patches.get(model)
    if undo is None:
        undo = _instance_patches[model] = _Undo()
    return undo


@contextlib.contextmanager
def lent_methods(model: torch.nn.Module, **methods: Callable[..., Any]) -> Iterator[None]:
    """For the duration of the block, `model`'s methods named in `methods` are those given (plain
    functions, set on the instance: they take no `self`); then what `model` held before. Also
    undone by :func:`unpatch` of `model`, should it come first. A method set on the instance
    already is left as it is."""
    undo = _record(model)
    lent = {name: fn for name, fn in methods.items() if name not in vars(model)}
    start = len(undo.forwards)
    for name, fn in lent.items():
        undo.forwards.append((weakref.ref(model), name, _MISSING))
        setattr(model, name, fn)
    try:
        yield
    finally:
        for name in lent:
            vars(model).pop(name, None)
        del undo.forwards[start:start + len(lent)]


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
    trl_log_probs: bool = True,
    lora: bool = True,
    offload_activations: bool = False,
    tiled_mlp: bool = False,
    recompute_mlp: bool = False,
    moe_experts: bool = True,
    gelu_mlp: bool = True,
    patch_embed: bool = True,
    vision_attention: bool = True,
    role: str | None = None,
    fp8: str | None = None,
    fp8_all_gather: bool = False,
    **others: bool,
) -> Patched:
    """Make a Hugging Face decoder model run tigon's kernels; outputs, loss and gradients unchanged.

    Args:
        target: a ``config.model_type`` (``"llama"``, ``"qwen2"``, ...) to patch that family's
            transformers classes, for models built before or after the call; or a model instance
            (plain, on any device, or wrapped by PEFT) to patch only its modules, in place.
        rms_norm ... recompute_mlp: the switches of :data:`tigon.patch.switches.TABLE`, which says
            what each replaces and which ops it covers; a switch a family has no use for is
            ignored. `linear_cross_entropy` (loss straight from the hidden states, logits never
            materialised) and `cross_entropy` (loss from materialised logits) are exclusive.
            `layer_norm` and `lora` replace modules of torch's and PEFT's classes, so only a model
            instance gets them; so does `trl_log_probs` (TRL's fused LM head on
            :func:`tigon.functional.linear_log_probs`, :mod:`tigon.patch.trl_head`), and only when
            TRL is imported already. `offload_activations` (under gradient checkpointing, the
            checkpointed hidden states wait in pinned host memory: :mod:`tigon.patch.offload`) and
            `tiled_mlp` (the MLP over chunks of tokens: :mod:`tigon.patch.tiled`) are exact, off by
            default, and for long context. `recompute_mlp` (exact, off by default) has the gated
            MLPs that run as one op keep neither gate nor up for backward, which forms them again:
            about half of a decoder layer's activations for two more GEMMs per layer, for runs
            without gradient checkpointing whose memory is tight (``tigon rlhf``'s policy and
            reference in one step). `moe_experts` sets a patched model's experts
            implementation to tigon's fused experts op (:mod:`tigon.patch.moe`) for the model instance
            (its config's setting, restored by :func:`unpatch`). `gelu_mlp` runs a vision tower's
            GELU MLPs (``fc2(gelu(fc1(x)))``, ViT, SigLIP and CLIP blocks) as one op, and
            `patch_embed` a Qwen-VL or GLM-4V tower's patch embedding (a Conv3d whose stride is its
            kernel) as the one GEMM it is, and `vision_attention` their attention with the images'
            lengths read to the host once per tower forward instead of once per block
            (:mod:`tigon.patch.vision`).
        role: what the logged line calls the model besides its class, for a second model of one
            run (``"the frozen reference"``), whose line would otherwise read as the first's again.
        fp8: ``"tensorwise"`` or ``"rowwise"``: the decoder's trained projections (attention and
            dense MLP, not the LM head, LoRA adapters, frozen or quantised bases, experts) become
            torchao's Float8Linear of that recipe (:mod:`tigon.patch.fp8`): FP8 GEMMs, bf16
            weights. A model instance only, in bf16 on a GPU of compute capability >= 8.9, with
            torchao installed (``pip install 'tigon[fp8]'``); undone by :func:`unpatch`.
        fp8_all_gather: with ``fp8="tensorwise"``, for a model FSDP2 will shard: its weights are
            all-gathered in FP8 (torchao's ``enable_fsdp_float8_all_gather``).
        others: nothing; a name here is no switch, and raises.

    Returns:
        What was applied; the same line is logged at INFO level on the ``tigon`` logger (on a PEFT
        model after one more line, saying how many LoRA layers run fused and why the others do
        not). Patching a target again first undoes its previous patch.

    Raises:
        ValueError: an unsupported model type (the message lists the supported ones), a target
            that is neither, both loss switches, or a name that is no switch (an op name is told
            the switch covering it); an `fp8` that cannot run (no torchao, no FP8 on the model's
            device, not bf16, a string target); nothing is patched then.
    """
    check_switch_names(others, "tigon.patch")
    release_collected()
    if fp8 is not None:
        float8.check_recipe(fp8)
        if not isinstance(target, torch.nn.Module):
            raise ValueError(f"tigon.patch(fp8={fp8!r}) swaps a model instance's linears: pass the model, not {target!r}")
    switches = _switches(dict(
        rms_norm=rms_norm, rope=rope, swiglu=swiglu, geglu=geglu, layer_norm=layer_norm,
        add_rms_norm=add_rms_norm, qkv_group=qkv_group, linear_cross_entropy=linear_cross_entropy,
        cross_entropy=cross_entropy, trl_log_probs=trl_log_probs, lora=lora, offload_activations=offload_activations,
        tiled_mlp=tiled_mlp, recompute_mlp=recompute_mlp, moe_experts=moe_experts, gelu_mlp=gelu_mlp,
        patch_embed=patch_embed, vision_attention=vision_attention,
    ))
    if isinstance(target, str):
        result = _patch_classes(target, switches)
    elif isinstance(target, torch.nn.Module):
        result = _patch_instance(target, switches, fp8, fp8_all_gather)
    else:
        raise ValueError(
            f"target must be a model_type string or a torch.nn.Module, got {type(target).__name__}"
        )
    if role is not None:
        result = dataclasses.replace(result, role=role)
    log.info("%s", result)
    return result


def unpatch(target: str | torch.nn.Module | None = None) -> None:
    """Undo :func:`patch` for `target` (the same string or model), or for everything when None.

    Undoing something that was not patched does nothing. Module functions that patched models
    since collected shared (a family's RoPE, TRL's log-probs) are given back here, or by the next
    :func:`patch`, never by the garbage collector mid-step.
    """
    release_collected()
    if target is None:
        for model in list(_instance_patches):
            unpatch(model)
        for model_type in list(_class_patches):
            unpatch(model_type)
    elif isinstance(target, str):
        record = _class_patches.pop(target, None)
        if record is not None:
            _release_all(record.held)
    elif isinstance(target, torch.nn.Module):
        undo = _instance_patches.pop(target, None)
        if undo is not None:
            undo.run()
    else:
        raise ValueError(
            f"target must be a model_type string, a torch.nn.Module or None, got {type(target).__name__}"
        )
