"""Rowwise FP8 (e4m3) quantisation written by a kernel in the pass that makes the tensor: the
epilogue the norm and gated-activation kernels share, its PyTorch reference, and its argument check.

The numbers are torchao.float8's dynamic scaling along the last dim (``axiswise_dim=-1``), which a
Float8Linear applies to its input (and the rowwise recipes to every operand):

    amax  = max |v| over the row                      (NaN if the row holds a NaN)
    scale = float32(448 / max(float64(amax), 1e-12))  (floored to a power of two when asked)
    data  = e4m3(clamp(v * scale, -448, 448))         (round to nearest even, saturating)

where `v` is the row as the op returns it (rounded to its output dtype, then widened to fp32), so
the payload is bit for bit what torchao makes of the op's output. The norms hold a row in
registers and cast it there; the gated activations' rows (up to 14336 and more wide, and several
tensors of them in backward) do not fit, so those kernels take the amax in a first pass over the
row that writes the output, then read the row back (from L2, just written) to cast it. Dividing in float64 and rounding
to fp32 is torchao's way; it also equals a correctly rounded fp32 division (53 >= 2 * 24 + 2 bits,
so the double rounding is innocuous), which the kernels cannot get from `/` in fp32 on the GPU.

Power-of-two scales are taken by clearing the fp32 mantissa: the largest power of two <= scale,
exactly. torchao computes ``exp2(floor(log2(scale)))``, whose fp32 log2 can round up to the next
integer for a scale within ~2**-21 of a power of two; 448 / amax lands there only when amax has
more than 11 significant bits near 7 * 2**k, so never for a bf16 or fp16 output.

Tensorwise scaling needs the tensor's amax before any element can be cast, which a one-pass kernel
cannot have. Mode ``"amax"`` writes only each row's amax: the tensorwise scale is then one small
max over rows and the cast one pass (torchao's own ``hp_tensor_and_scale_to_float8``), instead of
torchao's amax pass over the whole activation followed by the cast.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tigon.ops._dispatch import INTERPRET, tl, triton

FP8_MODES = ("rowwise", "rowwise_pow2", "amax")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_EPS = 1e-12  # torchao.float8.float8_utils.EPS: the smallest amax a scale is taken from

# torchao clamps amax in float64. An fp32 amax is below the float64 1e-12 exactly when it is at
# most this fp32 value; the scale there is that of 1e-12, rounded to fp32.
_EPS64 = torch.tensor(AMAX_EPS, dtype=torch.float64)
_EPS32 = _EPS64.float()
SMALL_AMAX = float(_EPS32 if _EPS32.double() < _EPS64 else torch.nextafter(_EPS32, torch.zeros(())))
SMALL_AMAX_SCALE = float((FP8_MAX / _EPS64).float())

# Triton's interpreter (the CPU tests) casts fp32 to e4m3 with rounding of its own (half away from
# zero, and a carry out of the mantissa lost: 127.99 becomes 64): there the payload is rounded on
# the bits instead (e4m3_bits), to the GPU's results.
ROUND_ON_BITS = tl.constexpr(INTERPRET)

# The kernels' FP8 constexpr: 0 writes nothing, else the mode's index + 1.
MODE_CODES = {None: 0, **{mode: i + 1 for i, mode in enumerate(FP8_MODES)}}


class Float8Rows(NamedTuple):
    """A tensor quantised to FP8 e4m3 with one scale per row (its last dim), as a fused kernel
    wrote it next to the tensor itself.

    Attributes:
        data: the e4m3 payload, the tensor's shape (None in mode ``"amax"``).
        scale: float32, shape ``(..., 1)``: the tensor is ``data / scale`` (None in mode ``"amax"``).
        amax: float32, shape ``(..., 1)``: each row's max |value| (NaN for a row holding a NaN).
    """

    data: torch.Tensor | None
    scale: torch.Tensor | None
    amax: torch.Tensor


def check_fp8_mode(fp8: str | None) -> str | None:
    """Raise ValueError unless `fp8` is None or one of :data:`FP8_MODES`."""
    if fp8 is not None and fp8 not in FP8_MODES:
        raise ValueError(f"fp8 must be None or one of {', '.join(map(repr, FP8_MODES))}, got {fp8!r}")
    return fp8


def fp8_rows_reference(values: torch.Tensor, fp8: str) -> Float8Rows:
    """:class:`Float8Rows` of `values` (over its last dim) in PyTorch: the kernels' oracle and
    the ops' fallback."""
    v = values.float()
    amax = v.abs().amax(-1, keepdim=True)  # torch's amax keeps a NaN
    if fp8 == "amax":
        return Float8Rows(None, None, amax)
    scale = (FP8_MAX / amax.double().clamp(min=AMAX_EPS)).float()
    if fp8 == "rowwise_pow2":
        floored = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
        scale = torch.where(scale.isnan(), scale, floored)
    data = (v * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Float8Rows(data, scale, amax)


def fp8_rows_buffers(like: torch.Tensor, fp8: str | None) -> Float8Rows | None:
    """Unwritten outputs of the kernels' FP8 epilogue for a tensor shaped like `like`."""
    if fp8 is None:
        return None
    per_row = (*like.shape[:-1], 1)
    amax = torch.empty(per_row, dtype=torch.float32, device=like.device)
    if fp8 == "amax":
        return Float8Rows(None, None, amax)
    data = torch.empty(like.shape, dtype=FP8_DTYPE, device=like.device)
    return Float8Rows(data, torch.empty(per_row, dtype=torch.float32, device=like.device), amax)


def fp8_kernel_args(rows: Float8Rows | None, fallback: torch.Tensor) -> tuple:
    """(data, scale, amax) pointers for a kernel launch: `fallback` where nothing is written."""
    if rows is None:
        return fallback, fallback, fallback
    return tuple(fallback if t is None else t for t in rows)


@triton.jit
def e4m3_bits(v):
    """fp32 `v` (|v| <= 448 or NaN) as float8_e4m3fn bits (uint8, in int32), rounded to nearest even."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    # Normal e4m3 (|v| >= 2**-6): drop 20 of fp32's 23 mantissa bits, rounding half to even
    # (a carry moves into the exponent), and rebias the exponent from 127 to 7.
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20).to(tl.int32) - 960
    # Subnormal e4m3 (multiples of 2**-9): |v| * 512 rounded to an integer, half to even, by the
    # 2**23 trick (exact in fp32 for values below 8).
    scaled = tl.abs(v) * 512.0
    subnormal = ((scaled + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(magnitude < 0x3C800000, subnormal, normal)  # 0x3C800000: fp32 bits of 2**-6
    code = tl.where(v != v, 0x7F, code)
    return code | sign.to(tl.int32)


@triton.jit
def store_e4m3(data_ptr, offsets, values, mask):
    """Store fp32 `values` (in e4m3's range, or NaN) as e4m3 at ``data_ptr + offsets``, rounded to
    nearest even: the GPU's cast, or :func:`e4m3_bits` under the interpreter."""
    if ROUND_ON_BITS:
        tl.store(data_ptr.to(tl.pointer_type(tl.uint8)) + offsets, e4m3_bits(values).to(tl.uint8), mask=mask)
    else:
        tl.store(data_ptr + offsets, values.to(data_ptr.dtype.element_ty), mask=mask)


@triton.jit
def max_keeping_nan(a, b):
    """max(a, b), NaN if either is: the GPU's plain max drops a NaN, torch's amax keeps it."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def amax_keeping_nan(values, axis: tl.constexpr):
    """max |values| along `axis`, NaN where a NaN is. Two built-in reductions rather than one
    through :func:`max_keeping_nan`: the interpreter runs a reduction with a function of its own
    element by element in Python (minutes for the CPU tests), the built-in ones in numpy."""
    amax = tl.max(tl.abs(values), axis=axis)
    return tl.where(tl.max((values != values).to(tl.int32), axis=axis) > 0, float("nan"), amax)


@triton.jit
def amax_to_scale(amax, small_amax, small_amax_scale, MODE: tl.constexpr):
    """torchao's fp32 scale of an fp32 `amax` (any shape), floored to a power of two for MODE 2."""
    # float64 so that the scale is the correctly rounded 448 / amax (fp32 `/` is approximate).
    scale = tl.where(amax <= small_amax, small_amax_scale, (448.0 / amax.to(tl.float64)).to(tl.float32))
    if MODE == 2:
        floored = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        scale = tl.where(scale != scale, scale, floored)
    return scale


@triton.jit
def quantize(values, scale):
    """``values * scale`` clamped to e4m3's range, NaN kept (a plain clamp would make it 448);
    the store to an e4m3 pointer rounds it."""
    return tl.clamp(values * scale, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def store_fp8_rows(
    values, rows, cols, row_mask, mask, data_ptr, data_row_stride, scale_ptr, amax_ptr, small_amax,
    small_amax_scale, MODE: tl.constexpr,
):
    """The FP8 epilogue for a (rows, cols) tile of whole rows: `values` fp32, already rounded to
    the op's output dtype; `rows` int64 row indices; `row_mask` and `mask` the valid rows and
    elements. MODE is a :data:`MODE_CODES` value other than 0."""
    amax = amax_keeping_nan(tl.where(mask, values, 0.0), 1)
    tl.store(amax_ptr + rows, amax, mask=row_mask)
    if MODE != 3:
        scale = amax_to_scale(amax, small_amax, small_amax_scale, MODE)
        tl.store(scale_ptr + rows, scale, mask=row_mask)
        store_e4m3(data_ptr, rows[:, None] * data_row_stride + cols[None, :], quantize(values, scale[:, None]), mask)


@triton.jit
def quantize_row(src_ptr, src_row_stride, data_ptr, scale_ptr, amax_ptr, row, amax, n_cols, small_amax,
                 small_amax_scale, MODE: tl.constexpr, BLOCK: tl.constexpr, m_ptr=None, HAS_M: tl.constexpr = False):
    """The FP8 epilogue for a row longer than a program holds: given its amax (over a first pass
    that wrote the row to `src_ptr`), cast it from there in BLOCK chunks. With HAS_M each column is
    multiplied by the fp32 ``m_ptr[col]`` first (in fp32, the amax taken of those products): an FP8
    weight's row scales folded into an output gradient, as :func:`tigon.ops.fp8.quantize_rows`
    folds them."""
    tl.store(amax_ptr + row, amax)
    if MODE != 3:
        scale = amax_to_scale(amax, small_amax, small_amax_scale, MODE)
        tl.store(scale_ptr + row, scale)
        tl.debug_barrier()  # the row was written by other threads of this program
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            values = tl.load(src_ptr + row * src_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_M:
                values = values * tl.load(m_ptr + cols, mask=mask, other=0.0)
            store_e4m3(data_ptr, row * n_cols + cols, quantize(values, scale), mask)
