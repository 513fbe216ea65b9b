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

With `fp8` the forward kernel also writes the product quantised to FP8 e4m3 with one scale per row
(the down projection's input, as torchao.float8 would quantise it), and the backward kernel the
gradients of `gate` and `up` likewise (the gate and up projections' output gradients), in the same
pass (:mod:`tigon.ops._fp8`). A scale needs the whole row, so those launches give each program
one whole row, which it walks twice: computing (and taking the amax), then casting what it wrote.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as torch_f

from tigon.ops._checks import check_choice, check_device, check_float, rows_view
from tigon.ops._dispatch import Op, backward_fallback, library_op, tl, triton
from tigon.ops._fp8 import (
    MODE_CODES, SMALL_AMAX, SMALL_AMAX_SCALE, Float8Rows, amax_keeping_nan, check_fp8_mode, fp8_kernel_args,
    fp8_rows_buffers, fp8_rows_reference, max_keeping_nan, quantize_row,
)
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


@triton.jit
def _glu_fwd_block(gate_ptr, up_ptr, out_ptr, row, cols, mask, gate_row_stride, up_row_stride, out_row_stride,
                   gate_multiplier, out_multiplier, ACTIVATION: tl.constexpr):
    """Computes and stores one block of the output; returns it as stored (rounded), in fp32."""
    gate = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32) * gate_multiplier
    up = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    out = (activate(gate, ACTIVATION) * up * out_multiplier).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_row_stride + cols, out, mask=mask)
    return out.to(tl.float32)


