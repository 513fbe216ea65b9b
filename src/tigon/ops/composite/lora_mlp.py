"""A gated MLP whose three projections all carry LoRA adapters, as one autograd Function.

    lora_gated_mlp(x) = down(act(gate(x)) * up(x)),    each proj(z) = z Wᵀ + b + s · (z Aᵀ) Bᵀ

with act SiLU (SwiGLU: Llama, Mistral, Qwen) or GELU (GeGLU: Gemma). Eager PEFT runs this as three
LoRA linears (each with its full-size low-rank term, scale and add, forward and backward) around an
activation that saves ``act(gate)``, ``up`` and the product for backward. Here:

* gate and up are one LoRA group (:func:`tigon.ops.composite.lora.lora_linear_group`'s code): x is read once
  for both adapters, each output is written once, and dx is one tensor both base GEMMs accumulate
  into;
* the activation is the gated-activation kernel of :mod:`tigon.ops.glu`;
* saved per layer: x, gate, up and the rank-sized ``x Aᵀ`` / ``h A_downᵀ``. The down projection's
  input ``h = act(gate) * up`` is recomputed in backward by the same pass that forms the
  gradients of gate and up. Given ``normed_input`` (x is the layer's post-attention RMSNorm of a
  sum the norm keeps anyway), the sum is saved in x's place and x renormalised in backward, as
  :func:`tigon.ops.composite.lora.lora_linear_group` does;
* with ``recompute=True``, gate and up are not kept either: backward forms them again from x and
  the kept ``x Aᵀ`` (the same GEMMs on the same operands, so the same values), which costs the gate
  and up base GEMMs once more and saves two intermediate-sized tensors per layer, about half of
  what a decoder layer keeps for backward;
* with ``output_discarded=True`` (gradient checkpointing's replay of a layer in backward, which
  runs the forward again only for what it saves), the down projection's two output GEMMs are
  skipped: its input and ``h A_downᵀ`` are all backward needs of it. The output is then NaN, so
  that a caller that did read it would see at once that it should not have.

Quantised bases and DoRA projections work as in :mod:`tigon.ops.composite.lora`. On FP8 bases the
activation kernel quantises what the next FP8 GEMMs take in the pass that makes it: h for the down
projection in forward, and in backward the gate and up output gradients (their weights' row scales
folded in) for the input gradient's GEMMs. A DoRA gate or up projection saves its unscaled output
z in place of its output (which backward rescales again, a cheap pass, for the activation's
gradient), so DoRA adds nothing of the intermediate size to what the op keeps; a DoRA down
projection saves its z (N × hidden).
"""

from __future__ import annotations

import torch

from tigon.ops._checks import check_choice, check_input, rows_view
from tigon.ops._dispatch import Op, autocast_dtype, backward_fallback
from tigon.ops.composite.lora import (
    LoraProjection,
    adapter_grads_back,
    adapters_in,
    check_projection,
    dora_restored,
    dora_saved,
    flatten_projections,
    load_projections,
    lora_backward_from_input,
    lora_backward_without_input,
    lora_forward,
    lora_group_backward,
    lora_group_forward,
    lora_linear_reference,
    projections_for_autocast,
    save_projections,
    unflatten_projections,
)
from tigon.ops._fp8 import fp8_rows_buffers
from tigon.ops.dora import DORA_SCALE
from tigon.ops.fp8 import Fp8Weight, fp8_gemm_reason, rows_operand
from tigon.ops.glu import ACTIVATIONS, glu_backward, glu_forward, glu_op, glu_reference
from tigon.ops.rms_norm import NormedInput, check_normed_input, keep_normed, restore_normed


def lora_gated_mlp_reference(x: torch.Tensor, activation: str, *flat) -> torch.Tensor:
    """The LoRA gated MLP as PEFT computes it around a Hugging Face LlamaMLP / GemmaMLP; `flat` is
    the gate, up and down projections' fields in :class:`LoraProjection` order."""
    gate, up, down = unflatten_projections(flat)
    h = glu_reference(lora_linear_reference(x, *gate), lora_linear_reference(x, *up), activation)
    return lora_linear_reference(h, *down)


def _reference(x: torch.Tensor, activation: str, recompute: bool, normed: NormedInput | None, discarded: bool,
               *flat) -> torch.Tensor:
    """The reference in the op's argument order (what the fused op keeps changes no value; a
    discarded output is computed all the same)."""
    return lora_gated_mlp_reference(x, activation, *flat)


def _reference_point(ctx, saved):
    (*rows, _, _, _, _), projections, _ = load_projections(ctx, saved)
    x2d = rows_view(restore_normed(ctx, *rows))
    x = x2d.view(*ctx.lead_shape, x2d.shape[1])
    return LORA_GATED_MLP, _reference, (x, ctx.activation, ctx.recompute, None, False,
                                        *flatten_projections(projections))


