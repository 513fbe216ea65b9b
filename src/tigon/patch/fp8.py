"""FP8 linears for training: the decoder's projections through torchao's float8 training.

``tigon.patch(model, fp8="tensorwise" | "rowwise")`` swaps each trained ``nn.Linear`` that a
decoder layer's attention or dense MLP calls (q/k/v/o, gate/up/down) for torchao's
``Float8Linear`` (``convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name``):
its three GEMMs run in FP8 with dynamic scales, one per tensor or one per row; the weights and
their gradients stay bf16, so the optimizer and the checkpoints see what they always did.

Left as they are: the LM head (tigon's fused linear + cross-entropy, in the weights' dtype), the
norms, rope and the gated activation (tigon's kernels run between the FP8 projections), LoRA
adapters and frozen bases (PEFT's and bitsandbytes' layers are no plain ``nn.Linear``, and a frozen
weight gets no weight gradient for FP8 to speed up), mixture-of-experts experts and routers.
A projection whose sides are not multiples of 16 (what FP8 GEMMs take) stays bf16, said once.

torchao is an optional extra (``pip install 'tigon[fp8]'``); FP8 GEMMs need a GPU of compute
capability 8.9 or more (Ada, Hopper, Blackwell): anywhere else the option is refused, never run
in bf16 under its name.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

log = logging.getLogger("tigon")

RECIPES = ("tensorwise", "rowwise")
INSTALL = "pip install 'tigon[fp8]'"
MIN_CAPABILITY = (8, 9)
# FP8 GEMMs (torch._scaled_mm) take only sides that are multiples of this; a weight gradient
# contracts over the tokens, which are padded to it.
ALIGN = 16


def unsupported(device: torch.device | None = None) -> str | None:
    """Why FP8 training cannot run on `device` (None: the current CUDA device, or the CPU where
    there is none), naming the device and its compute capability; None when it can."""
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if device is None or device.type != "cuda":
        where = "here is only the CPU (no CUDA GPU is visible)" if device is None else f"the model is on {device.type}"
        return f"FP8 matmuls need a CUDA GPU of compute capability >= 8.9 (Ada, Hopper or newer), and {where}"
    capability = torch.cuda.get_device_capability(device)
    if capability >= MIN_CAPABILITY:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (f"FP8 matmuls need compute capability >= 8.9 (Ada, Hopper or newer); cuda:{index} "
            f"({torch.cuda.get_device_name(index)}) has {capability[0]}.{capability[1]}")


def check_recipe(recipe: str) -> None:
    """A ValueError unless `recipe` is one of :data:`RECIPES`."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8 must be one of {', '.join(RECIPES)} (or None), got {recipe!r}")


def torchao_float8() -> types.ModuleType:
    """``torchao.float8``, or a ValueError saying how to install it."""
    try:
        import torchao.float8 as float8
    except ImportError:
        raise ValueError(f"FP8 training runs through torchao, which is not installed: {INSTALL}") from None
    return float8


def config(recipe: str, all_gather: bool = False) -> Any:
    """torchao's ``Float8LinearConfig`` of `recipe`; with `all_gather` (FSDP2), weights
    all-gathered in FP8, which torchao has for tensorwise scales only (ignored for rowwise)."""
    float8 = torchao_float8()
    made = float8.Float8LinearConfig.from_recipe_name(recipe)
    if all_gather and recipe == "tensorwise":
        made = dataclasses.replace(made, enable_fsdp_float8_all_gather=True)
    elif all_gather:
        log.info("tigon: fp8 %s: FSDP2 all-gathers the weights in bf16 (torchao's FP8 all-gather takes tensorwise "
                 "scales only)", recipe)
    return made


@dataclass
class Conversion:
    """What :func:`convert` swapped, for :func:`restore`: ``(parent, name, original linear)``,
    the parent held weakly (the record outlives nothing it patched)."""

    recipe: str
    swapped: list[tuple[weakref.ref, str, torch.nn.Linear]] = field(default_factory=list)
    left: list[str] = field(default_factory=list)  # the bf16 ones, by name and shape

    def __str__(self) -> str:
        left = f", {len(self.left)} left in bf16" if self.left else ""
        return f"fp8 {self.recipe} ({len(self.swapped)} linears{left})"


def candidates(
    model: torch.nn.Module, layers: list[torch.nn.Module], mixers: tuple[str, ...], mlp_cls: type | None
) -> Iterator[tuple[str, torch.nn.Module, str, torch.nn.Linear]]:
    """``(qualified name, parent, attribute, linear)`` of each trained plain ``nn.Linear`` that
    `layers` call as their token mixer's or dense MLP's projection (a module of `mlp_cls`, a
    mixture-of-experts' shared expert included, its routed experts not)."""
    names = {id(sub): name for name, sub in model.named_modules()}
    for layer in layers:
        owners = [getattr(layer, name) for name in mixers if isinstance(getattr(layer, name, None), torch.nn.Module)]
        if mlp_cls is not None:
            owners += [sub for path, sub in layer.named_modules()
                       if isinstance(sub, mlp_cls) and "experts" not in path.split(".")]
        for owner in owners:
            for attr, child in owner.named_children():
                if type(child) is torch.nn.Linear and child.weight.requires_grad:
                    yield f"{names[id(owner)]}.{attr}", owner, attr, child


