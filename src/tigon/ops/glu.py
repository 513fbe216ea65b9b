"""Gated activations.

    swiglu(gate, up)             = silu(gate) * up
    geglu(gate, up, approximate) = gelu(gate) * up      (tanh approximation or exact erf)

Both take scalar multipliers, ``act(gate_multiplier * gate) * up * out_multiplier``: Falcon-H1's
MLP is ``down_proj(act(gate_proj(x) * gate_multiplier) * up_proj(x)) * down_multiplier``, and a
down projection without bias is linear, so its multiplier is the GLU's out_multiplier.

One forward and one backward kernel serve every activation (an ACTIVATION constexpr). The kernels
compute in fp32 and round once to the input dtype, the multipliers included (eager code rounds
``gate * gate_multiplier``, the activation and the product each to the input dtype on the way).
Backward recomputes the activation from `gate`, so only `gate` and `up` are saved, never
``act(gate)`` or the product. The gated MLPs around them
(:mod:`tigon.ops.composite.glu_mlp`, ...) use the launchers :func:`glu_forward` and :func:`glu_backward`.
"""

from __future__ import annotations

import math

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
def activate(gate, ACTIVATION: tl.constexpr):
    """act(gate) in fp32 for ACTIVATION, one of :data:`ACTIVATIONS` (the MoE experts' kernels use
    it too)."""
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
def activation_grad(gate, ACTIVATION: tl.constexpr):
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
    gate_multiplier, out_multiplier,
    ACTIVATION: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row, cols, mask = _program_block(n_cols, n_col_blocks, BLOCK)
    gate = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32) * gate_multiplier
    up = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, activate(gate, ACTIVATION) * up * out_multiplier, mask=mask)


