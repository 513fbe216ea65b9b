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

Saved for backward: x and ``xa`` (N × r), nothing of size N × out.

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
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from tigon.ops._checks import check_device, check_float, check_input, rows_view
from tigon.ops._dispatch import Op, autocast_dtype


class LoraProjection(NamedTuple):
    """One LoRA-adapted linear: ``x Wᵀ + bias + scaling · (x Aᵀ) Bᵀ``.

    Attributes:
        weight: ``(out, in)`` base weight.
        lora_a: ``(r, in)`` down-projection A.
        lora_b: ``(out, r)`` up-projection B.
        scaling: the LoRA scale (``alpha / r`` in PEFT).
        bias: ``(out,)`` base bias, or None.
    """

    weight: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float
    bias: torch.Tensor | None = None


def lora_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """LoRA linear written the obvious way in PyTorch (as PEFT computes it, in x's dtype): the oracle
    and fallback."""
    lora = torch.nn.functional.linear(torch.nn.functional.linear(x, lora_a.to(x.dtype)), lora_b.to(x.dtype))
    return torch.nn.functional.linear(x, weight, bias) + scaling * lora


def lora_linear_group_reference(x: torch.Tensor, *flat: torch.Tensor | float | None) -> tuple[torch.Tensor, ...]:
    """:func:`lora_linear_reference` for each projection of a group (flattened as in :func:`flatten_projections`)."""
    return tuple(lora_linear_reference(x, *projection) for projection in unflatten_projections(flat))


def flatten_projections(projections: Sequence[LoraProjection]) -> tuple:
    """The projections' fields in one tuple (autograd Functions take flat arguments)."""
    return tuple(value for projection in projections for value in projection)


def unflatten_projections(flat: Sequence) -> list[LoraProjection]:
    width = len(LoraProjection._fields)
    return [LoraProjection(*flat[i : i + width]) for i in range(0, len(flat), width)]


def saved_tensors(projections: Sequence[LoraProjection]) -> list[torch.Tensor | None]:
    """What a Function saves of each projection: its tensors, not the scaling."""
    return [t for p in projections for t in (p.weight, p.lora_a, p.lora_b, p.bias)]


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


def restore_projections(tensors: Sequence[torch.Tensor | None], scalings: Sequence[float]) -> list[LoraProjection]:
    """Inverse of :func:`saved_tensors`, given the scalings."""
    return [LoraProjection(w, a, b, s, bias) for (w, a, b, bias), s in zip(zip(*[iter(tensors)] * 4), scalings)]


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, alpha: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``alpha · a @ b``, scaled in the GEMM's fp32 epilogue rather than by a pass over the result."""
    if out is None:
        out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    return out.addmm_(a, b, beta=0, alpha=alpha)


def lora_forward(x2d: torch.Tensor, xa: torch.Tensor, projection: LoraProjection) -> torch.Tensor:
    """One projection's output, written once: ``bias + s · xa Bᵀ``, then the base GEMM on top.

    `xa` is ``x Aᵀ`` for this projection (may be a column slice of a wider tensor).
    """
    weight, _, lora_b, scaling, bias = projection
    if bias is None:
        out = _scaled_mm(xa, lora_b.t(), scaling)
    else:
        out = torch.addmm(bias, xa, lora_b.t(), alpha=scaling)
    return out.addmm_(x2d, weight.t())


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
    x2d: torch.Tensor, projections: Sequence[LoraProjection]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every projection's output of the rows `x2d`, and ``x [A₁; A₂; …]ᵀ`` (N × Σr) for backward."""
    lora_as = [p.lora_a for p in projections]
    xa = torch.mm(x2d, stacked(lora_as).t())
    outs = [lora_forward(x2d, xa[:, cols], p) for p, cols in zip(projections, lora_rank_slices(lora_as))]
    return outs, xa


