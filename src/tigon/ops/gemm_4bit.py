"""GEMMs that read a bitsandbytes 4-bit weight (NF4 / FP4) straight from its packed storage.

    forward:         out = x · dequant(W)ᵀ        x (N, in),  W (out, in)
    input gradient:  dx  = dy · dequant(W)        dy (N, out)

Each program dequantises the tiles of W it multiplies in registers, exactly as
:mod:`tigon.ops.dequantize` does (the code of each nibble times its block's absmax, formed in fp32
and rounded once to the activations' dtype; a double-quantised absmax a multiply then an add), and
feeds them to the tensor cores beside the activations' tiles, accumulating in fp32. W never exists
in 16 bits: the dequantise-then-GEMM path writes and reads a weight-sized bf16 buffer per GEMM
(2 + 2 bytes per weight, against the half byte the packed codes take).

Both GEMMs load the same tile of W, ``[BLOCK_N rows (out features) × BLOCK_K columns (in)]``,
along W's rows, where every ``blocksize`` consecutive weights share one absmax. The forward
program owns a tile of out features and walks in; the input gradient's owns a tile of in features
and walks out, with the tile transposed in the dot. Each may swap its operands (``SWAP``): the
weight tile is then the left operand, so that a handful of tokens fill the MMA's narrow side
rather than its 64-row one.

The fused GEMM pays for the dequantisation once per tile of tokens: with many tokens, dequantising
once and running cuBLAS is faster. :func:`fused_4bit` says which runs, per shape, from one table
(:data:`FUSED_TOKENS_UP_TO`, measured with ``python -m tigon.bench.gemm_4bit``). The fused path
needs ``in`` to be a whole number of blocks (every real model's is); other shapes dequantise.
"""

from __future__ import annotations

import torch

from tigon.ops._checks import check_input, rows_view
from tigon.ops._dispatch import INTERPRET, TRITON_IMPORT_ERROR, Op, autocast_dtype, tl, triton
from tigon.ops._launch import cdiv, next_power_of_2
from tigon.ops.dequantize import QuantizedWeight, block_absmax, check_quantized, dequantize_reference, dequantized

# --- Where the fused GEMM runs ------------------------------------------------------------------
# (out_features, in_features) -> (forward, input gradient): the most tokens for which the fused GEMM
# beats dequantise + cuBLAS on that weight shape. Shapes not listed take the default. Measured with
# `python -m tigon.bench.gemm_4bit` (the "fused/tigon" ratio per token count). On Hopper the fused
# GEMM lost to dequantise + cuBLAS at every 8B shape from 256 to 2048 tokens (BENCHMARKS.md), so no
# shape is listed and the default sends every GEMM to cuBLAS; `tigon sft --help` (--quant) and
# README.md say so.
FUSED_TOKENS_UP_TO: dict[tuple[int, int], tuple[int, int]] = {}
DEFAULT_FUSED_TOKENS_UP_TO = (0, 0)


def fused_4bit(tokens: int, out_features: int, in_features: int, backward: bool = False) -> bool:
    """Whether a 4-bit GEMM over `tokens` rows with an ``(out_features, in_features)`` weight runs
    the fused kernel (True) or dequantises the weight and runs cuBLAS (False); `backward` asks
    about the input gradient's GEMM rather than the forward's."""
    limits = FUSED_TOKENS_UP_TO.get((out_features, in_features), DEFAULT_FUSED_TOKENS_UP_TO)
    return tokens <= limits[backward]


# --- Kernels --------------------------------------------------------------------------------------