def padded_rows(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, out_features: int) -> torch.Tensor:
    """``forward(x)`` of an FP8 linear, its tokens padded with zero rows to a multiple of
    :data:`ALIGN` (the weight gradient's GEMM contracts over them); zero rows add nothing to any
    gradient and leave every scale as it was. Aligned inputs are not copied."""
    rows = x.numel() // x.shape[-1]
    short = -rows % ALIGN
    if not short:
        return forward(x)
    padded = torch.nn.functional.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, short))
    return forward(padded)[:rows].reshape(*x.shape[:-1], out_features)


def _aligned_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A Float8Linear's forward through :func:`padded_rows`."""
    return padded_rows(functools.partial(type(self).forward, self), x, self.out_features)


@functools.cache
def _shape_forward(in_features: int, out_features: int) -> Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]:
    """:func:`_aligned_forward` as a function of its own for the projections of one weight shape.
    Dynamo keeps compiled graphs, and counts recompiles against its ``recompile_limit`` (8), per
    code object: shared by every projection, a model's weight shapes times the token counts, batch
    sizes and grad modes it runs went past the limit, and the projections after it ran uncompiled,
    torchao's casts as separate kernels."""
    name = f"_aligned_forward_{in_features}x{out_features}"
    code = _aligned_forward.__code__.replace(co_name=name)
    return types.FunctionType(code, _aligned_forward.__globals__, name)


def convert(
    model: torch.nn.Module, layers: list[torch.nn.Module], mixers: tuple[str, ...], mlp_cls: type | None,
    recipe: str, all_gather: bool = False, what: str = "tigon.patch(fp8=...)",
) -> Conversion:
    """Swap `model`'s projections (:func:`candidates`) for torchao's Float8Linear of `recipe`, in
    place. ValueError (nothing swapped) when torchao is missing, the weights are not bf16 or not on
    a GPU that has FP8, or no projection can run in FP8; `what` starts its line."""
    check_recipe(recipe)
    chosen, left = [], []
    for name, parent, attr, linear in candidates(model, layers, mixers, mlp_cls):
        if linear.in_features % ALIGN or linear.out_features % ALIGN:
            left.append(f"{name} ({linear.in_features} -> {linear.out_features})")
        else:
            chosen.append((parent, attr, linear))
    if not chosen:
        why = f"every one has a side that is not a multiple of {ALIGN}" if left else "it has none that trains"
        raise ValueError(f"{what}: no projection of the decoder can run in FP8: {why}")
    weight = chosen[0][2].weight
    reason = unsupported(weight.device)
    if reason is not None:
        raise ValueError(f"{what}: {reason}")
    if weight.dtype != torch.bfloat16:
        raise ValueError(f"{what}: FP8 training keeps bf16 weights, and the decoder's are "
                         f"{str(weight.dtype).replace('torch.', '')}: model.to(torch.bfloat16) first")
    try:
        float8 = torchao_float8()
    except ValueError as err:
        raise ValueError(f"{what}: {err}") from None
    wanted = {id(linear) for _, _, linear in chosen}
    float8.convert_to_float8_training(model, module_filter_fn=lambda module, fqn: id(module) in wanted,
                                      config=config(recipe, all_gather))
    done = Conversion(recipe, left=left)
    for parent, attr, linear in chosen:
        swapped = getattr(parent, attr)
        swapped.forward = types.MethodType(_shape_forward(swapped.in_features, swapped.out_features), swapped)
        # Eagerly, torchao's amax, scale and cast are separate kernels over every operand, which cost
        # more than the FP8 GEMMs save; compiled, each linear a region of its own (one graph per
        # projection shape), they fuse (BENCHMARKS.md has both). Off a GPU, FP8 only runs as the
        # tests' emulation: the region is traced there, and not made C++, which takes minutes.
        swapped.compile(backend="inductor" if weight.is_cuda else "aot_eager")
        done.swapped.append((weakref.ref(parent), attr, linear))
    if left:
        log.warning("tigon: fp8: %d projection(s) stay bf16, a side not a multiple of %d: %s", len(left), ALIGN,
                    ", ".join(left))
    return done


def restore(done: Conversion) -> None:
    """Put back the nn.Linear modules :func:`convert` swapped, holding the weights trained since."""
    for ref, attr, linear in reversed(done.swapped):
        parent = ref()
        if parent is None:
            continue
        swapped = getattr(parent, attr)
        for name in ("weight", "bias"):
            now = getattr(swapped, name)
            if now is not None and now is not getattr(linear, name):
                setattr(linear, name, torch.nn.Parameter(plain_tensor(now.detach()), requires_grad=now.requires_grad))
        setattr(parent, attr, linear)
    done.swapped.clear()


def plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, less torchao's FSDP2 float8 all-gather wrapper where it has one: the bf16 weight
    it wraps, detached (what a checkpoint holds)."""
    inner = getattr(tensor, "_tensor", None)
    if type(tensor).__name__ == "WeightWithDynamicFloat8CastTensor" and isinstance(inner, torch.Tensor):
        return inner.detach()
    return tensor


def plain_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` with every tensor :func:`plain_tensor` (the others as they are)."""
    return {k: plain_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}