def lora_group_backward(
    x2d: torch.Tensor,
    xa: torch.Tensor,
    grads: Sequence[torch.Tensor | None],
    projections: Sequence[LoraProjection],
    needs_grad: Sequence[bool],
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """Gradients of a group of LoRA projections sharing the input rows `x2d`.

    `grads` are the 2-D output gradients (None for an output that got none); `needs_grad` is
    ``[x, then weight, lora_a, lora_b, scaling, bias of each projection]``. Returns dx and the
    per-projection gradients in the same flat order (None where not needed).
    """
    grad_x, grad_xa, flat_grads = lora_backward_without_input(xa, grads, projections, needs_grad)
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
) -> tuple[torch.Tensor | None, torch.Tensor | None, list[torch.Tensor | None]]:
    """The part of :func:`lora_group_backward` that does not read the group's input: dx,
    ``dxa = [s₁ dy₁ B₁, s₂ dy₂ B₂, …]`` (None when neither dx nor any dA needs it), and the flat
    gradients with dB and dbias filled in (dW and dA are left to :func:`lora_backward_from_input`).

    A gated MLP needs dx of its down projection before it can recompute that projection's input.
    """
    width = len(LoraProjection._fields)
    needs = _split_needs(projections, needs_grad)
    need_x = needs_grad[0]
    need_dxa = need_x or any(n[1] for n in needs)
    lora_as = [p.lora_a for p in projections]
    slices = lora_rank_slices(lora_as)

    grad_xa = torch.empty(xa.shape, dtype=xa.dtype, device=xa.device) if need_dxa else None
    flat_grads: list[torch.Tensor | None] = []
    for projection, dy, cols, need in zip(projections, grads, slices, needs):
        flat_grads += [None] * width
        if dy is None:
            # No gradient reaches this output: none for its parameters either, as in eager.
            if grad_xa is not None:
                grad_xa[:, cols].zero_()
            continue
        if grad_xa is not None:
            _scaled_mm(dy, projection.lora_b, projection.scaling, out=grad_xa[:, cols])
        if need[2]:
            flat_grads[-width + 2] = _scaled_mm(dy.t(), xa[:, cols], projection.scaling)
        if need[4]:
            flat_grads[-width + 4] = dy.sum(0)

    grad_x = None
    if need_x:
        # dx = Σ dxaᵢ Aᵢ + Σ dyᵢ Wᵢ: the K = Σr GEMM writes dx, each base GEMM accumulates into it.
        grad_x = torch.mm(grad_xa, stacked(lora_as))
        for projection, dy in zip(projections, grads):
            if dy is not None:
                grad_x.addmm_(dy, projection.weight)
    return grad_x, grad_xa, flat_grads


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
    def forward(ctx, x, *flat):
        projections, ctx.adapter_dtypes = adapters_in(x.dtype, unflatten_projections(flat))
        x2d = rows_view(x)
        outs, xa = lora_group_forward(x2d, projections)
        ctx.save_for_backward(x2d, xa, *saved_tensors(projections))
        ctx.scalings = [p.scaling for p in projections]
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not a zero tensor
        ctx.lead_shape = x.shape[:-1]
        return tuple(out.view(*x.shape[:-1], out.shape[-1]) for out in outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        x2d, xa, *tensors = ctx.saved_tensors
        projections = restore_projections(tensors, ctx.scalings)
        grads = [None if g is None else rows_view(g) for g in grad_outs]
        grad_x, flat_grads = lora_group_backward(x2d, xa, grads, projections, ctx.needs_input_grad)
        if grad_x is not None:
            grad_x = grad_x.view(*ctx.lead_shape, x2d.shape[1])
        return (grad_x, *adapter_grads_back(flat_grads, ctx.adapter_dtypes))


def check_projection(
    name: str, projection: LoraProjection, x: torch.Tensor, autocast: bool, in_features: int | None = None
) -> None:
    """Raise ValueError unless `projection` takes inputs of width `in_features` (default x's last
    dim) on x's device, its weight and bias in x's dtype unless autocast will cast them (the
    adapters may have any float dtype: see the module docstring)."""
    if not isinstance(projection, tuple) or len(projection) != len(LoraProjection._fields):
        raise ValueError(f"{name} must be a LoraProjection (weight, lora_a, lora_b, scaling, bias), got {projection!r}")
    weight, lora_a, lora_b, scaling, bias = projection
    in_features = x.shape[-1] if in_features is None else in_features
    for arg, t in ((f"{name} weight", weight), (f"{name} lora_a", lora_a), (f"{name} lora_b", lora_b)):
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
    if not autocast:
        for arg, t in ((f"{name} weight", weight), (f"{name} bias", bias)):
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
    cast = [p._replace(weight=p.weight.to(dtype), bias=None if p.bias is None else p.bias.to(dtype))
            for p in projections]
    return x.to(dtype), flatten_projections(cast)


LORA_LINEAR = Op(
    "lora_linear", lambda x, *flat: _LoraGroupFunction.apply(x, *flat)[0], lora_linear_reference, uses_triton=False
)
LORA_LINEAR_GROUP = Op("lora_linear_group", _LoraGroupFunction.apply, lora_linear_group_reference, uses_triton=False)


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """A LoRA-adapted linear layer, ``x Wᵀ + bias + scaling · (x Aᵀ) Bᵀ``, with each full-size
    tensor written once in forward and backward (see the module docstring).

    Args:
        x: input ``(..., in)``, float16/bfloat16/float32 (float64 runs the reference).
        weight: ``(out, in)`` base weight; its gradient (a full GEMM) is computed only if it
            requires grad.
        lora_a: ``(r, in)`` adapter A (PEFT's ``lora_A.weight``).
        lora_b: ``(out, r)`` adapter B (PEFT's ``lora_B.weight``).
        scaling: the adapter's scale (``lora_alpha / r`` in PEFT).
        bias: optional ``(out,)`` base bias.

    All tensors share x's device; weight and bias share x's dtype, the adapters may have another
    float dtype (they are cast to x's, and their gradients come back in their own). Under autocast
    everything is computed in the autocast dtype as ``F.linear`` would compute it.

    Returns:
        ``(..., out)`` in x's dtype (the autocast dtype under autocast).
    """
    check_input(x)
    dtype = autocast_dtype(x)
    projection = LoraProjection(weight, lora_a, lora_b, scaling, bias)
    check_projection("lora", projection, x, autocast=dtype is not None)
    x, flat = projections_for_autocast(x, [projection], dtype)
    return LORA_LINEAR.without_autocast(dtype, None, x, *flat)


def lora_linear_group(x: torch.Tensor, projections: Sequence[LoraProjection]) -> tuple[torch.Tensor, ...]:
    """Several LoRA linears of the same input (q/k/v, or gate/up), as one op.

    Equal to ``tuple(lora_linear(x, *p) for p in projections)``, but x is read once for all the
    ``x Aᵢᵀ``, saved once, and its gradient is one tensor that every projection's base GEMM
    accumulates into (no per-projection dx summed by autograd).

    Args:
        x: input ``(..., in)``.
        projections: one :class:`LoraProjection` per output; each may have its own rank, scaling
            and output width.

    Returns:
        One ``(..., out_i)`` tensor per projection.
    """
    check_input(x)
    if not projections:
        raise ValueError("projections must hold at least one LoraProjection, got none")
    dtype = autocast_dtype(x)
    for i, projection in enumerate(projections):
        check_projection(f"projections[{i}]", projection, x, autocast=dtype is not None)
    x, flat = projections_for_autocast(x, projections, dtype)
    return LORA_LINEAR_GROUP.without_autocast(dtype, None, x, *flat)