@triton.jit
def _weight_tile(
    packed_ptr, code_ptr, absmax_ptr, scale_code_ptr, scale_absmax_ptr, offset_ptr,
    rows, k0, out_features, in_features,
    DTYPE: tl.constexpr, BLOCKSIZE: tl.constexpr, SCALE_BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``W[rows, k0 : k0 + BLOCK_K]`` in DTYPE (k0 a multiple of BLOCK_K; in_features a multiple of
    BLOCKSIZE, so each row starts on a byte and on a block). Rows or columns past W's are finite."""
    HALF: tl.constexpr = BLOCK_K // 2
    rows64 = rows.to(tl.int64)
    row_in = rows < out_features
    pairs = k0 // 2 + tl.arange(0, HALF)
    packed = tl.load(packed_ptr + rows64[:, None] * (in_features // 2) + pairs[None, :],
                     mask=row_in[:, None] & (pairs < in_features // 2)[None, :], other=0).to(tl.int32)
    # Codes come high nibble first: join + reshape interleaves them back into W's column order.
    values = tl.reshape(tl.join(tl.load(code_ptr + (packed >> 4)), tl.load(code_ptr + (packed & 15))),
                        (BLOCK_N, BLOCK_K))
    blocks_per_row = in_features // BLOCKSIZE
    if BLOCK_K > BLOCKSIZE:  # several blocks per row of the tile: one absmax per (row, block)
        GROUPS: tl.constexpr = BLOCK_K // BLOCKSIZE
        group = k0 // BLOCKSIZE + tl.arange(0, GROUPS)
        absmax = block_absmax(absmax_ptr, scale_code_ptr, scale_absmax_ptr, offset_ptr,
                              rows64[:, None] * blocks_per_row + group[None, :],
                              row_in[:, None] & (group < blocks_per_row)[None, :], SCALE_BLOCKSIZE, NESTED)
        values = tl.reshape(tl.reshape(values, (BLOCK_N, GROUPS, BLOCKSIZE)) * absmax[:, :, None], (BLOCK_N, BLOCK_K))
    else:  # the tile lies inside one block per row
        absmax = block_absmax(absmax_ptr, scale_code_ptr, scale_absmax_ptr, offset_ptr,
                              rows64 * blocks_per_row + k0 // BLOCKSIZE, row_in,
                              SCALE_BLOCKSIZE, NESTED)
        values = values * absmax[:, None]
    return values.to(DTYPE)


@triton.jit
def _epilogue(acc, out_ptr, add_ptr, rows, cols, n_rows, n_cols, stride_om, stride_am, HAS_ADD: tl.constexpr):
    """Store the fp32 tile `acc` to ``out[rows, cols]`` (unit column stride), plus ``add[rows, cols]``
    when HAS_ADD (as cuBLAS's beta = 1: the sum in fp32, rounded once)."""
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    rows64, cols64 = rows.to(tl.int64)[:, None], cols.to(tl.int64)[None, :]
    if HAS_ADD:
        acc += tl.load(add_ptr + rows64 * stride_am + cols64, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows64 * stride_om + cols64, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemm_4bit_kernel(
    a_ptr, packed_ptr, code_ptr, absmax_ptr, scale_code_ptr, scale_absmax_ptr, offset_ptr, add_ptr, out_ptr,
    n_tokens, out_features, in_features, stride_am, stride_ak, stride_addm, stride_om, tokens_bucket,
    BACKWARD: tl.constexpr, HAS_ADD: tl.constexpr, BLOCKSIZE: tl.constexpr, SCALE_BLOCKSIZE: tl.constexpr,
    NESTED: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One (token tile, output tile) of ``out = (add +) a · W[cols]ᵀ`` (forward: a is x, the tile is
    BLOCK_N out features, the loop walks in by BLOCK_K) or ``out = (add +) a · W[:, cols]`` (BACKWARD:
    a is dy, the tile is BLOCK_K in features, the loop walks out by BLOCK_N). Either way W is read
    in [BLOCK_N × BLOCK_K] tiles. `tokens_bucket` only keys the autotuner."""
    # Token tiles vary fastest: the programs running at once read the same tiles of W (L2 hits).
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(n_tokens, BLOCK_M)
    tokens = (pid % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    tile = pid // m_tiles
    token_in = tokens < n_tokens
    a_rows = a_ptr + tokens.to(tl.int64)[:, None] * stride_am
    STEP: tl.constexpr = BLOCK_N if BACKWARD else BLOCK_K
    depth = out_features if BACKWARD else in_features
    WIDTH: tl.constexpr = BLOCK_K if BACKWARD else BLOCK_N
    acc = tl.zeros((WIDTH, BLOCK_M) if SWAP else (BLOCK_M, WIDTH), dtype=tl.float32)
    for start in range(0, depth, STEP):
        reduced = start + tl.arange(0, STEP)
        a = tl.load(a_rows + reduced[None, :] * stride_ak, mask=token_in[:, None] & (reduced < depth)[None, :],
                    other=0.0)
        if BACKWARD:
            w = _weight_tile(packed_ptr, code_ptr, absmax_ptr, scale_code_ptr, scale_absmax_ptr, offset_ptr,
                             reduced, tile * BLOCK_K, out_features, in_features,
                             a_ptr.dtype.element_ty, BLOCKSIZE, SCALE_BLOCKSIZE, NESTED, BLOCK_N, BLOCK_K)
            w = tl.trans(w)  # [in, out]: what multiplies dy
        else:
            w = _weight_tile(packed_ptr, code_ptr, absmax_ptr, scale_code_ptr, scale_absmax_ptr, offset_ptr,
                             tile * BLOCK_N + tl.arange(0, BLOCK_N), start, out_features, in_features,
                             a_ptr.dtype.element_ty, BLOCKSIZE, SCALE_BLOCKSIZE, NESTED, BLOCK_N, BLOCK_K)
        # w is now [output tile × reduced]: the tile's weights against a's columns.
        if SWAP:
            acc = tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    if SWAP:
        acc = tl.trans(acc)
    _epilogue(acc, out_ptr, add_ptr, tokens, tile * WIDTH + tl.arange(0, WIDTH), n_tokens,
              in_features if BACKWARD else out_features, stride_om, stride_addm, HAS_ADD)


# --- Tile configurations ---------------------------------------------------------------------------
# Swapped operands for a few tokens (the weight tile is the MMA's 64+-row side, the tokens its
# narrow one), plain tiles for many. Pruned per token bucket (:func:`_prune`), then timed per
# (bucket, shape, layout, dtypes) on first use.
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); every one within an H100's 227 KiB of shared memory.
_SWAPPED = [(bm, bn, bk, 4, stages) for bm in (16, 32, 64)
            for bn, bk, stages in ((64, 128, 4), (128, 64, 4), (64, 256, 3), (128, 128, 3))]
_PLAIN = [(128, 128, 64, 8, 3), (256, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4)]
# Under the interpreter (or without Triton) nothing is tuned: the kernels run one small tile.
CONFIGS = [] if INTERPRET or TRITON_IMPORT_ERROR is not None else [
    triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SWAP=swap), num_warps=w, num_stages=s)
    for swap, tiles in ((True, _SWAPPED), (False, _PLAIN)) for bm, bn, bk, w, s in tiles
]
_KEY = ["tokens_bucket", "out_features", "in_features", "BACKWARD", "BLOCKSIZE", "NESTED", "HAS_ADD"]
INTERPRETER_TILE = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SWAP=False)  # few programs, dot's smallest sides


def _worth_timing(tile: dict, bucket: int, blocksize: int) -> bool:
    """Up to 128 tokens, swapped tiles whose token side is the bucket (16 to 64); from 128, plain
    tiles whose token side the bucket fills. A tile narrower than a quantisation block must divide
    it (wider ones hold whole blocks)."""
    if tile["SWAP"]:
        fits = bucket <= 128 and tile["BLOCK_M"] == min(64, bucket)
    else:
        fits = bucket >= 128 and tile["BLOCK_M"] <= bucket
    return fits and (tile["BLOCK_K"] % blocksize == 0 or blocksize % tile["BLOCK_K"] == 0)


def _prune(configs, named_args, **kwargs):
    kept = [c for c in configs if _worth_timing(c.kwargs, named_args["tokens_bucket"], kwargs["BLOCKSIZE"])]
    return kept or configs[:1]


def _tuned(kernel):
    return triton.autotune(CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _prune},
                           cache_results=True)(kernel) if CONFIGS else None


_TUNED = _tuned(_gemm_4bit_kernel)


def _tokens_bucket(tokens: int) -> int:
    """Token counts tuned apart: powers of two from 16 to 8192 (one tuning per bucket, not per count)."""
    return min(8192, max(16, next_power_of_2(tokens)))


def fused_gemm(a: torch.Tensor, weight: QuantizedWeight, backward: bool = False,
               add: torch.Tensor | None = None) -> torch.Tensor:
    """``a · Wᵀ`` (or ``a · W`` when `backward`: the input gradient), plus `add` if given, as a new
    tensor, by the fused kernel whatever :func:`fused_4bit` says (the benchmark's handle; ops go
    through :func:`base_gemm`). `a` (and `add`) 2-D with unit column stride, in one dtype;
    `weight` 4-bit with whole blocks per row (:func:`supports_fused`)."""
    out_features, in_features = weight.shape
    tokens, width = a.shape[0], in_features if backward else out_features
    out = torch.empty((tokens, width), dtype=a.dtype, device=a.device)
    nested = weight.nested
    # Unused pointers (of the plain layout, or a missing `add`) are bound to tensors the kernel
    # does not read.
    scale_code = weight.scale_code if nested else weight.absmax
    scale_absmax = weight.scale_absmax if nested else weight.absmax
    offset = weight.offset if nested else weight.absmax
    args = (a, weight.data.reshape(-1).view(torch.uint8), weight.code, weight.absmax, scale_code, scale_absmax, offset,
            out if add is None else add, out, tokens, out_features, in_features, a.stride(0), a.stride(1),
            out.stride(0) if add is None else add.stride(0), out.stride(0), _tokens_bucket(tokens))
    # enable_fp_fusion off: the double-quantised absmax is a multiply then an add, never one FMA.
    options = dict(BACKWARD=backward, HAS_ADD=add is not None, BLOCKSIZE=weight.blocksize,
                   SCALE_BLOCKSIZE=weight.scale_blocksize, NESTED=nested,
                   PRECISION="ieee" if a.dtype == torch.float32 else "tf32", enable_fp_fusion=False)

    def grid(meta):
        return (cdiv(tokens, meta["BLOCK_M"]) * cdiv(width, meta["BLOCK_K" if backward else "BLOCK_N"]),)

    if _TUNED is None or a.device.type != "cuda":
        _gemm_4bit_kernel[grid(INTERPRETER_TILE)](*args, **options, **INTERPRETER_TILE)
    else:
        _TUNED[grid](*args, **options)
    return out


def dequantized_gemm(a: torch.Tensor, weight: QuantizedWeight, backward: bool = False,
                     add: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`fused_gemm`'s result through a dequantised copy of W (the reused buffer) and cuBLAS:
    its reference (a new tensor; `add` is left as it is)."""
    base = dequantized(weight, a.dtype)
    base = base if backward else base.t()
    return torch.mm(a, base) if add is None else torch.addmm(add, a, base)


GEMM_4BIT = Op("gemm_4bit", fused_gemm, dequantized_gemm)


def supports_fused(weight: QuantizedWeight) -> bool:
    """Whether the fused kernel takes `weight`: 4-bit, its rows whole blocks."""
    return weight.kind == "4bit" and weight.shape[1] % weight.blocksize == 0


def base_gemm(a: torch.Tensor, weight: torch.Tensor | QuantizedWeight, *, backward: bool = False,
              add: torch.Tensor | None = None) -> torch.Tensor:
    """``add + a · Wᵀ`` (or ``a · W`` when `backward`: a linear's input gradient) for a base
    weight that may be quantised: a plain one by cuBLAS; a 4-bit one by the fused GEMM where
    :func:`fused_4bit` picks it (a new tensor that `add` is read into), else dequantised into the
    reused buffer for cuBLAS (accumulating in place into `add`). Use the result, not `add`,
    which it may or may not be. `a` and `add` are 2-D in one dtype, unit column stride; the
    caller has checked the weight."""
    if not isinstance(weight, torch.Tensor):
        if supports_fused(weight) and fused_4bit(a.shape[0], *weight.shape, backward=backward):
            return GEMM_4BIT(None, a, weight, backward, add)
        weight = dequantized(weight, a.dtype)
    weight = weight if backward else weight.t()
    return torch.mm(a, weight) if add is None else add.addmm_(a, weight)


# --- The public op: a 4-bit linear without bias -----------------------------------------------------


def linear_4bit_reference(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``x · dequant(W)ᵀ`` the obvious way (W dequantised to x's dtype, as bitsandbytes' own
    4-bit matmul does): the oracle and fallback."""
    return torch.nn.functional.linear(x, dequantize_reference(weight, x.dtype))


class _Linear4bitFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        out = base_gemm(rows_view(x), weight)
        ctx.weight = weight  # frozen: a parameter, not an activation; nothing else is saved
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        weight = ctx.weight
        dx = base_gemm(rows_view(grad_out), weight, backward=True)
        return dx.view(*grad_out.shape[:-1], weight.shape[1]), None


LINEAR_4BIT = Op("linear_4bit", _Linear4bitFunction.apply, linear_4bit_reference, uses_triton=False, parts=(GEMM_4BIT,))


def linear_4bit(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``x · dequant(W)ᵀ`` for a frozen bitsandbytes 4-bit weight, without writing W in 16 bits
    where the fused GEMM runs (see the module docstring for where it does).

    Args:
        x: input ``(..., in)``, float16/bfloat16/float32 (float64 runs the reference).
        weight: a 4-bit :class:`~tigon.ops.QuantizedWeight` of shape ``(out, in)`` on x's device
            (frozen: it gets no gradient).

    Returns:
        ``(..., out)`` in x's dtype (the autocast dtype under autocast); x's gradient is
        ``dy · dequant(W)``, by the same kernels.
    """
    check_input(x)
    check_quantized("weight", weight, x.device)
    if weight.kind != "4bit":
        raise ValueError("weight must be a 4-bit (NF4/FP4) QuantizedWeight, got an int8 one")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must have shape (out, {x.shape[-1]}) to match its input, got {tuple(weight.shape)}")
    dtype = autocast_dtype(x)
    if dtype is not None:
        x = x.to(dtype)
    return LINEAR_4BIT.without_autocast(dtype, None, x, weight)
