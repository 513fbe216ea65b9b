"""Gated activations and the gated MLP built on them.

    swiglu(gate, up)             = silu(gate) * up
    geglu(gate, up, approximate) = gelu(gate) * up      (tanh approximation or exact erf)
    glu_mlp(x, ...)              = down_proj(act(gate_proj(x)) * up_proj(x))

One forward and one backward kernel serve every activation (an ACTIVATION constexpr). The kernels
compute in fp32 and round once to the input dtype. Backward recomputes the activation from `gate`,
so only `gate` and `up` are saved, never ``act(gate)`` or the product.

`glu_mlp` runs the three projections with torch matmuls around the kernels and saves the MLP input,
`gate` and `up` only: the down projection's input ``act(gate) * up`` is recomputed in backward, by
the same pass that computes the gradients of `gate` and `up`.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
import torch.nn.functional as torch_f

from tigon import _backend
from tigon._backend import tl, triton
from tigon._checks import KERNEL_DTYPES, check_choice, check_device, check_float, check_vector, rows_view
from tigon.ops._launch import cdiv
from tigon.ops.rms_norm import NormedInput

SWIGLU = _backend.register("swiglu")
GEGLU = _backend.register("geglu")
GLU_MLP = _backend.register("glu_mlp")

# "gelu_tanh" is gelu(approximate="tanh") (Gemma's gelu_pytorch_tanh), "gelu" the exact erf form.
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
APPROXIMATIONS = {"tanh": "gelu_tanh", "none": "gelu"}

# Elements per program. Each thread keeps two 16-byte bf16 vectors of every tensor in flight.
BLOCK_SIZE = 2048
NUM_WARPS = 4


@triton.jit
def _activation(gate, ACTIVATION: tl.constexpr):
    if ACTIVATION == "silu":
        act = gate * tl.sigmoid(gate)
    elif ACTIVATION == "gelu_tanh":
        # 0.5 * (1 + tanh(z)) == sigmoid(2z): no cancellation near z = 0.
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate * tl.sigmoid(2.0 * inner)
    else:
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    return act


@triton.jit
def _activation_grad(gate, ACTIVATION: tl.constexpr):
    """d act / d gate."""
    if ACTIVATION == "silu":
        sig = tl.sigmoid(gate)
        grad = sig * (1.0 + gate * (1.0 - sig))
    elif ACTIVATION == "gelu_tanh":
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        sig = tl.sigmoid(2.0 * inner)
        inner_grad = 0.7978845608028654 * (1.0 + 0.134145 * gate * gate)
        grad = sig + 2.0 * gate * sig * (1.0 - sig) * inner_grad
    else:
        cdf = 0.5 * (1.0 + tl.erf(gate * 0.7071067811865476))
        grad = cdf + gate * 0.3989422804014327 * tl.exp(-0.5 * gate * gate)
    return grad


@triton.jit
def _program_block(n_cols, n_col_blocks, BLOCK: tl.constexpr):
    """(row, cols, mask) of this program's block. The grid is one flat index over (rows, column
    blocks) because the row count may pass the grid's y limit."""
    pid = tl.program_id(0).to(tl.int64)
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    return pid // n_col_blocks, cols, cols < n_cols


@triton.jit
def _glu_fwd_kernel(
    gate_ptr, up_ptr, out_ptr,
    n_cols, n_col_blocks,
    gate_row_stride, up_row_stride, out_row_stride,
    ACTIVATION: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row, cols, mask = _program_block(n_cols, n_col_blocks, BLOCK)
    gate = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, _activation(gate, ACTIVATION) * up, mask=mask)


