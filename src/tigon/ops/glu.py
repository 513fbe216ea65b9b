"""Gated activations.

    swiglu(gate, up)             = silu(gate) * up
    geglu(gate, up, approximate) = gelu(gate) * up      (tanh approximation or exact erf)

One forward and one backward kernel serve every activation (an ACTIVATION constexpr). The kernels
compute in fp32 and round once to the input dtype. Backward recomputes the activation from `gate`,
so only `gate` and `up` are saved, never ``act(gate)`` or the product. The gated MLPs around them
(:mod:`tigon.ops.composite.glu_mlp`, ...) use the launchers :func:`glu_forward` and :func:`glu_backward`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as torch_f

from tigon.ops._checks import check_choice, check_device, check_float, rows_view
from tigon.ops._dispatch import Op, backward_fallback, library_op, tl, triton
from tigon.ops._launch import cdiv, launched

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


@launched
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


@launched
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


def glu_forward(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
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


def glu_backward(
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


def _reference_point(ctx, saved):
    gate, up = saved
    activation, op = ctx.config
    return op, lambda g, u, *_: glu_reference(g, u, activation), (gate, up, activation, op)


class _GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation, op):
        ctx.save_for_backward(gate, up)
        ctx.config = (activation, op)
        return glu_forward(gate, up, activation)

    @staticmethod
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_out):
        gate, up = saved
        grad_gate, grad_up, _ = glu_backward(grad_out, gate, up, ctx.config[0], store_product=False, in_place=False)
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
    return None


# Inside torch.compile: the same launchers as library ops.
@library_op(
    "glu", "(Tensor gate, Tensor up, str activation) -> Tensor",
    lambda gate, up, activation: torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
)
def glu_op(gate, up, activation):
    """``act(gate) * up`` as the library op ``tigon::glu`` (what compiled graphs call)."""
    return glu_forward(gate, up, activation)


def _backward_fake(grad_out, gate, up, activation):
    return tuple(torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) for _ in range(2))


@library_op("glu_backward", "(Tensor grad_out, Tensor gate, Tensor up, str activation) -> (Tensor, Tensor)", _backward_fake)
def _backward_op(grad_out, gate, up, activation):
    return glu_backward(grad_out, gate, up, activation, store_product=False, in_place=False)[:2]


def _setup_context(ctx, inputs, output):
    gate, up, activation = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


def _op_backward(ctx, grad_out):
    return (*_backward_op(grad_out, *ctx.saved_tensors, ctx.activation), None)


glu_op.register_autograd(_op_backward, setup_context=_setup_context)

SWIGLU = Op(
    "swiglu", lambda gate, up: _GLUFunction.apply(gate, up, "silu", SWIGLU), swiglu_reference,
    compiled=lambda gate, up: glu_op(gate, up, "silu"),
)
GEGLU = Op(
    "geglu", lambda gate, up, approximate: _GLUFunction.apply(gate, up, APPROXIMATIONS[approximate], GEGLU),
    geglu_reference, compiled=lambda gate, up, approximate: glu_op(gate, up, APPROXIMATIONS[approximate]),
)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one pass; backward saves only `gate` and `up`.

    Args:
        gate: the gate projection's output, any shape, float16/bfloat16/float32 (float64 runs the
            reference); need not be contiguous (e.g. one half of a fused gate/up projection).
        up: the up projection's output, same shape, dtype and device as `gate`.

    Returns:
        A contiguous tensor of `gate`'s shape and dtype.
    """
    return SWIGLU(_check_pair(gate, up), gate, up)


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
    return GEGLU(_check_pair(gate, up), gate, up, approximate)
