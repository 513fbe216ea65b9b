"""FP8 (e4m3) weights and GEMMs for LoRA on a frozen FP8 base.

    quantize_rows(x, m):  s[i] = max_j |x[i, j] · m[j]| / 448,  q[i, j] = e4m3(x[i, j] · m[j] · (448 / max_j |…|))

Each row is read once (short rows several to a program): its absmax, then the e4m3 payload and the
row's fp32 scale (the dequantisation multiplier: ``x ≈ q · s``). The optional per-column
multiplier `m` folds a weight's row scales into an output gradient (see below). On a GPU the cast
to e4m3 is the hardware's (``cvt.rn.satfinite``: nearest even, saturating, NaN kept), which is
torch's own cast of in-range values. Triton's interpreter gets the fp8 cast wrong, so there the
kernel rounds on the bits to the same results (the CPU tests check that arithmetic against torch's
cast; the GPU test checks the hardware's).

A frozen base weight is an :class:`Fp8Weight`: the ``(out, in)`` e4m3 payload and fp32 scales of
``(bo, bi)`` blocks, ``W = q · scale[r // bo, c // bi]``. tigon's own quantisation (``--quant fp8``)
is per output row (``(1, in)`` blocks, one scale per row); FP8 checkpoints on the hub
(``quantization_config.weight_block_size``) are ``(128, 128)`` blocks, their ``weight_scale_inv``.

The GEMMs (:func:`fp8_matmul`, :func:`fp8_matmul_grad`; :func:`fp8_linear` is the differentiable
layer over them) run on ``torch._scaled_mm`` with rowwise
scales for a row-scaled weight on a GPU with FP8 tensor cores (compute capability 8.9+):

* forward ``x Wᵀ``: x quantised per token row on the fly, times the weight per output row (Hopper's
  fast accumulation, as torchao's float8 recipes use it in forward);
* input gradient ``dy W = dy (diag(s) q) = (dy · s) q``: the weight's row scales are folded into dy
  before it is quantised per row, and the e4m3 payload is the other operand as it is — no second
  weight copy is kept. cuBLAS takes FP8 operands only as row-major × column-major, so the payload is
  transposed into a reused buffer (one byte per weight, freed of meaning as soon as the GEMM has
  read it) for that GEMM.

Elsewhere (CPU, older GPUs, a half-precision x other than bfloat16, widths that are not multiples
of 16, block-scaled weights) each GEMM runs its reference: the weight dequantised and multiplied in
x's dtype, said once. Block-scaled (hub) weights are dequantised the same way on every GPU: exact
(the block scales are kept, nothing is re-quantised), at the cost of a bf16 GEMM.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from tigon.ops._checks import check_float
from tigon.ops._dispatch import Op, capturing, tl, triton
from tigon.ops._fp8 import Float8Rows, amax_keeping_nan, store_e4m3
from tigon.ops._launch import cdiv, launched, next_power_of_2

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# The smallest absmax a row's scale is taken from: a row of zeros gets this scale, not 0/0.
AMAX_FLOOR = 1e-12
MAX_ROW = 32768  # widest row the one-pass kernel keeps in registers; wider rows run the reference
ROW_TILE = 4096  # elements of a program's tile when rows are shorter than this


@launched
@triton.jit
def _quantize_rows_kernel(x_ptr, m_ptr, q_ptr, scale_ptr, n_rows, n_cols, stride_x,
                          HAS_M: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # ROWS whole rows per program, one per row of the tile: the row's absmax is a reduction along it.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_M:
        x = x * tl.load(m_ptr + cols, mask=cols < n_cols, other=0.0)[None, :]
    amax = amax_keeping_nan(x, 1)  # a NaN anywhere makes the row's scale NaN, as torch's amax does
    amax = tl.maximum(amax, 1e-12, propagate_nan=tl.PropagateNan.ALL)  # AMAX_FLOOR
    inv = tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)
    clamped = tl.clamp(x * inv[:, None], -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    store_e4m3(q_ptr, rows[:, None] * n_cols + cols[None, :], clamped, mask)
    tl.store(scale_ptr + rows, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), mask=rows < n_rows)


def _floored(amax: torch.Tensor) -> torch.Tensor:
    """Row absmaxes raised to :data:`AMAX_FLOOR` (a NaN kept), as the kernel takes its scales from them."""
    return torch.where(amax.isnan(), amax, amax.clamp_min(AMAX_FLOOR))


def quantize_rows_reference(x: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 payload of `x` · `col_scale`, the fp32 scale of each row) by PyTorch ops: the oracle
    and fallback of :func:`quantize_rows`."""
    x = x.float()
    if col_scale is not None:
        x = x * col_scale.float()
    amax = _floored(x.abs().amax(dim=-1, keepdim=True))
    # Tensor over tensor, both ways: torch takes a number over a tensor as the tensor's reciprocal
    # times the number (and on CUDA a tensor over a number as a product with its reciprocal), an ulp
    # off the correctly rounded quotients the kernel's div_rn computes.
    fp8_max = amax.new_full((), FP8_MAX)
    q = (x * (fp8_max / amax)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, (amax / fp8_max).view(-1)


def _quantize_rows(x: torch.Tensor, col_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    n_rows, n_cols = x.shape
    q = torch.empty((n_rows, n_cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block = next_power_of_2(n_cols)
    rows = max(1, ROW_TILE // block)  # short rows share a program (a weight's quantisation, the CPU tests)
    _quantize_rows_kernel[(cdiv(n_rows, rows),)](
        x, x if col_scale is None else col_scale, q, scale, n_rows, n_cols, x.stride(0),
        HAS_M=col_scale is not None, ROWS=rows, BLOCK=block,
        num_warps=min(16, max(4, block * rows // 1024)),
    )
    return q, scale


QUANTIZE_ROWS = Op("fp8_quantize", _quantize_rows, quantize_rows_reference)


def quantize_rows(x: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of the 2-D `x` (times the fp32 `col_scale` of each column, if given) as e4m3 with
    one fp32 scale per row, in one pass over `x` (see the module docstring).

    Args:
        x: ``(rows, cols)`` float16/bfloat16/float32, unit stride along the columns.
        col_scale: optional ``(cols,)`` float32 multiplier of each column.

    Returns:
        ``(q, scale)``: ``(rows, cols)`` float8_e4m3fn and ``(rows,)`` float32, ``x ≈ q · scale[:, None]``.
    """
    check_float("x", x)
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be a 2-D tensor with unit stride along its columns, got shape {tuple(x.shape)} "
                         f"and strides {x.stride()}")
    if col_scale is not None and (col_scale.dtype != torch.float32 or tuple(col_scale.shape) != (x.shape[1],)
                                  or col_scale.device != x.device or not col_scale.is_contiguous()):
        raise ValueError(f"col_scale must be a contiguous float32 ({x.shape[1]},) tensor on {x.device}, got "
                         f"{col_scale.dtype} {tuple(col_scale.shape)} on {col_scale.device}")
    unsupported = f"rows of {x.shape[1]} > {MAX_ROW} columns run on the reference" if x.shape[1] > MAX_ROW else None
    return QUANTIZE_ROWS(unsupported, x, col_scale)


def rows_operand(rows: Float8Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """What a kernel's rowwise FP8 epilogue wrote (:mod:`tigon.ops._fp8`, mode ``"rowwise"``) as
    the ``(q, scale)`` pair :func:`quantize_rows` returns, 2-D, for :func:`fp8_matmul`'s `x_fp8`:
    the same payload (both multiply by the correctly rounded 448 / amax), and amax / 448 (amax
    floored as there) as the scale that undoes it."""
    amax = _floored(rows.amax.reshape(-1))
    # Tensor over tensor: rounded once. The 448 is filled in on the device: a tensor made from a
    # host number is copied over, which waits for every kernel queued before it.
    return rows.data.reshape(-1, rows.data.shape[-1]), amax / amax.new_full((), FP8_MAX)


class Fp8Weight(NamedTuple):
    """A frozen linear weight in e4m3 with fp32 scales per block: ``W[r, c] = data[r, c] · scale[r // bo, c // bi]``.

    Attributes:
        data: ``(out, in)`` float8_e4m3fn payload.
        scale: ``(ceil(out / bo), ceil(in / bi))`` float32 multipliers (a hub checkpoint's
            ``weight_scale_inv``).
        block: ``(bo, bi)``; ``(1, in)`` is one scale per output row, which the FP8 GEMMs take.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def rowwise(self) -> bool:
        """Whether there is one scale per output row (the layout the FP8 GEMMs take)."""
        return self.block[0] == 1 and self.block[1] >= self.data.shape[1]


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """`weight` (``(out, in)``) in e4m3 with one fp32 scale per output row (:func:`quantize_rows`)."""
    with torch.no_grad():
        q, scale = quantize_rows(weight)
    return Fp8Weight(q, scale.view(-1, 1), (1, weight.shape[1]))


def check_fp8_weight(name: str, weight: Fp8Weight, device: torch.device | None = None) -> None:
    """Raise ValueError unless `weight` is a consistent Fp8Weight (on `device`, if given)."""
    if not isinstance(weight, Fp8Weight):
        raise ValueError(f"{name} must be a tigon.ops.Fp8Weight, got {type(weight).__name__}")
    data, scale, block = weight
    if not isinstance(data, torch.Tensor) or data.dtype != torch.float8_e4m3fn or data.dim() != 2 or not data.is_contiguous():
        raise ValueError(f"{name} data must be a contiguous 2-D float8_e4m3fn tensor, got "
                         f"{getattr(data, 'dtype', type(data).__name__)} {tuple(getattr(data, 'shape', ()))}")
    if len(block) != 2 or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block):
        raise ValueError(f"{name} block must be two positive ints (rows, cols), got {block!r}")
    blocks = tuple(-(-n // b) for n, b in zip(data.shape, block))
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or tuple(scale.shape) != blocks:
        raise ValueError(f"{name} scale must be a float32 {blocks} tensor (one per {block[0]}x{block[1]} block), got "
                         f"{getattr(scale, 'dtype', type(scale).__name__)} {tuple(getattr(scale, 'shape', ()))}")
    if device is not None and (data.device != device or scale.device != device):
        raise ValueError(f"{name} tensors must be on {device} like the input")


def dequantize_fp8(weight: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a ``(out, in)`` tensor of `dtype`: each payload times its block's scale in
    fp32, rounded once."""
    out_features, in_features = weight.shape
    scale = weight.scale.repeat_interleave(weight.block[0], 0)[:out_features]
    scale = scale.repeat_interleave(weight.block[1], 1)[:, :in_features] if weight.scale.shape[1] > 1 else scale
    return (weight.data.float() * scale).to(dtype)


@launched
@triton.jit
def _transpose_kernel(src_ptr, dst_ptr, n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    # A tile read along the source's rows and written along the destination's: both sides
    # coalesced, the exchange in between done on chip (torch's strided copy of one-byte elements
    # writes one byte per thread, far from the memory's bandwidth).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    tile = tl.load(src_ptr + rows[:, None] * n_cols + cols[None, :],
                   mask=(rows < n_rows)[:, None] & (cols < n_cols)[None, :])
    tl.store(dst_ptr + cols[:, None] * n_rows + rows[None, :], tl.trans(tile),
             mask=(cols < n_cols)[:, None] & (rows < n_rows)[None, :])


TRANSPOSE_TILE = 128  # bytes of a tile's side: one 128-byte line per row, read and written
TRANSPOSE_WARPS = 8


def transpose_bytes(data: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``data.t()`` made contiguous by a tiled kernel: a contiguous 2-D tensor of one-byte elements
    (the FP8 payloads) written, transposed, to `out` (``(cols, rows)``, contiguous; a fresh tensor
    when None), bit for bit."""
    if data.dim() != 2 or data.element_size() != 1 or not data.is_contiguous():
        raise ValueError(f"data must be a contiguous 2-D tensor of one-byte elements, got {data.dtype} "
                         f"{tuple(data.shape)} with strides {data.stride()}")
    rows, cols = data.shape
    if out is None:
        out = torch.empty((cols, rows), dtype=data.dtype, device=data.device)
    elif out.dtype != data.dtype or tuple(out.shape) != (cols, rows) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {data.dtype} ({cols}, {rows}) tensor, got {out.dtype} "
                         f"{tuple(out.shape)} with strides {out.stride()}")
    if data.numel():
        grid = (cdiv(rows, TRANSPOSE_TILE), cdiv(cols, TRANSPOSE_TILE))
        _transpose_kernel[grid](data.view(torch.uint8), out.view(torch.uint8), rows, cols,
                                BLOCK_ROWS=TRANSPOSE_TILE, BLOCK_COLS=TRANSPOSE_TILE, num_warps=TRANSPOSE_WARPS)
    return out


_workspaces: dict[torch.device, torch.Tensor] = {}


def _transposed(data: torch.Tensor) -> torch.Tensor:
    """``data.t()`` made contiguous (:func:`transpose_bytes`) in this device's reused fp8 buffer
    (see the module docstring); a fresh tensor while a CUDA graph is captured."""
    rows, cols = data.shape
    if capturing(data.device):
        return transpose_bytes(data)
    buffer = _workspaces.get(data.device)
    if buffer is None or buffer.numel() < data.numel():
        _workspaces.pop(data.device, None)  # freed before its replacement is allocated
        buffer = _workspaces[data.device] = torch.empty(data.numel(), dtype=data.dtype, device=data.device)
    return transpose_bytes(data, buffer[: data.numel()].view(cols, rows))


_ones: dict[tuple[int, torch.device], torch.Tensor] = {}


def _unit_scales(n: int, device: torch.device) -> torch.Tensor:
    """A ``(1, n)`` float32 tensor of ones on `device` (the input gradient GEMM's column scales),
    kept per width (a fresh one while a CUDA graph is captured, whose pool it would live in)."""
    if capturing(device):
        return torch.ones((1, n), dtype=torch.float32, device=device)
    ones = _ones.get((n, device))
    if ones is None:
        ones = _ones[(n, device)] = torch.ones((1, n), dtype=torch.float32, device=device)
    return ones


def release_workspaces() -> None:
    """Free the reused transpose buffers and unit scales (made again when next needed)."""
    _workspaces.clear()
    _ones.clear()


@functools.lru_cache(maxsize=None)  # asked before every GEMM
def _device_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"tensors are on {device.type}; FP8 GEMMs need a CUDA GPU of compute capability 8.9+"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}: FP8 GEMMs need 8.9+"
    return None


def fp8_gemm_reason(x: torch.Tensor, weight: Fp8Weight) -> str | None:
    """Why ``torch._scaled_mm`` cannot run the GEMMs of `x` (2-D rows) and `weight` (None if it can)."""
    if not weight.rowwise:
        return f"a {weight.block[0]}x{weight.block[1]}-block-scaled FP8 weight is dequantised for a {x.dtype} GEMM"
    device_reason = _device_reason(x.device)
    if device_reason is not None:
        return device_reason
    if x.dtype != torch.bfloat16:
        return f"rowwise-scaled FP8 GEMMs write bfloat16; {x.dtype} inputs run the dequantised weight"
    if any(n % 16 for n in weight.shape):
        return f"FP8 GEMMs need widths that are multiples of 16, got a {weight.shape[0]}x{weight.shape[1]} weight"
    return None


def fp8_matmul_reference(x: torch.Tensor, weight: Fp8Weight, x_fp8: tuple | None = None) -> torch.Tensor:
    """``x Wᵀ`` with the weight dequantised to x's dtype: the oracle and fallback of :func:`fp8_matmul`."""
    return torch.mm(x, dequantize_fp8(weight, x.dtype).t())


def unit_stride_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` with unit stride along its columns, as the quantisation kernel reads rows (a gradient
    may come expanded)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _fp8_matmul(x: torch.Tensor, weight: Fp8Weight, x_fp8: tuple | None = None) -> torch.Tensor:
    q, scale = x_fp8 if x_fp8 is not None else quantize_rows(unit_stride_rows(x))
    return torch._scaled_mm(q, weight.data.t(), scale_a=scale.view(-1, 1), scale_b=weight.scale.view(1, -1),
                            out_dtype=x.dtype, use_fast_accum=True)


def fp8_matmul_grad_reference(grad: torch.Tensor, weight: Fp8Weight, grad_fp8: tuple | None = None) -> torch.Tensor:
    """``dy W`` with the weight dequantised to dy's dtype: the oracle and fallback of :func:`fp8_matmul_grad`."""
    return torch.mm(grad, dequantize_fp8(weight, grad.dtype))


def _fp8_matmul_grad(grad: torch.Tensor, weight: Fp8Weight, grad_fp8: tuple | None = None) -> torch.Tensor:
    q, scale = grad_fp8 if grad_fp8 is not None else quantize_rows(unit_stride_rows(grad), weight.scale.view(-1))
    return torch._scaled_mm(q, _transposed(weight.data).t(), scale_a=scale.view(-1, 1),
                            scale_b=_unit_scales(weight.shape[1], grad.device),
                            out_dtype=grad.dtype)


# Torch calls around the quantisation op, which dispatches on its own.
FP8_MATMUL = Op("fp8_matmul", _fp8_matmul, fp8_matmul_reference, uses_triton=False)
FP8_MATMUL_GRAD = Op("fp8_matmul_grad", _fp8_matmul_grad, fp8_matmul_grad_reference, uses_triton=False)


def fp8_matmul(x: torch.Tensor, weight: Fp8Weight, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``x Wᵀ`` of the 2-D rows `x` and a frozen FP8 weight: an FP8 GEMM where one can run
    (:func:`fp8_gemm_reason`), else the dequantised weight's GEMM in x's dtype. No autograd.

    Args:
        x: ``(rows, in)``, unit stride along its columns.
        weight: the :class:`Fp8Weight` (``(out, in)``).
        x_fp8: `x` already quantised, ``quantize_rows(x)`` (several projections of one input
            share it); unused on the reference path.

    Returns:
        ``(rows, out)`` in x's dtype.
    """
    return FP8_MATMUL(fp8_gemm_reason(x, weight), x, weight, x_fp8)


def fp8_matmul_grad(
    grad: torch.Tensor, weight: Fp8Weight, grad_fp8: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """``dy W`` of the 2-D output gradient `grad` (``(rows, out)``) and a frozen FP8 weight
    (``(out, in)``), as :func:`fp8_matmul` runs: ``(rows, in)`` in grad's dtype. No autograd.
    `grad_fp8` is `grad` already quantised with the weight's row scales folded in,
    ``quantize_rows(grad, weight.scale.view(-1))`` (a kernel that made `grad` wrote it); unused
    on the reference path."""
    return FP8_MATMUL_GRAD(fp8_gemm_reason(grad, weight), grad, weight, grad_fp8)


def fp8_linear_reference(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x Wᵀ + b`` with the weight dequantised to x's dtype: the oracle and fallback of :func:`fp8_linear`."""
    return torch.nn.functional.linear(x, dequantize_fp8(weight, x.dtype), bias)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_data, weight_scale, block, bias):
        weight = Fp8Weight(weight_data, weight_scale, block)
        x2d = x.reshape(-1, x.shape[-1])
        out = fp8_matmul(x2d, weight)
        if bias is not None:
            out.add_(bias)
        ctx.weight = weight  # frozen: kept on ctx, not saved as an activation
        ctx.has_bias = bias is not None
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = fp8_matmul_grad(dy, ctx.weight) if ctx.needs_input_grad[0] else None
        grad_bias = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[4] else None
        if grad_x is not None:
            grad_x = grad_x.view(*grad_out.shape[:-1], grad_x.shape[-1])
        return grad_x, None, None, None, grad_bias


FP8_LINEAR = Op(
    "fp8_linear",
    lambda x, weight, bias: _Fp8LinearFunction.apply(x, *weight, bias),
    fp8_linear_reference,
    uses_triton=False,
)


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A linear layer on a frozen FP8 weight, ``x Wᵀ + bias``, differentiable in x and bias: FP8
    GEMMs forward and for dx where the GPU has them (see the module docstring).

    Args:
        x: ``(..., in)`` float16/bfloat16/float32.
        weight: the :class:`Fp8Weight` (``(out, in)``) on x's device.
        bias: optional ``(out,)`` in x's dtype.

    Returns:
        ``(..., out)`` in x's dtype.
    """
    check_float("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the features), got a scalar")
    check_fp8_weight("weight", weight, x.device)
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must have shape (out, {x.shape[-1]}) to match x, got {weight.shape}")
    if bias is not None and (bias.dtype != x.dtype or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"bias must be a ({weight.shape[0]},) {x.dtype} tensor, got {bias.dtype} {tuple(bias.shape)}")
    if not x.is_contiguous():
        x = x.contiguous()
    return FP8_LINEAR(None, x, weight, bias)