@launched
@triton.jit
def _glu_fwd_kernel(
    gate_ptr, up_ptr, out_ptr, fp8_ptr, fp8_scale_ptr, fp8_amax_ptr,
    n_cols, n_col_blocks,
    gate_row_stride, up_row_stride, out_row_stride,
    gate_multiplier, out_multiplier, small_amax, small_amax_scale,
    ACTIVATION: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if FP8 == 0:
        row, cols, mask = _program_block(n_cols, n_col_blocks, BLOCK)
        _glu_fwd_block(gate_ptr, up_ptr, out_ptr, row, cols, mask, gate_row_stride, up_row_stride, out_row_stride,
                       gate_multiplier, out_multiplier, ACTIVATION)
    else:
        # One program per row: its amax over a first pass, then the cast (quantize_row).
        row = tl.program_id(0).to(tl.int64)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            out = _glu_fwd_block(gate_ptr, up_ptr, out_ptr, row, cols, mask, gate_row_stride, up_row_stride,
                                 out_row_stride, gate_multiplier, out_multiplier, ACTIVATION)
            amax = max_keeping_nan(amax, tl.abs(out))
        quantize_row(out_ptr, out_row_stride, fp8_ptr, fp8_scale_ptr, fp8_amax_ptr, row,
                     amax_keeping_nan(amax, 0), n_cols, small_amax, small_amax_scale, FP8, BLOCK)


@triton.jit
def _glu_bwd_block(
    grad_out_ptr, gate_ptr, up_ptr, grad_gate_ptr, grad_up_ptr, product_ptr, row, cols, mask,
    grad_out_row_stride, gate_row_stride, up_row_stride, grad_gate_row_stride, grad_up_row_stride,
    product_row_stride, gate_multiplier, out_multiplier, ACTIVATION: tl.constexpr, STORE_PRODUCT: tl.constexpr,
):
    """Computes and stores one block of both gradients; returns them as stored (rounded), in fp32."""
    grad_out = tl.load(grad_out_ptr + row * grad_out_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32) * gate_multiplier
    up = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    act = activate(gate, ACTIVATION)
    grad_product = grad_out * out_multiplier
    grad_gate = (grad_product * up * activation_grad(gate, ACTIVATION) * gate_multiplier).to(grad_gate_ptr.dtype.element_ty)
    grad_up = (grad_product * act).to(grad_up_ptr.dtype.element_ty)
    tl.store(grad_gate_ptr + row * grad_gate_row_stride + cols, grad_gate, mask=mask)
    tl.store(grad_up_ptr + row * grad_up_row_stride + cols, grad_up, mask=mask)
    if STORE_PRODUCT:
        # The forward's output, recomputed with the forward's arithmetic (glu_mlp's down_proj input).
        tl.store(product_ptr + row * product_row_stride + cols, act * up * out_multiplier, mask=mask)
    return grad_gate.to(tl.float32), grad_up.to(tl.float32)


@launched
@triton.jit
def _glu_bwd_kernel(
    grad_out_ptr, gate_ptr, up_ptr, grad_gate_ptr, grad_up_ptr, product_ptr,
    gate_fp8_ptr, gate_fp8_scale_ptr, gate_fp8_amax_ptr, up_fp8_ptr, up_fp8_scale_ptr, up_fp8_amax_ptr,
    gate_m_ptr, up_m_ptr,
    n_cols, n_col_blocks,
    grad_out_row_stride, gate_row_stride, up_row_stride,
    grad_gate_row_stride, grad_up_row_stride, product_row_stride,
    gate_multiplier, out_multiplier, small_amax, small_amax_scale,
    ACTIVATION: tl.constexpr,
    STORE_PRODUCT: tl.constexpr,
    FP8: tl.constexpr,
    HAS_M: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if FP8 == 0:
        row, cols, mask = _program_block(n_cols, n_col_blocks, BLOCK)
        _glu_bwd_block(
            grad_out_ptr, gate_ptr, up_ptr, grad_gate_ptr, grad_up_ptr, product_ptr, row, cols, mask,
            grad_out_row_stride, gate_row_stride, up_row_stride, grad_gate_row_stride, grad_up_row_stride,
            product_row_stride, gate_multiplier, out_multiplier, ACTIVATION, STORE_PRODUCT,
        )
    else:
        # One program per row, as in the forward, for both gradients.
        row = tl.program_id(0).to(tl.int64)
        gate_amax = tl.zeros((BLOCK,), dtype=tl.float32)
        up_amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            grad_gate, grad_up = _glu_bwd_block(
                grad_out_ptr, gate_ptr, up_ptr, grad_gate_ptr, grad_up_ptr, product_ptr, row, cols, mask,
                grad_out_row_stride, gate_row_stride, up_row_stride, grad_gate_row_stride, grad_up_row_stride,
                product_row_stride, gate_multiplier, out_multiplier, ACTIVATION, STORE_PRODUCT,
            )
            if HAS_M:  # the gradients times the multipliers are what gets quantised
                grad_gate = grad_gate * tl.load(gate_m_ptr + cols, mask=mask, other=0.0)
                grad_up = grad_up * tl.load(up_m_ptr + cols, mask=mask, other=0.0)
            gate_amax = max_keeping_nan(gate_amax, tl.abs(grad_gate))
            up_amax = max_keeping_nan(up_amax, tl.abs(grad_up))
        quantize_row(grad_gate_ptr, grad_gate_row_stride, gate_fp8_ptr, gate_fp8_scale_ptr, gate_fp8_amax_ptr, row,
                     amax_keeping_nan(gate_amax, 0), n_cols, small_amax, small_amax_scale, FP8, BLOCK,
                     gate_m_ptr, HAS_M)
        quantize_row(grad_up_ptr, grad_up_row_stride, up_fp8_ptr, up_fp8_scale_ptr, up_fp8_amax_ptr, row,
                     amax_keeping_nan(up_amax, 0), n_cols, small_amax, small_amax_scale, FP8, BLOCK,
                     up_m_ptr, HAS_M)


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


def _with_fp8(out: torch.Tensor, fp8: str | None) -> torch.Tensor | tuple[torch.Tensor, Float8Rows]:
    return out if fp8 is None else (out, fp8_rows_reference(out, fp8))


def swiglu_reference(
    gate: torch.Tensor, up: torch.Tensor, gate_multiplier: float = 1.0, out_multiplier: float = 1.0,
    fp8: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, Float8Rows]:
    """``silu(gate * gate_multiplier) * up * out_multiplier`` in PyTorch (with `fp8`, and its
    :func:`tigon.ops._fp8.fp8_rows_reference`)."""
    return _with_fp8(glu_reference(gate, up, "silu", gate_multiplier, out_multiplier), fp8)


def geglu_reference(
    gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh", gate_multiplier: float = 1.0,
    out_multiplier: float = 1.0, fp8: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, Float8Rows]:
    """``gelu(gate * gate_multiplier, approximate) * up * out_multiplier`` in PyTorch (with `fp8`,
    and its :func:`tigon.ops._fp8.fp8_rows_reference`)."""
    return _with_fp8(glu_reference(gate, up, APPROXIMATIONS[approximate], gate_multiplier, out_multiplier), fp8)


def _row_views(*tensors: torch.Tensor, whole_rows: bool = False) -> list[torch.Tensor]:
    """2-D views of same-shaped tensors for the kernels: one row over everything when all are
    contiguous (no partial blocks at row ends) and `whole_rows` is not asked for, else
    (rows, last dim) views that keep row strides."""
    if not whole_rows and all(t.is_contiguous() for t in tensors):
        return [t.view(1, -1) for t in tensors]
    return [rows_view(t) for t in tensors]


def _grid(rows2d: torch.Tensor, whole_rows: bool = False) -> tuple[int, int]:
    """(programs, column blocks per row): flat blocks, or with `whole_rows` (the FP8 epilogue's
    scale needs the row) one program per row, which walks it in blocks."""
    n_rows, n_cols = rows2d.shape
    if whole_rows:
        return n_rows, 1
    n_col_blocks = cdiv(n_cols, BLOCK_SIZE)
    return n_rows * n_col_blocks, n_col_blocks


def glu_forward(
    gate: torch.Tensor, up: torch.Tensor, activation: str, gate_multiplier: float = 1.0, out_multiplier: float = 1.0,
    fp8: str | None = None, fp8_rows: Float8Rows | None = None,
) -> torch.Tensor:
    """``act(gate * gate_multiplier) * up * out_multiplier`` by the forward kernel, outside
    autograd; contiguous, dtype of `gate`. With `fp8` the kernel also fills `fp8_rows` (from
    :func:`tigon.ops._fp8.fp8_rows_buffers`) for the output."""
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    gate2d, up2d, out2d = _row_views(gate, up, out, whole_rows=fp8 is not None)
    n_programs, n_col_blocks = _grid(gate2d, whole_rows=fp8 is not None)
    _glu_fwd_kernel[(n_programs,)](
        gate2d, up2d, out2d, *fp8_kernel_args(fp8_rows, out2d),
        gate2d.shape[1], n_col_blocks,
        gate2d.stride(0), up2d.stride(0), out2d.stride(0),
        float(gate_multiplier), float(out_multiplier), SMALL_AMAX, SMALL_AMAX_SCALE,
        ACTIVATION=activation,
        FP8=MODE_CODES[fp8],
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
    fp8: str | None = None,
    fp8_grads: tuple[Float8Rows, Float8Rows] | None = None,
    fp8_column_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(grad_gate, grad_up, the forward's output or None) by the backward kernel, for the
    multipliers of :func:`glu_forward`. With `fp8` the kernel also fills `fp8_grads` (two
    :func:`tigon.ops._fp8.fp8_rows_buffers`) for grad_gate and grad_up: the gate and up
    projections' output gradients, quantised for their backward GEMMs; with
    `fp8_column_scales` (two contiguous fp32 vectors, one value per column) each gradient is
    multiplied by its vector before it is quantised (an FP8 weight's row scales, folded into the
    gradient as :func:`tigon.ops.fp8.quantize_rows` folds them; the bf16 gradients are returned
    as they are).

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
    views = _row_views(
        grad_out, gate, up, grad_gate, grad_up, *([product] if store_product else []), whole_rows=fp8 is not None
    )
    grad_out2d, gate2d, up2d, grad_gate2d, grad_up2d = views[:5]
    product2d = views[5] if store_product else grad_up2d  # unused by the kernel when not stored
    n_programs, n_col_blocks = _grid(gate2d, whole_rows=fp8 is not None)
    gate_rows, up_rows = fp8_grads if fp8 is not None else (None, None)
    has_m = fp8 is not None and fp8_column_scales is not None
    gate_m, up_m = fp8_column_scales if has_m else (grad_gate2d, grad_up2d)  # unread without HAS_M
    _glu_bwd_kernel[(n_programs,)](
        grad_out2d, gate2d, up2d, grad_gate2d, grad_up2d, product2d,
        *fp8_kernel_args(gate_rows, grad_gate2d), *fp8_kernel_args(up_rows, grad_up2d), gate_m, up_m,
        gate2d.shape[1], n_col_blocks,
        grad_out2d.stride(0), gate2d.stride(0), up2d.stride(0),
        grad_gate2d.stride(0), grad_up2d.stride(0), product2d.stride(0),
        float(gate_multiplier), float(out_multiplier), SMALL_AMAX, SMALL_AMAX_SCALE,
        ACTIVATION=activation,
        STORE_PRODUCT=store_product,
        FP8=MODE_CODES[fp8],
        HAS_M=has_m,
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
    inputs = (gate, up, activation, op, *multipliers, None)
    return op, lambda g, u, *_: glu_reference(g, u, activation, *multipliers), inputs


class _GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation, op, gate_multiplier, out_multiplier, fp8=None):
        ctx.save_for_backward(gate, up)
        ctx.config = (activation, op, gate_multiplier, out_multiplier)
        fp8_rows = fp8_rows_buffers(gate, fp8)
        out = glu_forward(gate, up, activation, gate_multiplier, out_multiplier, fp8, fp8_rows)
        # fp8_rows is no tensor to autograd: its tensors get no gradient, as quantised values.
        return out if fp8 is None else (out, fp8_rows)

    @staticmethod
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_out, *_):
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

# Inside torch.compile the fp8 option runs the reference, whose quantisation inductor fuses itself.
def _glu_compiled(gate, up, activation, gate_multiplier, out_multiplier, fp8):
    if fp8 is not None:
        return _with_fp8(glu_reference(gate, up, activation, gate_multiplier, out_multiplier), fp8)
    return glu_op(gate, up, activation, gate_multiplier, out_multiplier)


SWIGLU = Op(
    "swiglu", lambda gate, up, *options: _GLUFunction.apply(gate, up, "silu", SWIGLU, *options),
    swiglu_reference, compiled=lambda gate, up, *options: _glu_compiled(gate, up, "silu", *options),
)
GEGLU = Op(
    "geglu",
    lambda gate, up, approximate, *options: _GLUFunction.apply(gate, up, APPROXIMATIONS[approximate], GEGLU, *options),
    geglu_reference,
    compiled=lambda gate, up, approximate, *options: _glu_compiled(gate, up, APPROXIMATIONS[approximate], *options),
)


def swiglu(
    gate: torch.Tensor, up: torch.Tensor, *, gate_multiplier: float = 1.0, out_multiplier: float = 1.0,
    fp8: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, Float8Rows]:
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
        fp8: also quantise the output (the down projection's input) to FP8 e4m3 in the same pass:
            ``"rowwise"``, ``"rowwise_pow2"`` or ``"amax"``, as for :func:`tigon.ops.rms_norm`.
            Inside torch.compile this runs the reference, which inductor fuses.

    Returns:
        A contiguous tensor of `gate`'s shape and dtype; with `fp8`, ``(out, Float8Rows)``.
    """
    multipliers = _check_multipliers(gate_multiplier, out_multiplier)
    return SWIGLU(_check_pair(gate, up), gate, up, *multipliers, check_fp8_mode(fp8))


def geglu(
    gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh", *, gate_multiplier: float = 1.0,
    out_multiplier: float = 1.0, fp8: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, Float8Rows]:
    """``gelu(gate * gate_multiplier) * up * out_multiplier`` in one pass; backward saves only
    `gate` and `up`.

    Args:
        gate, up, gate_multiplier, out_multiplier, fp8: as for :func:`swiglu`.
        approximate: ``"tanh"`` (Gemma's ``gelu_pytorch_tanh``) or ``"none"`` (exact erf GELU), as
            in :func:`torch.nn.functional.gelu`.

    Returns:
        A contiguous tensor of `gate`'s shape and dtype; with `fp8`, ``(out, Float8Rows)``.
    """
    check_choice("approximate", approximate, APPROXIMATIONS)
    multipliers = _check_multipliers(gate_multiplier, out_multiplier)
    return GEGLU(_check_pair(gate, up), gate, up, approximate, *multipliers, check_fp8_mode(fp8))
