"""The gated MLP of Llama / Gemma around the gated-activation kernels (cuBLAS choreography).

    glu_mlp(x, ...) = down_proj(act(gate_proj(x)) * up_proj(x))

The three projections are torch matmuls around the kernels of :mod:`tigon.ops.glu`. The op saves
the MLP input, `gate` and `up` only: the down projection's input ``act(gate) * up`` is recomputed
in backward, by the same pass that computes the gradients of `gate` and `up`. With ``recompute``
it saves the input alone, and backward forms `gate` and `up` again (:func:`gate_and_up`).
With ``output_discarded`` (gradient checkpointing's replay of a layer in backward, which runs the
forward again for what it saves) it forms only what it saves: no activation, no down projection,
and its output is NaN.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
import torch.nn.functional as torch_f

from tigon.ops._checks import KERNEL_DTYPES, check_choice, check_device, check_float
from tigon.ops._dispatch import Op, autocast_dtype, backward_fallback, empty_if, library_op
from tigon.ops.glu import ACTIVATIONS, glu_backward, glu_forward, glu_reference
from tigon.ops.rms_norm import NormedInput, check_normed_input, keep_normed, restore_normed


def glu_mlp_reference(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """The gated MLP as Hugging Face's LlamaMLP / GemmaMLP compute it."""
    gate = torch_f.linear(x, gate_weight, gate_bias)
    up = torch_f.linear(x, up_weight, up_bias)
    return torch_f.linear(glu_reference(gate, up, activation), down_weight, down_bias)


def glu_mlp_forward(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation):
    """The gated MLP outside autograd: ``(out, gate, up)``; gate and up are what
    :func:`glu_mlp_backward` takes."""
    gate, up = gate_and_up(x, gate_weight, up_weight, gate_bias, up_bias)
    return torch_f.linear(glu_forward(gate, up, activation), down_weight, down_bias), gate, up


def kept_forward(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, recompute,
                 discarded):
    """:func:`glu_mlp_forward` for the Functions: ``(out, gate, up)`` with gate and up None under
    `recompute`. With `discarded` only what is kept is formed, and the output is NaN (in the dtype
    the projections would give it), so that a caller that did read it would know at once."""
    if not discarded:
        out, gate, up = glu_mlp_forward(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias,
                                        activation)
        return (out, None, None) if recompute else (out, gate, up)
    out = x.new_full((*x.shape[:-1], down_weight.shape[0]), float("nan"), dtype=autocast_dtype(x) or x.dtype)
    return (out, None, None) if recompute else (out, *gate_and_up(x, gate_weight, up_weight, gate_bias, up_bias))


def gate_and_up(x, gate_weight, up_weight, gate_bias, up_bias) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up projections of the MLP's input `x` (any leading shape). A backward that did
    not keep them forms them again here: the forward's GEMMs on the same operands (under the
    forward's autocast state, which the Functions' custom_bwd restores), so the forward's values."""
    return torch_f.linear(x, gate_weight, gate_bias), torch_f.linear(x, up_weight, up_bias)


def glu_mlp_backward(
    grad_out: torch.Tensor,
    input_rows: Callable[[], torch.Tensor],
    gate: torch.Tensor,
    up: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    activation: str,
    needs: Sequence[bool],
    in_place: bool = True,
) -> list[torch.Tensor | None]:
    """Gradients of the gated MLP for `needs` = (x, gate_weight, up_weight, down_weight,
    gate_bias, up_bias, down_bias), in that order (None where not needed; dx as 2-D rows).

    `gate` and `up` are the forward's; with `in_place` (they are the op's own intermediates, which
    no caller sees) they are overwritten. `input_rows()` gives the MLP's input as 2-D rows, asked
    for only if a weight gradient needs it.
    """
    grad_out2d = grad_out.reshape(-1, grad_out.shape[-1])
    grad_h = torch.matmul(grad_out2d, down_weight)
    # grad_h, gate and up are ours alone: the gradients and the recomputed down_proj input
    # (needed only for the down weight's gradient) overwrite them.
    grad_gate, grad_up, product = glu_backward(
        grad_h, gate.reshape(grad_h.shape), up.reshape(grad_h.shape), activation,
        store_product=needs[3], in_place=in_place,
    )
    grads: list[torch.Tensor | None] = [None] * 7
    if needs[3]:
        grads[3] = grad_out2d.t().matmul(product)
    del product
    if needs[6]:
        grads[6] = grad_out2d.sum(0)
    if needs[0]:
        # In place on the first product: an out-of-place addmm would copy it (tokens x hidden per
        # layer) first. Autocast does not cast an in-place op's operands, so the weight is cast
        # to the product's dtype here (a no-op without autocast).
        grads[0] = grad_gate.matmul(gate_weight)
        grads[0].addmm_(grad_up, up_weight.to(grads[0].dtype))
    if needs[1] or needs[2]:
        x2d = input_rows()
        grads[1] = grad_gate.t().matmul(x2d) if needs[1] else None
        grads[2] = grad_up.t().matmul(x2d) if needs[2] else None
    if needs[4]:
        grads[4] = grad_gate.sum(0)
    if needs[5]:
        grads[5] = grad_up.sum(0)
    return grads