@triton.jit
def _glu_bwd_kernel(
    grad_out_ptr, gate_ptr, up_ptr, grad_gate_ptr, grad_up_ptr, product_ptr,
    n_cols, n_col_blocks,
    grad_out_row_stride, gate_row_stride, up_row_stride,
    grad_gate_row_stride, grad_up_row_stride, product_row_stride,
    ACTIVATION: tl.constexpr,
    STORE_PRODUCT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row, cols, mask = _program_block(n_cols, n_col_blocks, BLOCK)
    grad_out = tl.load(grad_out_ptr + row * grad_out_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    act = _activation(gate, ACTIVATION)
    grad_gate = grad_out * up * _activation_grad(gate, ACTIVATION)
    tl.store(grad_gate_ptr + row * grad_gate_row_stride + cols, grad_gate, mask=mask)
    tl.store(grad_up_ptr + row * grad_up_row_stride + cols, grad_out * act, mask=mask)
    if STORE_PRODUCT:
        # The forward's output, recomputed with the forward's arithmetic (glu_mlp's down_proj input).
        tl.store(product_ptr + row * product_row_stride + cols, act * up, mask=mask)


def _activation_reference(gate: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch_f.silu(gate)
    return torch_f.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none")


def glu_reference(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` in PyTorch for any of ACTIVATIONS: the test oracle and the fallback."""
    return _activation_reference(gate, activation) * up


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in PyTorch."""
    return torch_f.silu(gate) * up


def geglu_reference(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """``gelu(gate, approximate) * up`` in PyTorch."""
    return torch_f.gelu(gate, approximate=approximate) * up


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


def _row_views(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """2-D views of same-shaped tensors for the kernels: one row over everything when all are
    contiguous (no partial blocks at row ends), else (rows, last dim) views that keep row strides."""
    if all(t.is_contiguous() for t in tensors):
        return [t.view(1, -1) for t in tensors]
    return [rows_view(t) for t in tensors]


def _grid(rows2d: torch.Tensor) -> tuple[int, int]:
    n_rows, n_cols = rows2d.shape
    n_col_blocks = cdiv(n_cols, BLOCK_SIZE)
    return n_rows * n_col_blocks, n_col_blocks


def _glu_forward(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` by the forward kernel, outside autograd; contiguous, dtype of `gate`."""
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    gate2d, up2d, out2d = _row_views(gate, up, out)
    n_programs, n_col_blocks = _grid(gate2d)
    _glu_fwd_kernel[(n_programs,)](
        gate2d, up2d, out2d,
        gate2d.shape[1], n_col_blocks,
        gate2d.stride(0), up2d.stride(0), out2d.stride(0),
        ACTIVATION=activation,
        BLOCK=BLOCK_SIZE,
        num_warps=NUM_WARPS,
    )
    return out


def _glu_backward(
    grad_out: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    store_product: bool,
    in_place: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(grad_gate, grad_up, act(gate) * up or None) by the backward kernel.

    With `in_place` (for an op whose `gate`, `up` and `grad_out` are its own intermediates, which
    no caller sees) grad_gate overwrites gate, grad_up overwrites up and the product overwrites
    grad_out: the backward then allocates nothing of their size, which is the training step's
    memory peak. Each element is read before it is written, by the same program. The saved gate
    and up are bumped to a new version, so a second backward through a retained graph fails
    loudly in autograd instead of reading gradients as activations.
    """
    in_place = in_place and all(t.is_contiguous() for t in (grad_out, gate, up))
    if in_place:
        grad_gate, grad_up = gate, up
        product = grad_out if store_product else None
    else:
        grad_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        grad_up = torch.empty(up.shape, dtype=up.dtype, device=up.device)
        product = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) if store_product else None
    views = _row_views(grad_out, gate, up, grad_gate, grad_up, *([product] if store_product else []))
    grad_out2d, gate2d, up2d, grad_gate2d, grad_up2d = views[:5]
    product2d = views[5] if store_product else grad_up2d  # unused by the kernel when not stored
    n_programs, n_col_blocks = _grid(gate2d)
    _glu_bwd_kernel[(n_programs,)](
        grad_out2d, gate2d, up2d, grad_gate2d, grad_up2d, product2d,
        gate2d.shape[1], n_col_blocks,
        grad_out2d.stride(0), gate2d.stride(0), up2d.stride(0),
        grad_gate2d.stride(0), grad_up2d.stride(0), product2d.stride(0),
        ACTIVATION=activation,
        STORE_PRODUCT=store_product,
        BLOCK=BLOCK_SIZE,
        num_warps=NUM_WARPS,
    )
    if in_place:
        torch.autograd.graph.increment_version(gate)
        torch.autograd.graph.increment_version(up)
    return grad_gate, grad_up, product


def _glu_backward_or_reference(op, grad_out, gate, up, activation, store_product=False, in_place=False):
    """:func:`_glu_backward`, or the reference's gradients if the kernel fails to compile or launch."""
    try:
        return _glu_backward(grad_out, gate, up, activation, store_product, in_place)
    except Exception as err:
        reference = functools.partial(glu_reference, activation=activation)
        grad_gate, grad_up = _backend.reference_backward(op, err, reference, (gate, up), (grad_out,))
        product = reference(gate, up) if store_product else None
        return grad_gate, grad_up, product


class _GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation, op):
        ctx.save_for_backward(gate, up)
        ctx.config = (activation, op)
        return _glu_forward(gate, up, activation)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        activation, op = ctx.config
        grad_gate, grad_up, _ = _glu_backward_or_reference(op, grad_out, gate, up, activation)
        return (
            grad_gate if ctx.needs_input_grad[0] else None,
            grad_up if ctx.needs_input_grad[1] else None,
            None,
            None,
        )


def _check_pair(gate: torch.Tensor, up: torch.Tensor) -> str | None:
    """Validate gate/up; return why the kernel cannot take them, if it cannot."""
    check_float("gate", gate)
    check_float("up", up)
    if up.shape != gate.shape:
        raise ValueError(f"up must have the shape of gate {tuple(gate.shape)}, got {tuple(up.shape)}")
    if up.dtype != gate.dtype:
        raise ValueError(f"up must have the dtype of gate ({gate.dtype}), got {up.dtype}")
    check_device("up", up, gate.device)
    if gate.dtype not in KERNEL_DTYPES:
        return f"dtype {gate.dtype} runs on the reference"
    return None


def _glu_kernel(gate, up, activation, op):
    return _GLUFunction.apply(gate, up, activation, op)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one pass; backward saves only `gate` and `up`.

    Args:
        gate: the gate projection's output, any shape, float16/bfloat16/float32 (float64 runs the
            reference); need not be contiguous (e.g. one half of a fused gate/up projection).
        up: the up projection's output, same shape, dtype and device as `gate`.

    Returns:
        A contiguous tensor of `gate`'s shape and dtype.
    """
    unsupported = _check_pair(gate, up)
    if gate.numel() == 0:
        return swiglu_reference(gate, up)
    return _backend.dispatch(
        SWIGLU, lambda g, u: _glu_kernel(g, u, "silu", SWIGLU), swiglu_reference, gate, up,
        device=gate.device, unsupported=unsupported,
    )


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """``gelu(gate) * up`` in one pass; backward saves only `gate` and `up`.

    Args:
        gate, up: as for :func:`swiglu`.
        approximate: ``"tanh"`` (Gemma's ``gelu_pytorch_tanh``) or ``"none"`` (exact erf GELU), as
            in :func:`torch.nn.functional.gelu`.

    Returns:
        A contiguous tensor of `gate`'s shape and dtype.
    """
    check_choice("approximate", approximate, APPROXIMATIONS)
    unsupported = _check_pair(gate, up)
    if gate.numel() == 0:
        return geglu_reference(gate, up, approximate)
    activation = APPROXIMATIONS[approximate]
    return _backend.dispatch(
        GEGLU, lambda g, u, a: _glu_kernel(g, u, activation, GEGLU), geglu_reference, gate, up, approximate,
        device=gate.device, unsupported=unsupported,
    )


def glu_mlp_forward(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation):
    """The gated MLP outside autograd: ``(out, gate, up)``; gate and up are what
    :func:`glu_mlp_backward` takes."""
    gate = torch_f.linear(x, gate_weight, gate_bias)
    up = torch_f.linear(x, up_weight, up_bias)
    return torch_f.linear(_glu_forward(gate, up, activation), down_weight, down_bias), gate, up


def glu_mlp_backward(
    op: str,
    grad_out: torch.Tensor,
    input_rows: Callable[[], torch.Tensor],
    gate: torch.Tensor,
    up: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    activation: str,
    needs: Sequence[bool],
) -> list[torch.Tensor | None]:
    """Gradients of the gated MLP for `needs` = (x, gate_weight, up_weight, down_weight,
    gate_bias, up_bias, down_bias), in that order (None where not needed; dx as 2-D rows).

    `gate` and `up` are the forward's, and are overwritten (they are the op's own intermediates);
    `input_rows()` gives the MLP's input as 2-D rows, asked for only if a weight gradient needs it.
    `op` names the op whose kernel falls back if the GLU backward kernel fails.
    """
    grad_out2d = grad_out.reshape(-1, grad_out.shape[-1])
    grad_h = torch.matmul(grad_out2d, down_weight)
    # grad_h, gate and up are ours alone: the gradients and the recomputed down_proj input
    # (needed only for the down weight's gradient) overwrite them.
    grad_gate, grad_up, product = _glu_backward_or_reference(
        op, grad_h, gate.reshape(grad_h.shape), up.reshape(grad_h.shape), activation,
        store_product=needs[3], in_place=True,
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


class _GLUMLPFunction(torch.autograd.Function):
    # custom_fwd/custom_bwd: under autocast the backward's matmuls run in the forward's precision.
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation,
                norm_source, norm_weight, norm_config):
        out, gate, up = glu_mlp_forward(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation)
        # With a norm source, x itself is not kept: backward renormalises the source.
        kept = (norm_source, norm_weight) if norm_source is not None else (x,)
        ctx.save_for_backward(gate, up, gate_weight, up_weight, down_weight, *kept)
        ctx.activation, ctx.norm_config = activation, norm_config
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_out):
        gate, up, gate_weight, up_weight, down_weight, *kept = ctx.saved_tensors

        def input_rows() -> torch.Tensor:
            x = NormedInput(*kept, *ctx.norm_config).recompute() if ctx.norm_config is not None else kept[0]
            return x.reshape(-1, x.shape[-1])

        grads = glu_mlp_backward(
            GLU_MLP, grad_out, input_rows, gate, up, gate_weight, up_weight, down_weight, ctx.activation,
            ctx.needs_input_grad[:7],
        )
        if grads[0] is not None:
            grads[0] = grads[0].view(*grad_out.shape[:-1], grads[0].shape[-1])
        return (*grads, None, None, None, None)


def _check_mlp(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation) -> str | None:
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


def _glu_mlp_kernel(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, normed_input):
    norm = (None, None, None) if normed_input is None else (*normed_input[:2], tuple(normed_input[2:]))
    return _GLUMLPFunction.apply(
        x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, *norm
    )


def _glu_mlp_reference(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, normed_input):
    return glu_mlp_reference(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation)


def _check_normed_input(x: torch.Tensor, normed_input: NormedInput) -> None:
    if not isinstance(normed_input, NormedInput):
        raise ValueError(f"normed_input must be a tigon.ops.rms_norm.NormedInput, got {type(normed_input).__name__}")
    source, weight = normed_input.source, normed_input.weight
    if source.shape != x.shape or source.device != x.device:
        raise ValueError(
            f"normed_input.source must have x's shape {tuple(x.shape)} on {x.device}, "
            f"got {tuple(source.shape)} on {source.device}"
        )
    check_vector("normed_input.weight", weight, x.shape[-1], x.device)


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

    Returns:
        ``(..., hidden)``.
    """
    args = (x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation)
    unsupported = _check_mlp(*args)
    if normed_input is not None:
        _check_normed_input(x, normed_input)
    if x.numel() == 0:
        return glu_mlp_reference(*args)
    return _backend.dispatch(
        GLU_MLP, _glu_mlp_kernel, _glu_mlp_reference, *args, normed_input,
        device=x.device, unsupported=unsupported,
    )