def _kept(output: torch.Tensor, dora: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """What the op keeps of a gate or up output: its unscaled z under DoRA (the state holds it)."""
    return output if dora is None else dora[0]


def _output(kept: torch.Tensor, projection: LoraProjection, dora: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """A gate or up output again from what :func:`_kept` kept."""
    if dora is None:
        return kept
    return DORA_SCALE(None, kept, projection.magnitude, dora[1], projection.bias)


def _fp8_output_grad_buffers(gate: torch.Tensor, gate_proj: LoraProjection, up_proj: LoraProjection) -> tuple | None:
    """Buffers for the FP8 rows of the gate and up output gradients (shaped like `gate`) when both
    bases run FP8 GEMMs for the input gradient, else None."""
    if not all(isinstance(p.weight, Fp8Weight) and fp8_gemm_reason(gate, p.weight) is None for p in (gate_proj, up_proj)):
        return None
    return fp8_rows_buffers(gate, "rowwise"), fp8_rows_buffers(gate, "rowwise")


class _LoraGatedMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, activation, recompute, normed, discarded, *flat):
        own = unflatten_projections(flat)
        (gate_proj, up_proj, down_proj), ctx.adapter_dtypes = adapters_in(x.dtype, own)
        x2d = rows_view(x)
        (gate, up), xa, gate_up_doras = lora_group_forward(x2d, [gate_proj, up_proj], own[:2])
        down_runs = not discarded or down_proj.magnitude is not None  # (a DoRA down projection saves its z)
        # An FP8 down projection's GEMM takes h quantised per row: the activation kernel writes it.
        h_rows = (fp8_rows_buffers(gate, "rowwise") if down_runs and isinstance(down_proj.weight, Fp8Weight)
                  and fp8_gemm_reason(gate, down_proj.weight) is None else None)
        h = glu_forward(gate, up, activation, fp8=None if h_rows is None else "rowwise", fp8_rows=h_rows)
        ha = torch.mm(h, down_proj.lora_a.t())
        if down_runs:
            out, down_dora = lora_forward(h, ha, down_proj, own[2], None if h_rows is None else rows_operand(h_rows))
        else:
            out, down_dora = h.new_full((h.shape[0], down_proj.weight.shape[0]), float("nan")), None
        del h, h_rows  # h is recomputed in backward
        # A DoRA gate or up keeps its z: its weight norm comes from the adapters in their own
        # dtype, which backward no longer has.
        ctx.recompute = recompute and gate_up_doras == [None, None]
        kept = [None, None] if ctx.recompute else [_kept(t, dora) for t, dora in zip((gate, up), gate_up_doras)]
        doras = dora_saved([*gate_up_doras, down_dora])
        save_projections(ctx, (*keep_normed(ctx, x2d, normed), *kept, xa, ha), [gate_proj, up_proj, down_proj], doras)
        ctx.activation = activation
        ctx.lead_shape = x.shape[:-1]
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_out):
        (*rows, gate, up, xa, ha), (gate_proj, up_proj, down_proj), dora_tensors = load_projections(ctx, saved)
        x2d = rows_view(restore_normed(ctx, *rows))
        gate_dora, up_dora, down_dora = dora_restored(dora_tensors)
        if ctx.recompute:
            (gate, up), _, _ = lora_group_forward(x2d, [gate_proj, up_proj], xa=xa)
        gate, up = _output(gate, gate_proj, gate_dora), _output(up, up_proj, up_dora)
        width = len(LoraProjection._fields)
        needs = (ctx.needs_input_grad[0], *ctx.needs_input_grad[5:])  # x's, then the projections' fields'
        gate_up_needs = needs[: 1 + 2 * width]
        down_needs = (True, *needs[1 + 2 * width :])
        dy = rows_view(grad_out)

        # dh = s dy B A + dy W of the down projection; it, gate and up are ours alone, so the
        # activation's backward writes its results over them.
        grad_h, grad_ha, down_grads, down_grads_z = lora_backward_without_input(
            ha, [dy], [down_proj], down_needs, [down_dora]
        )
        needs_h = down_needs[1] or down_needs[2]  # the down projection's dW or dA reads h
        # Under DoRA gate and up are fresh rescalings, ours to overwrite like the kept ones.
        # FP8 gate and up bases take their output gradients quantised, with their row scales folded
        # in, for dx's GEMMs: the activation's backward writes them in its pass.
        fp8_grads = (_fp8_output_grad_buffers(gate, gate_proj, up_proj)
                     if gate_up_needs[0] and gate_dora is None and up_dora is None else None)
        grad_gate, grad_up, h = glu_backward(
            grad_h, gate, up, ctx.activation, store_product=needs_h, in_place=True,
            fp8=None if fp8_grads is None else "rowwise", fp8_grads=fp8_grads,
            fp8_column_scales=None if fp8_grads is None else (gate_proj.weight.scale.view(-1),
                                                              up_proj.weight.scale.view(-1)),
        )
        if needs_h:
            lora_backward_from_input(h, grad_ha, down_grads_z, [down_proj], down_needs, down_grads)
        del h, grad_h

        grad_x, gate_up_grads = lora_group_backward(
            x2d, xa, [grad_gate, grad_up], [gate_proj, up_proj], gate_up_needs, [gate_dora, up_dora],
            None if fp8_grads is None else [rows_operand(rows) for rows in fp8_grads],
        )
        if grad_x is not None:
            grad_x = grad_x.view(*ctx.lead_shape, x2d.shape[1])
        return (grad_x, None, None, None, None, *adapter_grads_back(gate_up_grads + down_grads, ctx.adapter_dtypes))