def _reference_point(ctx, saved):
    gate_weight, up_weight, down_weight, *biases = saved[2:8]
    inputs = (restore_normed(ctx, *saved[8:]), gate_weight, up_weight, down_weight, *biases, ctx.activation, None, None,
              None)
    return GLU_MLP, lambda *args: glu_mlp_reference(*args[:8]), inputs


class _GLUMLPFunction(torch.autograd.Function):
    # custom_fwd/custom_bwd: under autocast the backward's matmuls run in the forward's precision.
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation,
                normed, recompute, discarded):
        out, gate, up = kept_forward(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation,
                                     recompute, discarded)
        ctx.save_for_backward(gate, up, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias,
                              *keep_normed(ctx, x, normed))
        ctx.activation = activation
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_out):
        gate, up, gate_weight, up_weight, down_weight, gate_bias, up_bias = saved[:7]

        @functools.cache  # formed at most once
        def input_rows() -> torch.Tensor:
            x = restore_normed(ctx, *saved[8:])
            return x.reshape(-1, x.shape[-1])

        if gate is None:  # recompute
            gate, up = gate_and_up(input_rows(), gate_weight, up_weight, gate_bias, up_bias)
        grads = glu_mlp_backward(
            grad_out, input_rows, gate, up, gate_weight, up_weight, down_weight, ctx.activation,
            ctx.needs_input_grad[:7],
        )
        if grads[0] is not None:
            grads[0] = grads[0].view(*grad_out.shape[:-1], grads[0].shape[-1])
        return (*grads, None, None, None, None)


def check_glu_mlp(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation) -> str | None:
    """Validate glu_mlp's arguments; return why the kernel path cannot take them, if it cannot."""
    check_choice("activation", activation, ACTIVATIONS)
    check_float("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the hidden one), got a scalar")
    hidden = x.shape[-1]
    check_float("gate_weight", gate_weight)
    if gate_weight.dim() != 2 or gate_weight.shape[1] != hidden:
        raise ValueError(
            f"gate_weight must have shape (intermediate, {hidden}) to match x's last dim, "
            f"got {tuple(gate_weight.shape)}"
        )
    intermediate = gate_weight.shape[0]
    for name, t, shape in (
        ("gate_weight", gate_weight, (intermediate, hidden)),
        ("up_weight", up_weight, (intermediate, hidden)),
        ("down_weight", down_weight, (hidden, intermediate)),
        ("gate_bias", gate_bias, (intermediate,)),
        ("up_bias", up_bias, (intermediate,)),
        ("down_bias", down_bias, (hidden,)),
    ):
        if t is None and name.endswith("bias"):
            continue
        check_float(name, t)
        if t.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        check_device(name, t, x.device)
    dtypes = {x.dtype, gate_weight.dtype, up_weight.dtype, down_weight.dtype}
    if not dtypes <= set(KERNEL_DTYPES):
        return f"dtypes {sorted(map(str, dtypes))} run on the reference"
    return None


def _glu_mlp_kernel(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, normed_input,
                    recompute, discarded):
    return _GLUMLPFunction.apply(
        x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, normed_input, recompute,
        discarded,
    )


def _glu_mlp_reference(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, normed_input,
                       recompute, discarded):
    return glu_mlp_reference(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation)


# Inside torch.compile: the same launchers as library ops, with the Function's gradients (the
# intermediates not overwritten: a library op mutates none of its inputs).
def _forward_fake(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation):
    lead = x.shape[:-1]
    return tuple(x.new_empty((*lead, w.shape[0])) for w in (down_weight, gate_weight, up_weight))


@library_op(
    "glu_mlp",
    "(Tensor x, Tensor gate_weight, Tensor up_weight, Tensor down_weight, Tensor? gate_bias, Tensor? up_bias, "
    "Tensor? down_bias, str activation) -> (Tensor, Tensor, Tensor)",
    _forward_fake,
)
def _forward_op(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation):
    return glu_mlp_forward(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation)


