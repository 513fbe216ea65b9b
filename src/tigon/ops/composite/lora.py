"""LoRA linear layers with the low-rank term folded into the base GEMM, forward and backward.

    lora_linear(x, W, A, B, s, b) = x Wᵀ + b + s · (x Aᵀ) Bᵀ        W (out, in), A (r, in), B (out, r)

Written the obvious way (`F.linear(x, W, b) + s * F.linear(F.linear(x, A), B)`) this is a GEMM,
two skinny GEMMs and three full-size (N × out) passes to write, scale and add the low-rank term;
backward adds the scale's pass and a full-size sum of two input gradients. Here every full-size
tensor is written once:

* forward: ``xa = x Aᵀ`` (N × r); ``out = b + s · xa Bᵀ`` (a K = r GEMM that writes `out`); then
  the base GEMM accumulates into `out` (``beta = 1``: cuBLAS reads `out` in its epilogue, which is
  free in a compute-bound GEMM). Writing the small term first and the big one on top costs one
  full-size pass instead of the two an in-place add after the base GEMM would.
* backward: ``dxa = s · dy B``, ``dB = s · dyᵀ xa``, ``dA = dxaᵀ x``; ``dx = dxa A`` then
  ``dx += dy W`` in the second base GEMM; ``dW = dyᵀ x`` and ``db = Σ dy`` only when they need a
  gradient (a frozen base skips its weight-gradient GEMM).

Saved for backward: x and ``xa`` (N × r), nothing of size N × out. Given ``normed_input`` (x is an
RMSNorm's output, as a decoder layer's q/k/v and MLP inputs are), the norm's input is saved in
x's place, which the norm keeps for its own backward anyway, and x is renormalised in backward
(:class:`~tigon.ops.rms_norm.NormedInput`): one hidden-sized tensor less per op.

Adapters may be kept in another float dtype than x (PEFT keeps them in float32 on a half-precision
model): they are cast to x's dtype inside the op, the GEMMs run in x's dtype, and their gradients
come back in the adapters' dtype. Casting inside the autograd Function rather than before it spares
two autograd nodes per layer, forward and backward (~220 per step of a 16-layer model with LoRA
on every linear), whose host time showed in a LoRA training step.

The projections of one input (q/k/v, or an MLP's gate/up) go through the same code as a group:
one skinny GEMM forms every ``x Aᵢᵀ`` side by side, x is saved once, and the input gradient is one
tensor that each projection's base GEMM accumulates into, so autograd never sums per-projection
copies of dx (:func:`lora_linear_group`).

Everything is cuBLAS, on any device: the full-size work is two GEMMs that cuBLAS runs near the matmul
roofline, and the rest is skinny (K or N = r) GEMMs that move each tensor once. Inside torch.compile
the ops trace their references (inductor schedules the same GEMMs).

Quantised bases (QLoRA: a bitsandbytes NF4/FP4 or int8 weight as a :class:`QuantizedWeight`) are
read by the base GEMMs (forward, and dx in backward) in one of two ways
(:func:`tigon.ops.gemm_4bit.base_gemm`): a 4-bit base over few tokens by the fused 4-bit GEMM,
which dequantises tiles in registers and never writes the weight in 16 bits; otherwise (many
tokens, int8, DoRA) dequantised, bit for bit as bitsandbytes does, into a reused buffer right
before the GEMM (:func:`tigon.ops.dequantize.dequantized`). Either way no full-precision copy
outlives its GEMM, and nothing of size N × out is saved.

FP8 bases (an :class:`~tigon.ops.Fp8Weight`: e4m3 with fp32 scales) run their GEMMs in FP8 where
the GPU can (:mod:`tigon.ops.fp8`): x is quantised per row once for all the projections that read
it, and dx's base GEMMs take dy with the weight's row scales folded in. Elsewhere they are
dequantised for each GEMM like a QLoRA base.

DoRA (a projection with a `magnitude`) scales each output feature of ``z = x Wᵀ + s · (x Aᵀ) Bᵀ``
by ``m / ‖W + s B A‖`` and adds the bias (:mod:`tigon.ops.dora`; the norm detached, as PEFT does).
Saved for it: z (N × out) and the norm; backward forms ``dz = dy · m / ‖·‖`` and the magnitude's
gradient in one pass, then runs LoRA's backward on dz.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from tigon.ops._checks import check_device, check_float, check_input, check_vector, rows_view
from tigon.ops._dispatch import Op, autocast_dtype
from tigon.ops.dequantize import QuantizedWeight, check_quantized, dequantize_reference, dequantized
from tigon.ops.fp8 import (Fp8Weight, check_fp8_weight, dequantize_fp8, fp8_gemm_reason, fp8_matmul, fp8_matmul_grad,
                           quantize_rows, unit_stride_rows)
from tigon.ops.dora import DORA_NORM, DORA_SCALE, DORA_SCALE_BACKWARD, dora_norm_reference, dora_scale_reference
from tigon.ops.gemm_4bit import base_gemm
from tigon.ops.low_rank import add_low_rank_
from tigon.ops.rms_norm import NormedInput, check_normed_input, keep_normed, restore_normed


# Frozen base weights that are not tensors: kept on the autograd ctx, never saved for backward.
FROZEN_WEIGHTS = (QuantizedWeight, Fp8Weight)


class LoraProjection(NamedTuple):
    """One LoRA-adapted linear: ``x Wᵀ + bias + scaling · (x Aᵀ) Bᵀ``, or with a DoRA `magnitude`
    ``(x Wᵀ + scaling · (x Aᵀ) Bᵀ) · magnitude / ‖W + scaling · B A‖ + bias`` per output feature.

    Attributes:
        weight: ``(out, in)`` base weight, or a frozen :class:`~tigon.ops.QuantizedWeight` (QLoRA)
            or :class:`~tigon.ops.Fp8Weight` (an FP8 base).
        lora_a: ``(r, in)`` down-projection A.
        lora_b: ``(out, r)`` up-projection B.
        scaling: the LoRA scale (``alpha / r`` in PEFT).
        bias: ``(out,)`` base bias, or None.
        magnitude: ``(out,)`` DoRA magnitude vector (PEFT's ``lora_magnitude_vector``), or None
            for plain LoRA.
    """

    weight: torch.Tensor | QuantizedWeight | Fp8Weight
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float
    bias: torch.Tensor | None = None
    magnitude: torch.Tensor | None = None


def lora_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor | QuantizedWeight,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
    magnitude: torch.Tensor | None = None,
) -> torch.Tensor:
    """LoRA (or DoRA) linear written the obvious way in PyTorch (as PEFT computes it, in x's
    dtype; a quantised base dequantised first): the oracle and fallback."""
    if isinstance(weight, QuantizedWeight):
        weight = dequantize_reference(weight, x.dtype)
    elif isinstance(weight, Fp8Weight):
        weight = dequantize_fp8(weight, x.dtype)
    lora = torch.nn.functional.linear(torch.nn.functional.linear(x, lora_a.to(x.dtype)), lora_b.to(x.dtype))
    if magnitude is None:
        return torch.nn.functional.linear(x, weight, bias) + scaling * lora
    weight_norm = dora_norm_reference(weight.detach(), lora_a.detach(), lora_b.detach(), scaling)
    return dora_scale_reference(torch.nn.functional.linear(x, weight) + scaling * lora, magnitude, weight_norm, bias)


def lora_linear_group_reference(x: torch.Tensor, *flat: torch.Tensor | float | None) -> tuple[torch.Tensor, ...]:
    """:func:`lora_linear_reference` for each projection of a group (flattened as in :func:`flatten_projections`)."""
    return tuple(lora_linear_reference(x, *projection) for projection in unflatten_projections(flat))


def flatten_projections(projections: Sequence[LoraProjection]) -> tuple:
    """The projections' fields in one tuple (autograd Functions take flat arguments)."""
    return tuple(value for projection in projections for value in projection)


def unflatten_projections(flat: Sequence) -> list[LoraProjection]:
    width = len(LoraProjection._fields)
    return [LoraProjection(*flat[i : i + width]) for i in range(0, len(flat), width)]


_TENSOR_FIELDS = ("weight", "lora_a", "lora_b", "bias", "magnitude")


def saved_tensors(projections: Sequence[LoraProjection]) -> list:
    """The fields of each projection but the scaling (its weight may be a QuantizedWeight)."""
    return [getattr(p, name) for p in projections for name in _TENSOR_FIELDS]


def adapters_in(
    dtype: torch.dtype, projections: Sequence[LoraProjection]
) -> tuple[list[LoraProjection], list[tuple[torch.dtype, torch.dtype]]]:
    """The projections with their adapters cast to `dtype` (for a Function's forward, where the
    cast is no autograd node), and the adapters' own dtypes for :func:`adapter_grads_back`."""
    cast = [p._replace(lora_a=p.lora_a.to(dtype), lora_b=p.lora_b.to(dtype)) for p in projections]
    return cast, [(p.lora_a.dtype, p.lora_b.dtype) for p in projections]


def adapter_grads_back(flat_grads: list, dtypes: Sequence[tuple[torch.dtype, torch.dtype]]) -> list:
    """`flat_grads` (one projection's fields after another) with the A and B gradients in the
    adapters' own dtypes."""
    width = len(LoraProjection._fields)
    for i, (a_dtype, b_dtype) in enumerate(dtypes):
        for field, dtype in ((1, a_dtype), (2, b_dtype)):
            grad = flat_grads[i * width + field]
            if grad is not None:
                flat_grads[i * width + field] = grad.to(dtype)
    return flat_grads


def restore_projections(tensors: Sequence, scalings: Sequence[float]) -> list[LoraProjection]:
    """Inverse of :func:`saved_tensors`, given the scalings."""
    width = len(_TENSOR_FIELDS)
    return [LoraProjection(w, a, b, s, bias, m) for (w, a, b, bias, m), s in zip(zip(*[iter(tensors)] * width), scalings)]


def save_projections(ctx, leading: Sequence, projections: Sequence[LoraProjection], trailing: Sequence = ()) -> None:
    """``ctx.save_for_backward(*leading, <the projections' tensors>, *trailing)``, the scalings and
    quantised weights (frozen parameters, not activations) kept on ctx; :func:`load_projections`
    gives them back."""
    fields = saved_tensors(projections)
    ctx.quantized = {i: f for i, f in enumerate(fields) if isinstance(f, FROZEN_WEIGHTS)}
    ctx.save_for_backward(*leading, *(None if i in ctx.quantized else f for i, f in enumerate(fields)), *trailing)
    ctx.scalings = [p.scaling for p in projections]
    ctx.layout = (len(leading), len(fields))


def load_projections(ctx, saved: Sequence) -> tuple[Sequence, list[LoraProjection], Sequence]:
    """(leading, projections, trailing) as :func:`save_projections` saved them."""
    n_leading, n_fields = ctx.layout
    fields = [ctx.quantized.get(i, t) for i, t in enumerate(saved[n_leading:n_leading + n_fields])]
    return saved[:n_leading], restore_projections(fields, ctx.scalings), saved[n_leading + n_fields:]


def dora_saved(doras: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> list[torch.Tensor | None]:
    """The DoRA states of a group, (z, weight norm) or None per projection, as tensors to save."""
    return [t for state in doras for t in (state if state is not None else (None, None))]


def dora_restored(tensors: Sequence[torch.Tensor | None]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Inverse of :func:`dora_saved`."""
    return [None if z is None else (z, norm) for z, norm in zip(tensors[0::2], tensors[1::2])]


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, alpha: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``alpha · a @ b``, scaled in the GEMM's fp32 epilogue rather than by a pass over the result."""
    if out is None:
        out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    return out.addmm_(a, b, beta=0, alpha=alpha)


def base_weight(weight: torch.Tensor | QuantizedWeight | Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """A base weight as a tensor of `dtype` for a GEMM or DoRA's norm (a quantised one dequantised:
    see :func:`tigon.ops.dequantize.dequantized`)."""
    return dequantize_fp8(weight, dtype) if isinstance(weight, Fp8Weight) else dequantized(weight, dtype)


def fp8_rows(x2d: torch.Tensor, projections: Sequence[LoraProjection]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`x2d` quantised per row (:func:`tigon.ops.fp8.quantize_rows`) once for every FP8 GEMM of
    the group, or None when none of its projections runs one."""
    if any(isinstance(p.weight, Fp8Weight) and fp8_gemm_reason(x2d, p.weight) is None for p in projections):
        return quantize_rows(unit_stride_rows(x2d))
    return None


def lora_forward(
    x2d: torch.Tensor, xa: torch.Tensor, projection: LoraProjection, adapters: LoraProjection | None = None,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """One projection's output, written once: ``bias + s · xa Bᵀ``, then the base GEMM on top; and
    its DoRA state (z, weight norm), or None without a magnitude.

    `xa` is ``x Aᵀ`` for this projection (may be a column slice of a wider tensor); `x_fp8` is
    x quantised for an FP8 base's GEMM (:func:`fp8_rows`). A DoRA weight norm is taken from the
    base as the GEMM reads it and the adapters of `adapters` (the projection with its adapters in
    their own dtype; default `projection`).
    """
    weight, _, lora_b, scaling, bias, magnitude = projection
    if isinstance(weight, Fp8Weight):
        # The FP8 GEMM cannot accumulate: it writes z, and the rank-r product is added onto it.
        z = add_low_rank_(fp8_matmul(x2d, weight, x_fp8), xa, lora_b, scaling)
        if magnitude is None:
            return z if bias is None else z.add_(bias), None
    elif magnitude is None:
        out = _scaled_mm(xa, lora_b.t(), scaling) if bias is None else torch.addmm(bias, xa, lora_b.t(), alpha=scaling)
        return base_gemm(x2d, weight, add=out), None
    else:
        z = _scaled_mm(xa, lora_b.t(), scaling).addmm_(x2d, dequantized(weight, x2d.dtype).t())
    adapters = adapters or projection
    weight_norm = DORA_NORM(None, base_weight(weight, x2d.dtype), adapters.lora_a, adapters.lora_b, scaling)
    return DORA_SCALE(None, z, magnitude, weight_norm, bias), (z, weight_norm)


def lora_rank_slices(lora_as: Sequence[torch.Tensor]) -> list[slice]:
    """Each adapter's columns in the side-by-side ``x [A₁; A₂; …]ᵀ``."""
    bounds = [0]
    for a in lora_as:
        bounds.append(bounds[-1] + a.shape[0])
    return [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def stacked(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The adapters' A matrices stacked along the rank (no copy for a single one)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors))


def lora_group_forward(
    x2d: torch.Tensor, projections: Sequence[LoraProjection], adapters: Sequence[LoraProjection] | None = None,
    xa: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor, list]:
    """Every projection's output of the rows `x2d`, ``x [A₁; A₂; …]ᵀ`` (N × Σr) for backward, and
    each one's DoRA state (see :func:`lora_forward`). Given `xa` (that product, from an earlier
    pass over the same rows), it is not formed again: the outputs are then the earlier pass's, bit
    for bit."""
    lora_as = [p.lora_a for p in projections]
    if xa is None:
        xa = torch.mm(x2d, stacked(lora_as).t())
    adapters = adapters or projections
    x_fp8 = fp8_rows(x2d, projections)
    results = [lora_forward(x2d, xa[:, cols], p, own, x_fp8)
               for p, own, cols in zip(projections, adapters, lora_rank_slices(lora_as))]
    return [out for out, _ in results], xa, [state for _, state in results]


def lora_group_backward(
    x2d: torch.Tensor,
    xa: torch.Tensor,
    grads: Sequence[torch.Tensor | None],
    projections: Sequence[LoraProjection],
    needs_grad: Sequence[bool],
    doras: Sequence | None = None,
    grads_fp8: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """Gradients of a group of LoRA projections sharing the input rows `x2d`.

    `grads` are the 2-D output gradients (None for an output that got none); `needs_grad` is
    ``[x, then the LoraProjection fields of each projection]``; `doras` the projections' DoRA
    states from forward (None: no DoRA); `grads_fp8` as :func:`lora_backward_without_input` takes
    it. Returns dx and the per-projection gradients in the same flat order (None where not needed).
    """
    grad_x, grad_xa, flat_grads, grads = lora_backward_without_input(xa, grads, projections, needs_grad, doras,
                                                                      grads_fp8)
    lora_backward_from_input(x2d, grad_xa, grads, projections, needs_grad, flat_grads)
    return grad_x, flat_grads


def _split_needs(projections: Sequence[LoraProjection], needs_grad: Sequence[bool]) -> list[Sequence[bool]]:
    width = len(LoraProjection._fields)
    return [needs_grad[1 + i * width : 1 + (i + 1) * width] for i in range(len(projections))]


def lora_backward_without_input(
    xa: torch.Tensor,
    grads: Sequence[torch.Tensor | None],
    projections: Sequence[LoraProjection],
    needs_grad: Sequence[bool],
    doras: Sequence | None = None,
    grads_fp8: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, list[torch.Tensor | None], list[torch.Tensor | None]]:
    """The part of :func:`lora_group_backward` that does not read the group's input: dx,
    ``dxa = [s₁ dz₁ B₁, s₂ dz₂ B₂, …]`` (None when neither dx nor any dA needs it), the flat
    gradients with dB, dbias and DoRA's dmagnitude filled in (dW and dA are left to
    :func:`lora_backward_from_input`), and the gradients of the LoRA outputs z (dy itself without
    DoRA, ``dy · m / ‖·‖`` with it), which :func:`lora_backward_from_input` takes.

    A gated MLP needs dx of its down projection before it can recompute that projection's input.
    `grads_fp8` gives, per projection, its output gradient as the FP8 base's input-gradient GEMM
    takes it (:func:`tigon.ops.fp8.fp8_matmul_grad`'s `grad_fp8`), or None: quantised here.
    """
    width = len(LoraProjection._fields)
    needs = _split_needs(projections, needs_grad)
    need_x = needs_grad[0]
    need_dxa = need_x or any(n[1] for n in needs)
    lora_as = [p.lora_a for p in projections]
    slices = lora_rank_slices(lora_as)
    doras = doras or [None] * len(projections)

    grad_xa = torch.empty(xa.shape, dtype=xa.dtype, device=xa.device) if need_dxa else None
    flat_grads: list[torch.Tensor | None] = []
    grads_z: list[torch.Tensor | None] = []
    for projection, dy, cols, need, dora in zip(projections, grads, slices, needs, doras):
        flat_grads += [None] * width
        if dy is None:
            # No gradient reaches this output: none for its parameters either, as in eager.
            if grad_xa is not None:
                grad_xa[:, cols].zero_()
            grads_z.append(None)
            continue
        if dora is not None:
            z, weight_norm = dora
            magnitude, bias = projection.magnitude, projection.bias
            dz, grad_magnitude, grad_bias = DORA_SCALE_BACKWARD(
                None, dy, z, magnitude, weight_norm, bias is not None and need[4]
            )
            if need[5]:
                flat_grads[-width + 5] = grad_magnitude.to(magnitude.dtype)
            if grad_bias is not None:
                flat_grads[-width + 4] = grad_bias.to(bias.dtype)
        else:
            dz = dy
            if need[4]:
                flat_grads[-width + 4] = dy.sum(0)
        grads_z.append(dz)
        if grad_xa is not None:
            _scaled_mm(dz, projection.lora_b, projection.scaling, out=grad_xa[:, cols])
        if need[2]:
            flat_grads[-width + 2] = _scaled_mm(dz.t(), xa[:, cols], projection.scaling)

    grad_x = None
    if need_x:
        # dx = Σ dzᵢ Wᵢ + Σ dxaᵢ Aᵢ. An FP8 GEMM cannot accumulate into its output: the FP8 bases'
        # terms come first (the first one writes dx), then the rank-Σr product is added onto them
        # and each other base GEMM accumulates onto that.
        for projection, dz, dz_fp8 in zip(projections, grads_z, grads_fp8 or [None] * len(projections)):
            if dz is not None and isinstance(projection.weight, Fp8Weight):
                part = fp8_matmul_grad(dz, projection.weight, dz_fp8)
                grad_x = part if grad_x is None else grad_x.add_(part)
        lora_a = stacked(lora_as)
        grad_x = torch.mm(grad_xa, lora_a) if grad_x is None else add_low_rank_(grad_x, grad_xa, lora_a.t())
        for projection, dz in zip(projections, grads_z):
            if dz is not None and not isinstance(projection.weight, Fp8Weight):
                grad_x = base_gemm(dz, projection.weight, backward=True, add=grad_x)
    return grad_x, grad_xa, flat_grads, grads_z


def lora_backward_from_input(
    x2d: torch.Tensor,
    grad_xa: torch.Tensor | None,
    grads: Sequence[torch.Tensor | None],
    projections: Sequence[LoraProjection],
    needs_grad: Sequence[bool],
    flat_grads: list[torch.Tensor | None],
) -> None:
    """Fill dA (one GEMM for the whole group) and dW into `flat_grads`: the gradients that read the
    group's input rows `x2d`."""
    width = len(LoraProjection._fields)
    needs = _split_needs(projections, needs_grad)
    slices = lora_rank_slices([p.lora_a for p in projections])
    if any(need[1] and dy is not None for need, dy in zip(needs, grads)):
        grad_stacked_a = torch.mm(grad_xa.t(), x2d)
        for i, (cols, need, dy) in enumerate(zip(slices, needs, grads)):
            if need[1] and dy is not None:
                flat_grads[i * width + 1] = grad_stacked_a[cols]
    for i, (need, dy) in enumerate(zip(needs, grads)):
        if need[0] and dy is not None:
            flat_grads[i * width] = torch.mm(dy.t(), x2d)


class _LoraGroupFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normed, *flat):
        own = unflatten_projections(flat)
        projections, ctx.adapter_dtypes = adapters_in(x.dtype, own)
        x2d = rows_view(x)
        outs, xa, doras = lora_group_forward(x2d, projections, own)
        save_projections(ctx, (*keep_normed(ctx, x2d, normed), xa), projections, dora_saved(doras))
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not a zero tensor
        ctx.lead_shape = x.shape[:-1]
        return tuple(out.view(*x.shape[:-1], out.shape[-1]) for out in outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        (*rows, xa), projections, doras = load_projections(ctx, ctx.saved_tensors)
        x2d = rows_view(restore_normed(ctx, *rows))
        grads = [None if g is None else rows_view(g) for g in grad_outs]
        needs = (ctx.needs_input_grad[0], *ctx.needs_input_grad[2:])  # x's, then the projections' fields'
        grad_x, flat_grads = lora_group_backward(x2d, xa, grads, projections, needs, dora_restored(doras))
        if grad_x is not None:
            grad_x = grad_x.view(*ctx.lead_shape, x2d.shape[1])
        return (grad_x, None, *adapter_grads_back(flat_grads, ctx.adapter_dtypes))


def check_projection(
    name: str, projection: LoraProjection, x: torch.Tensor, autocast: bool, in_features: int | None = None
) -> None:
    """Raise ValueError unless `projection` takes inputs of width `in_features` (default x's last
    dim) on x's device, its weight and bias in x's dtype unless autocast will cast them (the
    adapters may have any float dtype: see the module docstring)."""
    if not isinstance(projection, LoraProjection):
        raise ValueError(
            f"{name} must be a LoraProjection (weight, lora_a, lora_b, scaling, bias, magnitude), got {projection!r}"
        )
    weight, lora_a, lora_b, scaling, bias, magnitude = projection
    in_features = x.shape[-1] if in_features is None else in_features
    quantized = isinstance(weight, FROZEN_WEIGHTS)
    if isinstance(weight, QuantizedWeight):
        check_quantized(f"{name} weight", weight, x.device)
    elif quantized:
        check_fp8_weight(f"{name} weight", weight, x.device)
    for arg, t in (((f"{name} weight", weight),) if not quantized else ()) + (
        (f"{name} lora_a", lora_a), (f"{name} lora_b", lora_b)
    ):
        check_float(arg, t)
        if t.dim() != 2:
            raise ValueError(f"{arg} must be a 2-D matrix, got shape {tuple(t.shape)}")
        check_device(arg, t, x.device)
    out_features, rank = weight.shape[0], lora_a.shape[0]
    if weight.shape[1] != in_features:
        raise ValueError(f"{name} weight must have shape (out, {in_features}) to match its input, got {tuple(weight.shape)}")
    if lora_a.shape[1] != in_features or rank == 0:
        raise ValueError(f"{name} lora_a must have shape (r, {in_features}) with r >= 1, got {tuple(lora_a.shape)}")
    if tuple(lora_b.shape) != (out_features, rank):
        raise ValueError(f"{name} lora_b must have shape ({out_features}, {rank}), got {tuple(lora_b.shape)}")
    # A comparison, not math.isfinite: under torch.compile(dynamic=True) the scaling is a SymFloat.
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not -math.inf < scaling < math.inf:
        raise ValueError(f"{name} scaling must be a finite number, got {scaling!r}")
    if bias is not None:
        check_float(f"{name} bias", bias)
        if tuple(bias.shape) != (out_features,):
            raise ValueError(f"{name} bias must have shape ({out_features},), got {tuple(bias.shape)}")
        check_device(f"{name} bias", bias, x.device)
    if magnitude is not None:
        check_vector(f"{name} magnitude", magnitude, out_features, x.device)
    if not autocast:
        for arg, t in ((f"{name} weight", None if quantized else weight), (f"{name} bias", bias)):
            if t is not None and t.dtype != x.dtype:
                raise ValueError(f"{arg} must have the dtype of x ({x.dtype}), got {t.dtype}")


def projections_for_autocast(
    x: torch.Tensor, projections: Sequence[LoraProjection], dtype: torch.dtype | None
) -> tuple[torch.Tensor, tuple]:
    """`x` and `projections` flattened for a LoRA op, with x, the weights and the biases in the
    autocast `dtype` (as autocast casts a linear's operands; a no-op for those already in it).
    The adapters stay in their own dtype: the op casts them to x's inside its Function, as it does
    without autocast, where casting them here would add two autograd cast nodes per projection to
    every forward and backward (224 per step for LoRA on every linear of a 16-layer Llama, a
    host-bound ~10 ms under the HF Trainer's bf16 autocast)."""
    if dtype is None:
        return x, flatten_projections(projections)
    cast = [p._replace(weight=p.weight if isinstance(p.weight, FROZEN_WEIGHTS) else p.weight.to(dtype),
                       bias=None if p.bias is None else p.bias.to(dtype))
            for p in projections]
    return x.to(dtype), flatten_projections(cast)


LORA_LINEAR = Op(
    "lora_linear", lambda x, *flat: _LoraGroupFunction.apply(x, None, *flat)[0], lora_linear_reference, uses_triton=False
)
LORA_LINEAR_GROUP = Op(
    "lora_linear_group", _LoraGroupFunction.apply, lambda x, normed, *flat: lora_linear_group_reference(x, *flat),
    uses_triton=False,
)


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor | QuantizedWeight | Fp8Weight,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
    magnitude: torch.Tensor | None = None,
) -> torch.Tensor:
    """A LoRA-adapted linear layer, ``x Wᵀ + bias + scaling · (x Aᵀ) Bᵀ``, with each full-size
    tensor written once in forward and backward (see the module docstring).

    Args:
        x: input ``(..., in)``, float16/bfloat16/float32 (float64 runs the reference).
        weight: ``(out, in)`` base weight; its gradient (a full GEMM) is computed only if it
            requires grad. Or a :class:`~tigon.ops.QuantizedWeight` (QLoRA: frozen, dequantised
            into a reused buffer for each GEMM), or a :class:`~tigon.ops.Fp8Weight` (an FP8 base:
            FP8 GEMMs where the GPU has them, see :mod:`tigon.ops.fp8`).
        lora_a: ``(r, in)`` adapter A (PEFT's ``lora_A.weight``).
        lora_b: ``(out, r)`` adapter B (PEFT's ``lora_B.weight``).
        scaling: the adapter's scale (``lora_alpha / r`` in PEFT).
        bias: optional ``(out,)`` base bias.
        magnitude: optional ``(out,)`` DoRA magnitude: the output is then
            ``(x Wᵀ + scaling · (x Aᵀ) Bᵀ) · magnitude / ‖W + scaling · B A‖ + bias``, the norm
            (per output feature) detached, as in PEFT.

    All tensors share x's device; weight and bias share x's dtype, the adapters may have another
    float dtype (they are cast to x's, and their gradients come back in their own). Under autocast
    everything is computed in the autocast dtype as ``F.linear`` would compute it.

    Returns:
        ``(..., out)`` in x's dtype (the autocast dtype under autocast).
    """
    check_input(x)
    dtype = autocast_dtype(x)
    projection = LoraProjection(weight, lora_a, lora_b, scaling, bias, magnitude)
    check_projection("lora", projection, x, autocast=dtype is not None)
    x, flat = projections_for_autocast(x, [projection], dtype)
    return LORA_LINEAR.without_autocast(dtype, None, x, *flat)


def lora_linear_group(
    x: torch.Tensor, projections: Sequence[LoraProjection], *, normed_input: NormedInput | None = None
) -> tuple[torch.Tensor, ...]:
    """Several LoRA linears of the same input (q/k/v, or gate/up), as one op.

    Equal to ``tuple(lora_linear(x, *p) for p in projections)``, but x is read once for all the
    ``x Aᵢᵀ``, saved once, and its gradient is one tensor that every projection's base GEMM
    accumulates into (no per-projection dx summed by autograd).

    Args:
        x: input ``(..., in)``.
        projections: one :class:`LoraProjection` per output; each may have its own rank, scaling
            and output width.
        normed_input: when `x` is an RMSNorm's output whose input is kept anyway (a decoder
            layer's input norm), what it was computed from: that input is saved instead of `x`,
            and `x` is renormalised in backward (one cheap kernel; the same values), so a
            hidden-sized tensor per call is not kept.

    Returns:
        One ``(..., out_i)`` tensor per projection.
    """
    check_input(x)
    if not projections:
        raise ValueError("projections must hold at least one LoraProjection, got none")
    dtype = autocast_dtype(x)
    for i, projection in enumerate(projections):
        check_projection(f"projections[{i}]", projection, x, autocast=dtype is not None)
    if normed_input is not None:
        check_normed_input(x, normed_input)
    x, flat = projections_for_autocast(x, projections, dtype)
    return LORA_LINEAR_GROUP.without_autocast(dtype, None, x, normed_input, *flat)