def _lora_gated_mlp_compiled(x, activation, recompute, normed, discarded, *flat):
    # Inside torch.compile: the LoRA projections trace their references around the GLU kernel
    # (what is saved for backward is the compiler's choice).
    gate, up, down = unflatten_projections(flat)
    return lora_linear_reference(glu_op(lora_linear_reference(x, *gate), lora_linear_reference(x, *up), activation), *down)


LORA_GATED_MLP = Op(
    "lora_gated_mlp", _LoraGatedMLPFunction.apply, _reference, compiled=_lora_gated_mlp_compiled
)


def lora_gated_mlp(
    x: torch.Tensor,
    gate: LoraProjection,
    up: LoraProjection,
    down: LoraProjection,
    *,
    activation: str = "silu",
    recompute: bool = False,
    normed_input: NormedInput | None = None,
    output_discarded: bool = False,
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` with a LoRA adapter on each projection, as one op that saves
    only x, the gate and up outputs and rank-sized products (see the module docstring).

    Args:
        x: ``(..., hidden)`` input, float16/bfloat16/float32 (float64 runs the reference).
        gate, up: :class:`~tigon.ops.LoraProjection` of shape ``(intermediate, hidden)``.
        down: :class:`~tigon.ops.LoraProjection` of shape ``(hidden, intermediate)``.
        activation: ``"silu"`` (SwiGLU), ``"gelu_tanh"`` (GeGLU with gelu_pytorch_tanh) or
            ``"gelu"`` (exact erf GeGLU).
        recompute: keep neither gate nor up for backward, which forms them again (two more base
            GEMMs; the same values): two intermediate-sized tensors less per call. A DoRA gate
            or up projection keeps them regardless. Inside torch.compile the compiler decides.
        normed_input: when `x` is an RMSNorm's output whose input is kept anyway (a decoder
            layer's post-attention norm), what it was computed from: that input is saved instead
            of `x`, and `x` is renormalised in backward (the same values), one hidden-sized
            tensor less per call.
        output_discarded: the caller never reads the output, only the gradients backward will
            give (gradient checkpointing's replay of a layer in backward): the down projection's
            output GEMMs are skipped and the output is NaN. (The reference path, and a DoRA down
            projection, compute it all the same.)

    Each projection may have its own rank and scaling, and a bias. All tensors share x's device;
    weights and biases share x's dtype, the adapters may have another float dtype (cast inside the
    op, gradients back in their own dtype). Under autocast everything is computed in the autocast
    dtype as ``F.linear`` would compute it. Base weights get a gradient only if they require one.

    Returns:
        ``(..., hidden)`` in x's dtype (the autocast dtype under autocast).
    """
    check_choice("activation", activation, ACTIVATIONS)
    check_input(x)
    dtype = autocast_dtype(x)
    autocast = dtype is not None
    check_projection("gate", gate, x, autocast)
    check_projection("up", up, x, autocast)
    intermediate = gate.weight.shape[0]
    if up.weight.shape[0] != intermediate:
        raise ValueError(f"up weight must have shape ({intermediate}, {x.shape[-1]}) like gate's, got {tuple(up.weight.shape)}")
    check_projection("down", down, x, autocast, in_features=intermediate)
    if down.weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"down weight must have shape ({x.shape[-1]}, {intermediate}) to return x's width, "
            f"got {tuple(down.weight.shape)}"
        )
    if normed_input is not None:
        check_normed_input(x, normed_input)
    x, flat = projections_for_autocast(x, [gate, up, down], dtype)
    return LORA_GATED_MLP.without_autocast(dtype, None, x, activation, bool(recompute), normed_input,
                                           bool(output_discarded), *flat)
