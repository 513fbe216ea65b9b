"""Dequantisation of bitsandbytes' 4-bit (NF4 / FP4) and 8-bit (LLM.int8) weights, bit for bit.

    4-bit:  W[i] = code[nibble(i)] · absmax[i // blocksize]
            absmax[b] = scale_code[q[b]] · scale_absmax[b // scale_blocksize] + offset   (double quantisation)
    8-bit:  W[r, c] = (CB[r, c] · SCB[r]) · fp32(1/127)

A 4-bit weight is stored flat, row-major, two codes per byte, the first element of a pair in the
high nibble; every `blocksize` consecutive elements share one absmax. Double quantisation stores the
absmaxes themselves as 8-bit codes, `scale_blocksize` (256) of them per fp32 absmax, around their
mean (`offset`). The 8-bit weight is one int8 row per output feature with its absmax per row.

Each product is formed in fp32 and rounded once to the output dtype, as bitsandbytes does (its
``dequantize_4bit`` and ``int8_vectorwise_dequant``, on the CPU and the GPU), so the results are
the same bits; the double-quantised absmax is a multiply and then an add, never fused, as in
bitsandbytes (separate kernels there). Weights are frozen: no op here has a gradient.

The LoRA ops (:mod:`tigon.ops.composite.lora`) dequantise a base weight into a reused buffer just
before each GEMM that reads it (:func:`dequantized`), so no full-precision copy outlives the GEMM.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tigon.ops._checks import check_choice, check_float
from tigon.ops._dispatch import Op, capturing, tl, triton
from tigon.ops._launch import cdiv

# Packed bytes per program (at least one block): 8192 weights over 4 warps, each thread 32 bytes
# in and 128 out (bf16). The fastest of 512-4096 bytes and 4 or 8 warps on an H200
# (scripts/dequant_bench.py).
BYTES_PER_PROGRAM = 4096
INT8_BLOCK = 2048
NUM_WARPS = 4
INV_127 = 0.007874015718698502  # fp32(1 / 127), the constant bitsandbytes multiplies by


@triton.jit
def _to_output(value, out_ptr):
    """`value` (fp32) rounded to the output's dtype, to nearest even. For bfloat16 the rounding is
    done on the bits: Triton's interpreter truncates an fp32 -> bf16 cast, and this is exactly the
    GPU's conversion (NaN kept a quiet NaN, overflow to inf)."""
    if out_ptr.dtype.element_ty == tl.bfloat16:
        bits = value.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(value != value, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return value.to(out_ptr.dtype.element_ty)


@triton.jit
def block_absmax(absmax_ptr, scale_code_ptr, scale_absmax_ptr, offset_ptr, block, mask,
                 SCALE_BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr):
    """The fp32 absmax of the quantisation blocks `block` (any shape; finite where not `mask`),
    undoing the double quantisation when NESTED. Shared with the fused 4-bit GEMM
    (:mod:`tigon.ops.gemm_4bit`), which must dequantise to the same bits."""
    # One return: compiled code types every return statement, even one a constexpr branch skips.
    if NESTED:
        q = tl.load(absmax_ptr + block, mask=mask, other=0).to(tl.int32)
        scale = tl.load(scale_absmax_ptr + block // SCALE_BLOCKSIZE, mask=mask, other=0.0)
        absmax = tl.load(scale_code_ptr + q) * scale
        absmax = absmax + tl.load(offset_ptr)
    else:
        absmax = tl.load(absmax_ptr + block, mask=mask, other=0.0)
    return absmax


@triton.jit
def _dequantize_4bit_kernel(
    packed_ptr, code_ptr, absmax_ptr, scale_code_ptr, scale_absmax_ptr, offset_ptr, out_ptr,
    n_bytes, n_elements,
    BLOCKSIZE: tl.constexpr,
    SCALE_BLOCKSIZE: tl.constexpr,
    NESTED: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    # BLOCKS whole quantisation blocks per program, one row of the tile each: the absmax is read
    # (and double-dequantised) once per block and broadcast along its row.
    HALF: tl.constexpr = BLOCKSIZE // 2  # bytes per block
    block = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    byte = block[:, None] * HALF + tl.arange(0, HALF)[None, :]
    packed = tl.load(packed_ptr + byte, mask=byte < n_bytes, other=0).to(tl.int32)
    absmax = block_absmax(absmax_ptr, scale_code_ptr, scale_absmax_ptr, offset_ptr, block,
                          block * BLOCKSIZE < n_elements, SCALE_BLOCKSIZE, NESTED)
    high = tl.load(code_ptr + (packed >> 4)) * absmax[:, None]
    low = tl.load(code_ptr + (packed & 15)) * absmax[:, None]
    values = tl.reshape(tl.join(high, low), (BLOCKS, BLOCKSIZE))  # high, low, high, low, ... per row
    element = block[:, None] * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]
    tl.store(out_ptr + element, _to_output(values, out_ptr), mask=element < n_elements)


@triton.jit
def _dequantize_int8_kernel(data_ptr, row_absmax_ptr, out_ptr, n_elements, n_cols, BLOCK: tl.constexpr):
    element = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = element < n_elements
    q = tl.load(data_ptr + element, mask=mask, other=0).to(tl.float32)
    row_absmax = tl.load(row_absmax_ptr + element // n_cols, mask=mask, other=0.0)
    value = (q * row_absmax) * 0.007874015718698502  # INV_127 (a kernel reads no plain global)
    tl.store(out_ptr + element, _to_output(value, out_ptr), mask=mask)


class QuantizedWeight(NamedTuple):
    """A frozen linear weight stored by bitsandbytes, in the terms of its dequantisation.

    Attributes:
        data: 4-bit: the packed codes (any dtype, read as bytes: ``ceil(out·in / 2)`` of them);
            int8: the ``(out, in)`` int8 matrix (``CB``).
        absmax: 4-bit: one fp32 absmax per block, or with double quantisation its uint8 code;
            int8: the fp32 absmax of each row (``SCB``).
        shape: ``(out, in)``.
        code: 4-bit: the 16 fp32 values a code stands for (NF4 or FP4); None for int8.
        blocksize: 4-bit: weights per absmax.
        scale_code, scale_absmax, offset: double quantisation: the 256 values an absmax code stands
            for, one fp32 scale per `scale_blocksize` absmaxes, and the 0-d fp32 mean added back;
            None otherwise.
        scale_blocksize: absmaxes per `scale_absmax`.
    """

    data: torch.Tensor
    absmax: torch.Tensor
    shape: tuple[int, int]
    code: torch.Tensor | None = None
    blocksize: int = 64
    scale_code: torch.Tensor | None = None
    scale_absmax: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    scale_blocksize: int = 256

    @property
    def kind(self) -> str:
        """``"4bit"`` or ``"int8"``."""
        return "int8" if self.code is None else "4bit"

    @property
    def nested(self) -> bool:
        return self.scale_absmax is not None

    @property
    def device(self) -> torch.device:
        return self.data.device


def _absmax_reference(weight: QuantizedWeight) -> torch.Tensor:
    """The fp32 absmax of every block (undoing the double quantisation)."""
    if not weight.nested:
        return weight.absmax
    scales = weight.scale_absmax.repeat_interleave(weight.scale_blocksize)[: weight.absmax.numel()]
    return weight.scale_code[weight.absmax.long()] * scales + weight.offset


def dequantize_reference(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight in `dtype` by PyTorch ops, as bitsandbytes computes it: the oracle and fallback."""
    out_features, in_features = weight.shape
    n = out_features * in_features
    if weight.kind == "int8":
        return (weight.data.float() * weight.absmax.view(-1, 1) * INV_127).to(dtype)
    packed = weight.data.reshape(-1).view(torch.uint8).long()
    codes = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[:n]
    absmax = _absmax_reference(weight).repeat_interleave(weight.blocksize)[:n]
    return (weight.code[codes] * absmax).to(dtype).view(out_features, in_features)


def _dequantize_into(out: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """Launch the kernel writing `weight` into the contiguous `out` (of its shape)."""
    n = out.numel()
    if weight.kind == "int8":
        _dequantize_int8_kernel[(cdiv(n, INT8_BLOCK),)](
            weight.data, weight.absmax, out, n, weight.shape[1], BLOCK=INT8_BLOCK, num_warps=NUM_WARPS,
        )
        return out
    packed = weight.data.reshape(-1).view(torch.uint8)
    n_bytes = cdiv(n, 2)
    nested = weight.nested
    # Unused pointers of the plain layout are bound to the absmax; the kernel does not read them.
    scale_code = weight.scale_code if nested else weight.absmax
    scale_absmax = weight.scale_absmax if nested else weight.absmax
    offset = weight.offset if nested else weight.absmax
    blocks = max(1, 2 * BYTES_PER_PROGRAM // weight.blocksize)
    _dequantize_4bit_kernel[(cdiv(cdiv(n, weight.blocksize), blocks),)](
        packed, weight.code, weight.absmax, scale_code, scale_absmax, offset, out,
        n_bytes, n,
        BLOCKSIZE=weight.blocksize, SCALE_BLOCKSIZE=weight.scale_blocksize, NESTED=nested, BLOCKS=blocks,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # the nested absmax is a multiply, then an add: not one FMA
    )
    return out


def _reference_into(out: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    return out.copy_(dequantize_reference(weight, out.dtype))


DEQUANTIZE = Op("dequantize", _dequantize_into, _reference_into)

OUTPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_quantized(name: str, weight: QuantizedWeight, device: torch.device | None = None) -> None:
    """Raise ValueError unless `weight` is a consistent QuantizedWeight (on `device`, if given)."""
    if not isinstance(weight, QuantizedWeight):
        raise ValueError(f"{name} must be a tigon.ops.QuantizedWeight, got {type(weight).__name__}")
    shape = tuple(weight.shape)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"{name} shape must be (out, in) with both >= 1, got {shape}")
    n = shape[0] * shape[1]
    tensors = [weight.data, weight.absmax] + ([] if weight.code is None else [weight.code])
    if weight.nested:
        tensors += [weight.scale_code, weight.scale_absmax, weight.offset]
    if device is not None and any(t.device != device for t in tensors):
        raise ValueError(f"{name} tensors must all be on {device} like the input")
    if weight.kind == "int8":
        if weight.data.dtype != torch.int8 or tuple(weight.data.shape) != shape:
            raise ValueError(f"{name} data must be an int8 {shape} matrix, got {weight.data.dtype} {tuple(weight.data.shape)}")
        if weight.absmax.dtype != torch.float32 or weight.absmax.numel() != shape[0]:
            raise ValueError(f"{name} absmax must hold one float32 scale per row ({shape[0]}), got "
                             f"{weight.absmax.dtype} {tuple(weight.absmax.shape)}")
        return
    if weight.blocksize < 2 or weight.blocksize & (weight.blocksize - 1):
        raise ValueError(f"{name} blocksize must be a power of two >= 2 (bitsandbytes' are 32 to 4096), "
                         f"got {weight.blocksize}")
    if weight.nested and (weight.scale_blocksize < 1 or weight.scale_blocksize & (weight.scale_blocksize - 1)):
        raise ValueError(f"{name} scale_blocksize must be a power of two, got {weight.scale_blocksize}")
    if weight.data.numel() * weight.data.element_size() != cdiv(n, 2):
        raise ValueError(f"{name} data must hold {cdiv(n, 2)} bytes (two 4-bit codes each) for shape {shape}, "
                         f"got {weight.data.numel() * weight.data.element_size()}")
    if weight.code.dtype != torch.float32 or weight.code.numel() != 16:
        raise ValueError(f"{name} code must be the 16 float32 values of the 4-bit type, got "
                         f"{weight.code.dtype} {tuple(weight.code.shape)}")
    blocks = cdiv(n, weight.blocksize)
    if weight.absmax.numel() != blocks:
        raise ValueError(f"{name} absmax must hold {blocks} values (one per {weight.blocksize} weights), "
                         f"got {weight.absmax.numel()}")
    if weight.nested:
        if weight.absmax.dtype != torch.uint8 or weight.scale_code.numel() != 256:
            raise ValueError(f"{name}: a double-quantised absmax is uint8 codes with a 256-value scale_code")
        if weight.scale_absmax.numel() != cdiv(blocks, weight.scale_blocksize) or weight.offset.numel() != 1:
            raise ValueError(f"{name} scale_absmax must hold {cdiv(blocks, weight.scale_blocksize)} values and "
                             "offset one")
    elif weight.absmax.dtype != torch.float32:
        raise ValueError(f"{name} absmax must be float32, got {weight.absmax.dtype}")


def dequantize(weight: QuantizedWeight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """A bitsandbytes weight as a ``(out, in)`` tensor of `dtype`, bit for bit what bitsandbytes'
    dequantisation gives (see the module docstring).

    Args:
        weight: the :class:`QuantizedWeight`.
        dtype: float16, bfloat16 or float32.
        out: a contiguous ``(out, in)`` tensor of `dtype` on the weight's device to write into
            (default: a new one).

    Returns:
        `out`. No gradient: the weight is frozen.
    """
    check_quantized("weight", weight)
    check_choice("dtype", dtype, OUTPUT_DTYPES)
    if out is None:
        out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    else:
        check_float("out", out)
        if tuple(out.shape) != tuple(weight.shape) or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {tuple(weight.shape)} {dtype} tensor, "
                             f"got {tuple(out.shape)} {out.dtype}")
        if out.device != weight.device:
            raise ValueError(f"out is on {out.device}, expected {weight.device} like the weight")
    with torch.no_grad():
        return DEQUANTIZE(None, out, weight)


_workspaces: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def dequantized(weight: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """A base weight as a tensor of `dtype` for the GEMM about to read it: a plain tensor as it
    is; a QuantizedWeight dequantised into this device's reused buffer (one per device and dtype,
    grown to the largest weight), which the next call overwrites.

    Calls run in stream order, so each GEMM reads its weight before the next dequantisation
    writes the buffer; the buffer never holds anything between ops. While a CUDA graph is being
    captured a fresh tensor is used instead, so that no buffer from the graph's private memory
    pool is kept for eager calls.
    """
    if isinstance(weight, torch.Tensor):
        return weight
    n = weight.shape[0] * weight.shape[1]
    device = weight.device
    if capturing(device):
        return DEQUANTIZE(None, torch.empty(weight.shape, dtype=dtype, device=device), weight)
    key = (device, dtype)
    buffer = _workspaces.get(key)
    if buffer is None or buffer.numel() < n:
        _workspaces.pop(key, None)  # freed before its replacement is allocated
        buffer = _workspaces[key] = torch.empty(n, dtype=dtype, device=device)
    # The op that calls this has checked the weight already; this is on its hot path.
    return DEQUANTIZE(None, buffer[:n].view(weight.shape), weight)


def release_workspaces() -> None:
    """Free the reused dequantisation buffers (they are allocated again when next needed)."""
    _workspaces.clear()