@launched
@triton.jit
def _glu_bwd_kernel(
    grad_out_ptr, gate_ptr, up_ptr, grad_gate_ptr, grad_up_ptr, product_ptr,
    n_cols, n_col_blocks,
    grad_out_row_stride, gate_row_stride, up_row_stride,
    grad_gate_row_stride, grad_up_row_stride, product_row_stride,
    gate_multiplier, out_multiplier,
    ACTIVATION: tl.constexpr,
    STORE_PRODUCT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row, cols, mask = _program_block(n_cols, n_col_blocks, BLOCK)
    grad_out = tl.load(grad_out_ptr + row * grad_out_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32) * gate_multiplier
    up = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    act = activate(gate, ACTIVATION)
    grad_product = grad_out * out_multiplier
    grad_gate = grad_product * up * activation_grad(gate, ACTIVATION) * gate_multiplier
    tl.store(grad_gate_ptr + row * grad_gate_row_stride + cols, grad_gate, mask=mask)
    tl.store(grad_up_ptr + row * grad_up_row_stride + cols, grad_product * act, mask=mask)
    if STORE_PRODUCT:
        # The forward's output, recomputed with the forward's arithmetic (glu_mlp's down_proj input).
        tl.store(product_ptr + row * product_row_stride + cols, act * up * out_multiplier, mask=mask)


def activation_reference(gate: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) in PyTorch for `activation`, one of :data:`ACTIVATIONS`."""
    if activation == "silu":
        return torch_f.silu(gate)
    return torch_f.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none")


def _scaled(t: torch.Tensor, multiplier: float) -> torch.Tensor:
    return t if multiplier == 1.0 else t * multiplier


def glu_reference(
    gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", gate_multiplier: float = 1.0,
    out_multiplier: float = 1.0,
) -> torch.Tensor:
    """``act(gate * gate_multiplier) * up * out_multiplier`` in PyTorch for any of ACTIVATIONS:
    the test oracle and the fallback."""
    return _scaled(activation_reference(_scaled(gate, gate_multiplier), activation) * up, out_multiplier)


def swiglu_reference(
    gate: torch.Tensor, up: torch.Tensor, gate_multiplier: float = 1.0, out_multiplier: float = 1.0
) -> torch.Tensor:
    """``silu(gate * gate_multiplier) * up * out_multiplier`` in PyTorch."""
    return glu_reference(gate, up, "silu", gate_multiplier, out_multiplier)


def geglu_reference(
    gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh", gate_multiplier: float = 1.0,
    out_multiplier: float = 1.0,
) -> torch.Tensor:
    """``gelu(gate * gate_multiplier, approximate) * up * out_multiplier`` in PyTorch."""
    return glu_reference(gate, up, APPROXIMATIONS[approximate], gate_multiplier, out_multiplier)


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


def glu_forward(
    gate: torch.Tensor, up: torch.Tensor, activation: str, gate_multiplier: float = 1.0, out_multiplier: float = 1.0
) -> torch.Tensor:
    """``act(gate * gate_multiplier) * up * out_multiplier`` by the forward kernel, outside
    autograd; contiguous, dtype of `gate`."""
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    gate2d, up2d, out2d = _row_views(gate, up, out)
    n_programs, n_col_blocks = _grid(gate2d)
    _glu_fwd_kernel[(n_programs,)](
        gate2d, up2d, out2d,
        gate2d.shape[1], n_col_blocks,
        gate2d.stride(0), up2d.stride(0), out2d.stride(0),
        float(gate_multiplier), float(out_multiplier),
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
    gate_multiplier: float = 1.0,
    out_multiplier: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(grad_gate, grad_up, the forward's output or None) by the backward kernel, for the
    multipliers of :func:`glu_forward`.

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
        float(gate_multiplier), float(out_multiplier),
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
    activation, op, *multipliers = ctx.config
    inputs = (gate, up, activation, op, *multipliers)
    return op, lambda g, u, *_: glu_reference(g, u, activation, *multipliers), inputs


class _GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation, op, gate_multiplier, out_multiplier):
        ctx.save_for_backward(gate, up)
        ctx.config = (activation, op, gate_multiplier, out_multiplier)
        return glu_forward(gate, up, activation, gate_multiplier, out_multiplier)

    @staticmethod
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_out):
        gate, up = saved
        activation, _, gate_multiplier, out_multiplier = ctx.config
        grad_gate, grad_up, _ = glu_backward(
            grad_out, gate, up, activation, store_product=False, in_place=False,
            gate_multiplier=gate_multiplier, out_multiplier=out_multiplier,
        )
        return (
            grad_gate if ctx.needs_input_grad[0] else None,
            grad_up if ctx.needs_input_grad[1] else None,
            None,
            None,
            None,
            None,
        )


def _check_multipliers(gate_multiplier: object, out_multiplier: object) -> tuple[float, float]:
    """The multipliers as floats: finite real numbers (a tensor would get no gradient here)."""
    for name, value in (("gate_multiplier", gate_multiplier), ("out_multiplier", out_multiplier)):
        # Comparisons, not math.isfinite, which torch.compile cannot trace (NaN fails both).
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -math.inf < value < math.inf:
            raise ValueError(f"{name} must be a finite float, got {value!r}")
    return float(gate_multiplier), float(out_multiplier)


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
_MULTIPLIERS = "float gate_multiplier=1.0, float out_multiplier=1.0"


@library_op(
    "glu", f"(Tensor gate, Tensor up, str activation, {_MULTIPLIERS}) -> Tensor",
    lambda gate, up, activation, *_: torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
)
def glu_op(gate, up, activation, gate_multiplier=1.0, out_multiplier=1.0):
    """``act(gate * gate_multiplier) * up * out_multiplier`` as the library op ``tigon::glu``
    (what compiled graphs call)."""
    return glu_forward(gate, up, activation, gate_multiplier, out_multiplier)


def _backward_fake(grad_out, gate, up, activation, *_):
    return tuple(torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) for _ in range(2))


@library_op(
    "glu_backward", f"(Tensor grad_out, Tensor gate, Tensor up, str activation, {_MULTIPLIERS}) -> (Tensor, Tensor)",
    _backward_fake,
)
def _backward_op(grad_out, gate, up, activation, gate_multiplier=1.0, out_multiplier=1.0):
    return glu_backward(
        grad_out, gate, up, activation, store_product=False, in_place=False,
        gate_multiplier=gate_multiplier, out_multiplier=out_multiplier,
    )[:2]


def _setup_context(ctx, inputs, output):
    gate, up, *config = inputs
    ctx.save_for_backward(gate, up)
    ctx.config = config


def _op_backward(ctx, grad_out):
    return (*_backward_op(grad_out, *ctx.saved_tensors, *ctx.config), *(None for _ in ctx.config))


glu_op.register_autograd(_op_backward, setup_context=_setup_context)

SWIGLU = Op(
    "swiglu", lambda gate, up, *multipliers: _GLUFunction.apply(gate, up, "silu", SWIGLU, *multipliers),
    swiglu_reference, compiled=lambda gate, up, *multipliers: glu_op(gate, up, "silu", *multipliers),
)
GEGLU = Op(
    "geglu",
    lambda gate, up, approximate, *multipliers: _GLUFunction.apply(
        gate, up, APPROXIMATIONS[approximate], GEGLU, *multipliers
    ),
    geglu_reference,
    compiled=lambda gate, up, approximate, *multipliers: glu_op(gate, up, APPROXIMATIONS[approximate], *multipliers),
)


def swiglu(
    gate: torch.Tensor, up: torch.Tensor, *, gate_multiplier: float = 1.0, out_multiplier: float = 1.0
) -> torch.Tensor:
    """``silu(gate * gate_multiplier) * up * out_multiplier`` in one pass; backward saves only
    `gate` and `up`.

    Args:
        gate: the gate projection's output, any shape, float16/bfloat16/float32 (float64 runs the
            reference); need not be contiguous (e.g. one half of a fused gate/up projection).
        up: the up projection's output, same shape, dtype and device as `gate`.
        gate_multiplier: scales `gate` before the activation (Falcon-H1's ``gate_multiplier``).
        out_multiplier: scales the product (Falcon-H1's ``down_multiplier``, where the down
            projection has no bias: ``down(y) * m == down(y * m)``). Both are plain floats, applied
            in fp32 inside the kernels (no rounding of the scaled gate, unlike eager code); they
            get no gradient.

    Returns:
        A contiguous tensor of `gate`'s shape and dtype.
    """
    multipliers = _check_multipliers(gate_multiplier, out_multiplier)
    return SWIGLU(_check_pair(gate, up), gate, up, *multipliers)


def geglu(
    gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh", *, gate_multiplier: float = 1.0,
    out_multiplier: float = 1.0,
) -> torch.Tensor:
    """``gelu(gate * gate_multiplier) * up * out_multiplier`` in one pass; backward saves only
    `gate` and `up`.

    Args:
        gate, up, gate_multiplier, out_multiplier: as for :func:`swiglu`.
        approximate: ``"tanh"`` (Gemma's ``gelu_pytorch_tanh``) or ``"none"`` (exact erf GELU), as
            in :func:`torch.nn.functional.gelu`.

    Returns:
        A contiguous tensor of `gate`'s shape and dtype.
    """
    check_choice("approximate", approximate, APPROXIMATIONS)
    multipliers = _check_multipliers(gate_multiplier, out_multiplier)
    return GEGLU(_check_pair(gate, up), gate, up, approximate, *multipliers)