def _grad_shapes(x, gate_weight, up_weight, down_weight):
    return (x.shape, gate_weight.shape, up_weight.shape, down_weight.shape, gate_weight.shape[:1],
            up_weight.shape[:1], down_weight.shape[:1])


def _backward_fake(grad_out, x, gate, up, gate_weight, up_weight, down_weight, activation, needs):
    shapes = _grad_shapes(x, gate_weight, up_weight, down_weight)
    return tuple(empty_if(need, x, shape) for need, shape in zip(needs, shapes))


@library_op(
    "glu_mlp_backward",
    "(Tensor grad_out, Tensor x, Tensor gate, Tensor up, Tensor gate_weight, Tensor up_weight, Tensor down_weight, "
    "str activation, bool[] needs) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _backward_fake,
)
def _backward_op(grad_out, x, gate, up, gate_weight, up_weight, down_weight, activation, needs):
    grads = glu_mlp_backward(
        grad_out, lambda: x.reshape(-1, x.shape[-1]), gate, up, gate_weight, up_weight, down_weight, activation,
        needs, in_place=False,
    )
    shapes = _grad_shapes(x, gate_weight, up_weight, down_weight)
    return tuple(x.new_empty(0) if g is None else g.view(shape) for g, shape in zip(grads, shapes))


def _setup_context(ctx, inputs, output):
    x, gate_weight, up_weight, down_weight, *_, activation = inputs
    ctx.save_for_backward(x, output[1], output[2], gate_weight, up_weight, down_weight)
    ctx.activation = activation


def _op_backward(ctx, grad_out, *_):
    needs = list(ctx.needs_input_grad[:7])
    grads = _backward_op(grad_out, *ctx.saved_tensors, ctx.activation, needs)
    return (*(g if need else None for g, need in zip(grads, needs)), None)


_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


def glu_mlp_compiled(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, normed_input,
                     recompute, discarded):
    """glu_mlp inside torch.compile: the forward library op (add_rms_norm_glu_mlp's too)."""
    # normed_input, recompute and discarded are not used: what a compiled graph keeps and forms is
    # the compiler's choice.
    dtype = autocast_dtype(x)
    if dtype is None:
        return _forward_op(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation)[0]
    # As autocast casts a linear's operands; the library op then runs with autocast off.
    cast = [t if t is None else t.to(dtype) for t in (x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)]
    with torch.autocast(x.device.type, enabled=False):
        return _forward_op(*cast, activation)[0]


GLU_MLP = Op("glu_mlp", _glu_mlp_kernel, _glu_mlp_reference, compiled=glu_mlp_compiled)


def glu_mlp(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    *,
    activation: str = "silu",
    normed_input: NormedInput | None = None,
    recompute: bool = False,
    output_discarded: bool = False,
) -> torch.Tensor:
    """The gated MLP ``down(act(gate(x)) * up(x))`` of Llama / Gemma, saving less for backward.

    Saves `x`, ``gate(x)`` and ``up(x)``; the down projection's input is recomputed in backward
    (one intermediate-sized tensor less than the unfused module). Works under autocast.

    Args:
        x: ``(..., hidden)`` input.
        gate_weight, up_weight: ``(intermediate, hidden)``; down_weight: ``(hidden, intermediate)``
            (``nn.Linear`` layout).
        gate_bias, up_bias, down_bias: optional biases.
        activation: ``"silu"`` (SwiGLU), ``"gelu_tanh"`` or ``"gelu"`` (GeGLU).
        normed_input: when `x` is the output of an RMSNorm whose input is kept anyway (a decoder
            layer's ``post_attention_layernorm``), what it was computed from: then that input is
            saved instead of `x`, and `x` is renormalised in backward (one cheap kernel), so a
            hidden-sized tensor per layer is not kept for the weight gradients.
        recompute: keep neither ``gate(x)`` nor ``up(x)``: backward forms them again (two more
            GEMMs, the same values), two intermediate-sized tensors less per call. Inside
            torch.compile the compiler decides what is kept.
        output_discarded: the caller never reads the output, only the gradients backward will
            give (gradient checkpointing's replay of a layer in backward): only what is kept for
            backward is formed, and the output is NaN. (The reference path forms it all the same.)

    Returns:
        ``(..., hidden)``.
    """
    args = (x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation)
    unsupported = check_glu_mlp(*args)
    if normed_input is not None:
        check_normed_input(x, normed_input)
    return GLU_MLP(unsupported, *args, normed_input, bool(recompute), bool(output_discarded))
