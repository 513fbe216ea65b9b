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

On the GPU a code becomes its value without a memory access: the 16 fp32 values are immediates
of a few byte permutes (:func:`code_lookup_ptx`), built once per code tensor; the interpreter,
ROCm and a first call under CUDA graph capture gather them from the code tensor instead.

The fused GEMM pays for the dequantisation once per tile of tokens: with many tokens, dequantising
once and running cuBLAS is faster. :func:`fused_4bit` says which runs, per shape, from one table
(:data:`FUSED_TOKENS_UP_TO`, measured with ``python -m tigon.bench.gemm_4bit``): on the listed
Llama-3 shapes, up to 64-128 tokens (generation, small batches); training batches dequantise.
The first fused call at each (token bucket, shape, pass) times its candidate tiles, a few seconds;
Triton keeps the choice on disk for later processes. The fused path needs ``in`` to be a whole
number of blocks (every real model's is); other shapes dequantise.
"""

from __future__ import annotations

import struct
import weakref
from typing import Any

import torch

from tigon.ops._checks import check_input, rows_view
from tigon.ops._dispatch import INTERPRET, TRITON_IMPORT_ERROR, Op, autocast_dtype, capturing, log, tl, triton
from tigon.ops._launch import cdiv, launched, multiprocessor_count, next_power_of_2
from tigon.ops.dequantize import QuantizedWeight, block_absmax, check_quantized, dequantize_reference, dequantized

# --- Where the fused GEMM runs ------------------------------------------------------------------
# (out_features, in_features) -> (forward, input gradient): the most tokens for which the fused GEMM
# took at most 0.95x the time of dequantise + cuBLAS on that weight shape (and at every smaller
# count measured), by `python -m tigon.bench.gemm_4bit` (the "fused/tigon" ratio, graph-replayed,
# H100; BENCHMARKS.md) at 1, 16, 64, 128 and 256 tokens. 0: never. Shapes not listed take the
# default: dequantise + cuBLAS.
FUSED_TOKENS_UP_TO: dict[tuple[int, int], tuple[int, int]] = {
    (4096, 4096): (64, 64),  # Llama-3-8B q_proj / o_proj
    (14336, 4096): (128, 128),  # gate_proj / up_proj
    (4096, 14336): (128, 128),  # down_proj
    (1024, 4096): (64, 0),  # k_proj / v_proj
    (8192, 8192): (128, 128),  # Llama-3-70B q_proj / o_proj
    (28672, 8192): (128, 128),  # gate_proj / up_proj
    (8192, 28672): (128, 128),  # down_proj
    (1024, 8192): (128, 0),  # k_proj / v_proj
}
DEFAULT_FUSED_TOKENS_UP_TO = (0, 0)


def fused_4bit(tokens: int, out_features: int, in_features: int, backward: bool = False) -> bool:
    """Whether a 4-bit GEMM over `tokens` rows with an ``(out_features, in_features)`` weight runs
    the fused kernel (True) or dequantises the weight and runs cuBLAS (False); `backward` asks
    about the input gradient's GEMM rather than the forward's."""
    limits = FUSED_TOKENS_UP_TO.get((out_features, in_features), DEFAULT_FUSED_TOKENS_UP_TO)
    return tokens <= limits[backward]


# --- The code lookup in registers -----------------------------------------------------------------


def code_lookup_ptx(values: list[float]) -> str:
    """PTX for ``tl.inline_asm_elementwise(..., pack=4)`` that turns 4 packed bytes (``$8``) into
    the fp32 values of their 8 codes: the high nibbles' in ``$0..$3``, the low ones' in ``$4..$7``.

    `values` are the 16 fp32 values of the codes 0 to 15. Byte b of every value is a 16-byte
    table (4 registers as immediates); one ``prmt`` looks up 4 nibbles in 8 entries at a time,
    a second the other 8, a third picks per nibble by its top bit; a 4 × 4 byte transpose turns
    the four byte planes into four fp32 words. The values come out with their exact bits.
    """
    if len(values) != 16:
        raise ValueError(f"values must be the 16 code values of a 4-bit type, got {len(values)}")
    words = [struct.unpack("<I", struct.pack("<f", v))[0] for v in values]
    planes = [[sum(((words[4 * reg + i] >> (8 * byte)) & 0xFF) << (8 * i) for i in range(4)) for reg in range(4)]
              for byte in range(4)]
    lines = ["{", ".reg .b32 nib, pairs, sel, low8, pick, lo, hi, p0, p1, p2, p3, t0, t1, t2, t3;"]
    for first_out, shift in ((0, 4), (4, 0)):
        # The 4 nibbles into one 16-bit selector (nibble i for byte i), then the selectors
        # prmt needs: the entry within 8, and byte i of the low or the high table by bit 3.
        lines += [f"shr.b32 nib, $8, {shift};", "and.b32 nib, nib, 0x0F0F0F0F;", "shr.b32 pairs, nib, 4;",
                  "or.b32 pairs, pairs, nib;", "prmt.b32 sel, pairs, pairs, 0x0020;", "and.b32 low8, sel, 0x7777;",
                  "shr.b32 pick, sel, 1;", "and.b32 pick, pick, 0x4444;", "or.b32 pick, pick, 0x3210;"]
        for byte, table in enumerate(planes):
            lines += [f"prmt.b32 lo, {table[0]:#010x}, {table[1]:#010x}, low8;",
                      f"prmt.b32 hi, {table[2]:#010x}, {table[3]:#010x}, low8;", f"prmt.b32 p{byte}, lo, hi, pick;"]
        out = [f"${first_out + i}" for i in range(4)]
        lines += ["prmt.b32 t0, p0, p1, 0x5140;", "prmt.b32 t1, p0, p1, 0x7362;", "prmt.b32 t2, p2, p3, 0x5140;",
                  "prmt.b32 t3, p2, p3, 0x7362;", f"prmt.b32 {out[0]}, t0, t2, 0x5410;",
                  f"prmt.b32 {out[1]}, t0, t2, 0x7632;", f"prmt.b32 {out[2]}, t1, t3, 0x5410;",
                  f"prmt.b32 {out[3]}, t1, t3, 0x7632;"]
    return "\n".join(lines + ["}"])


# id(code) -> (a weak reference to it, its version counter then, its lookup's PTX)
_LOOKUPS: dict[int, tuple[weakref.ref, int, str]] = {}


def _code_lookup(code: torch.Tensor) -> str:
    """:func:`code_lookup_ptx` for a weight's code tensor, read (one sync) on its first use and kept
    while it lives unchanged; "" (the kernel gathers the values from memory) under CUDA graph
    capture before that first use, where reading it is not allowed, and on ROCm (PTX is NVIDIA's)."""
    if torch.version.hip is not None:
        return ""
    key = id(code)
    known = _LOOKUPS.get(key)
    if known is not None and known[0]() is code and known[1] == code._version:
        return known[2]
    if capturing(code.device):
        return ""
    ptx = code_lookup_ptx(code.float().tolist())
    _LOOKUPS[key] = (weakref.ref(code, lambda _, key=key: _LOOKUPS.pop(key, None)), code._version, ptx)
    return ptx


# --- Kernels --------------------------------------------------------------------------------------


@triton.jit
def _weight_halves(
    packed_ptr, code_ptr, absmax_ptr, scale_code_ptr, scale_absmax_ptr, offset_ptr,
    rows, k0, out_features, in_features,
    DTYPE: tl.constexpr, BLOCKSIZE: tl.constexpr, SCALE_BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr,
    LOOKUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``W[rows, k0 : k0 + BLOCK_K]`` in DTYPE as its even and its odd columns, two
    ``[BLOCK_N, BLOCK_K / 2]`` tiles: a byte's high nibble and its low one (k0 a multiple of
    BLOCK_K; in_features a multiple of BLOCKSIZE, so each row starts on a byte and on a block).
    The codes' values come from LOOKUP's PTX (:func:`code_lookup_ptx`), or from code_ptr where
    it is "". Rows or columns past W's are finite."""
    HALF: tl.constexpr = BLOCK_K // 2
    rows64 = rows.to(tl.int64)
    row_in = rows < out_features
    pairs = k0 // 2 + tl.arange(0, HALF)
    packed = tl.load(packed_ptr + rows64[:, None] * (in_features // 2) + pairs[None, :],
                     mask=row_in[:, None] & (pairs < in_features // 2)[None, :], other=0)
    if LOOKUP != "":
        even, odd = tl.inline_asm_elementwise(LOOKUP, "=r,=r,=r,=r,=r,=r,=r,=r,r", [packed],
                                              dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    else:
        codes = packed.to(tl.int32)
        even = tl.load(code_ptr + (codes >> 4))
        odd = tl.load(code_ptr + (codes & 15))
    blocks_per_row = in_features // BLOCKSIZE
    # A block's columns are an even count from an even one: a pair never straddles two blocks.
    if BLOCK_K > BLOCKSIZE:  # several blocks per row of the tile: one absmax per (row, block)
        GROUPS: tl.constexpr = BLOCK_K // BLOCKSIZE
        group = k0 // BLOCKSIZE + tl.arange(0, GROUPS)
        absmax = block_absmax(absmax_ptr, scale_code_ptr, scale_absmax_ptr, offset_ptr,
                              rows64[:, None] * blocks_per_row + group[None, :],
                              row_in[:, None] & (group < blocks_per_row)[None, :], SCALE_BLOCKSIZE, NESTED)
        even = tl.reshape(tl.reshape(even, (BLOCK_N, GROUPS, BLOCKSIZE // 2)) * absmax[:, :, None], (BLOCK_N, HALF))
        odd = tl.reshape(tl.reshape(odd, (BLOCK_N, GROUPS, BLOCKSIZE // 2)) * absmax[:, :, None], (BLOCK_N, HALF))
    else:  # the tile lies inside one block per row
        absmax = block_absmax(absmax_ptr, scale_code_ptr, scale_absmax_ptr, offset_ptr,
                              rows64 * blocks_per_row + k0 // BLOCKSIZE, row_in,
                              SCALE_BLOCKSIZE, NESTED)
        even = even * absmax[:, None]
        odd = odd * absmax[:, None]
    return even.to(DTYPE), odd.to(DTYPE)


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
    partial_ptr, n_tokens, out_features, in_features, stride_am, stride_ak, stride_addm, stride_om, tokens_bucket,
    BACKWARD: tl.constexpr, HAS_ADD: tl.constexpr, BLOCKSIZE: tl.constexpr, SCALE_BLOCKSIZE: tl.constexpr,
    NESTED: tl.constexpr, PRECISION: tl.constexpr, LOOKUP: tl.constexpr, SWAP: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One (token tile, output tile) of ``out = (add +) a · W[cols]ᵀ`` (forward: a is x, the tile is
    BLOCK_N out features, the loop walks in by BLOCK_K) or ``out = (add +) a · W[:, cols]`` (BACKWARD:
    a is dy, the tile is BLOCK_K in features, the loop walks out by BLOCK_N). Either way W is read
    in [BLOCK_N × BLOCK_K] tiles, as its even and odd columns. SPLIT multiplies each half by its
    own dot (forward: against a's even and odd columns; backward: into the output's), where the
    halves would otherwise be interleaved back into W's column order first. `tokens_bucket` only
    keys the autotuner.

    With several programs along the grid's second axis, each sums its own part of the reduced
    dimension (whole steps) and stores that fp32 sum in ``partial[part]`` (``[tokens, width]``
    each, contiguous) instead; the host adds the parts up."""
    # Token tiles vary fastest: the programs running at once read the same tiles of W (L2 hits).
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(n_tokens, BLOCK_M)
    tokens = (pid % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    tile = pid // m_tiles
    token_in = tokens < n_tokens
    a_rows = a_ptr + tokens.to(tl.int64)[:, None] * stride_am
    HALF: tl.constexpr = BLOCK_K // 2
    STEP: tl.constexpr = BLOCK_N if BACKWARD else BLOCK_K
    depth = out_features if BACKWARD else in_features
    WIDTH: tl.constexpr = BLOCK_K if BACKWARD else BLOCK_N
    DTYPE: tl.constexpr = a_ptr.dtype.element_ty
    if BACKWARD and SPLIT:  # the output's even and odd columns, apart until the end
        acc = tl.zeros((HALF, BLOCK_M) if SWAP else (BLOCK_M, HALF), dtype=tl.float32)
        acc_odd = tl.zeros((HALF, BLOCK_M) if SWAP else (BLOCK_M, HALF), dtype=tl.float32)
    else:
        acc = tl.zeros((WIDTH, BLOCK_M) if SWAP else (BLOCK_M, WIDTH), dtype=tl.float32)
    part, parts = tl.program_id(1), tl.num_programs(1)
    per_part = tl.cdiv(tl.cdiv(depth, STEP), parts) * STEP
    for start in range(part * per_part, tl.minimum(depth, (part + 1) * per_part), STEP):
        reduced = start + tl.arange(0, STEP)
        a = tl.load(a_rows + reduced[None, :] * stride_ak, mask=token_in[:, None] & (reduced < depth)[None, :],
                    other=0.0)
        if BACKWARD:
            even, odd = _weight_halves(packed_ptr, code_ptr, absmax_ptr, scale_code_ptr, scale_absmax_ptr,
                                       offset_ptr, reduced, tile * BLOCK_K, out_features, in_features,
                                       DTYPE, BLOCKSIZE, SCALE_BLOCKSIZE, NESTED, LOOKUP, BLOCK_N, BLOCK_K)
            if SPLIT:  # [out × in/2] halves: each multiplies dy into its own output columns
                if SWAP:
                    acc = tl.dot(tl.trans(even), tl.trans(a), acc, input_precision=PRECISION)
                    acc_odd = tl.dot(tl.trans(odd), tl.trans(a), acc_odd, input_precision=PRECISION)
                else:
                    acc = tl.dot(a, even, acc, input_precision=PRECISION)
                    acc_odd = tl.dot(a, odd, acc_odd, input_precision=PRECISION)
            else:
                w = tl.trans(tl.interleave(even, odd))  # [in, out]: what multiplies dy
                if SWAP:
                    acc = tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)
                else:
                    acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
        else:
            even, odd = _weight_halves(packed_ptr, code_ptr, absmax_ptr, scale_code_ptr, scale_absmax_ptr,
                                       offset_ptr, tile * BLOCK_N + tl.arange(0, BLOCK_N), start, out_features,
                                       in_features, DTYPE, BLOCKSIZE, SCALE_BLOCKSIZE, NESTED, LOOKUP,
                                       BLOCK_N, BLOCK_K)
            if SPLIT:  # a's even columns meet the high nibbles' values, its odd ones the low
                a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, HALF, 2)))
                if SWAP:
                    acc = tl.dot(even, tl.trans(a_even), acc, input_precision=PRECISION)
                    acc = tl.dot(odd, tl.trans(a_odd), acc, input_precision=PRECISION)
                else:
                    acc = tl.dot(a_even, tl.trans(even), acc, input_precision=PRECISION)
                    acc = tl.dot(a_odd, tl.trans(odd), acc, input_precision=PRECISION)
            else:
                w = tl.interleave(even, odd)  # [out × in], W's own column order
                if SWAP:
                    acc = tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)
                else:
                    acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    if BACKWARD and SPLIT:
        if SWAP:
            acc = tl.interleave(tl.trans(acc), tl.trans(acc_odd))
        else:
            acc = tl.interleave(acc, acc_odd)
    elif SWAP:
        acc = tl.trans(acc)
    cols = tile * WIDTH + tl.arange(0, WIDTH)
    width = in_features if BACKWARD else out_features
    if parts > 1:
        mask = token_in[:, None] & (cols < width)[None, :]
        sums = partial_ptr + part.to(tl.int64) * n_tokens * width
        tl.store(sums + tokens.to(tl.int64)[:, None] * width + cols[None, :], acc, mask=mask)
    else:
        _epilogue(acc, out_ptr, add_ptr, tokens, cols, n_tokens, width, stride_om, stride_addm, HAS_ADD)


# --- Tile configurations ---------------------------------------------------------------------------
# Swapped operands for a few tokens (the weight tile is the MMA's wide side, the tokens its narrow
# one; 16-row weight tiles give a 4096-wide weight 256 programs); plain tiles for many tokens, their
# halves split (Triton 3.6 fails to compile the interleaved plain tiles for Hopper). Only tiles
# that won some shape and token count when twice as many were timed at the 8B and 70B shapes.
# Pruned per token bucket (:func:`_prune`), then timed per (bucket, shape, layout, dtypes) on first
# use. Swapped (BLOCK_N, BLOCK_K, SPLIT, warps, stages) at each BLOCK_M; plain (BLOCK_M, BLOCK_N,
# BLOCK_K, warps, stages); every one within an H100's 227 KiB of shared memory.
_SWAPPED = [(16, 128, False, 4, 4), (16, 256, False, 4, 3), (16, 256, True, 4, 3), (64, 64, False, 4, 4),
            (64, 128, False, 4, 4), (128, 64, False, 4, 4), (128, 128, False, 8, 3)]
_PLAIN = [(128, 128, 64, 8, 3), (256, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4)]
# Under the interpreter (or without Triton) nothing is tuned: the kernels run one small tile.
CONFIGS = [] if INTERPRET or TRITON_IMPORT_ERROR is not None else [
    *(triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SWAP=True, SPLIT=split), num_warps=w, num_stages=s)
      for bm in (16, 32, 64, 128) for bn, bk, split, w, s in _SWAPPED),
    *(triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SWAP=False, SPLIT=True), num_warps=w, num_stages=s)
      for bm, bn, bk, w, s in _PLAIN),
]
_KEY = ["tokens_bucket", "out_features", "in_features", "BACKWARD", "BLOCKSIZE", "NESTED", "HAS_ADD"]
# few programs, dot's smallest sides
INTERPRETER_TILE = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SWAP=False, SPLIT=False)


def _worth_timing(tile: dict, bucket: int, blocksize: int) -> bool:
    """Up to 256 tokens, swapped tiles whose token side is the bucket (16 to 128); from 128, plain
    tiles whose token side the bucket fills. A tile narrower than a quantisation block must divide
    it (wider ones hold whole blocks)."""
    if tile["SWAP"]:
        fits = bucket <= 256 and tile["BLOCK_M"] == min(128, bucket)
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
# After a key's tuning, its calls launch the chosen tile straight to the compiled kernel: Triton's
# autotuner and JIT dispatch cost more host time per call than a few-token GEMM takes on the GPU.
_PREBOUND = launched(_gemm_4bit_kernel)
# (device, dtype and the autotuner's key values) -> the tile the autotuner chose for them
_CHOSEN: dict[tuple, "triton.Config"] = {}


def compile_tile(config: "triton.Config", backward: bool, target: Any, lookup: str = "") -> Any:
    """Compile the fused GEMM at one tile of :data:`CONFIGS` for `target` (a Triton ``GPUTarget``,
    e.g. ``GPUTarget("cuda", 90, 32)``) without a GPU or a launch: the tile a GPU's Triton cannot
    build fails here, on any machine with that Triton. Double-quantised blocks of 64, bf16
    activations; `lookup` is :func:`code_lookup_ptx`'s assembly ("" gathers the codes' values from
    memory). Returns Triton's compiled kernel; raises what Triton's compiler raises."""
    from triton.compiler import ASTSource

    pointers = dict(a_ptr="*bf16", packed_ptr="*u8", code_ptr="*fp32", absmax_ptr="*u8", scale_code_ptr="*fp32",
                    scale_absmax_ptr="*fp32", offset_ptr="*fp32", add_ptr="*bf16", out_ptr="*bf16",
                    partial_ptr="*fp32")
    constants = dict(BACKWARD=backward, HAS_ADD=False, BLOCKSIZE=64, SCALE_BLOCKSIZE=256, NESTED=True,
                     PRECISION="tf32", LOOKUP=lookup, **config.kwargs)
    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32")
                 for name in _gemm_4bit_kernel.arg_names}
    return triton.compile(ASTSource(fn=_gemm_4bit_kernel, signature=signature, constexprs=constants), target=target,
                          options=dict(num_warps=config.num_warps, num_stages=config.num_stages,
                                       enable_fp_fusion=False))


# The reduced dimension is split in parts where the output's tiles alone give fewer programs than
# two per multiprocessor (a few tokens, a narrow output), each part at least PART_MIN_STEPS loop
# steps long, at most MAX_PARTS of them, and only while their fp32 sums fit PARTIAL_LIMIT bytes.
MAX_PARTS = 8
PART_MIN_STEPS = 4
PARTIAL_LIMIT = 64 << 20


def _parts(programs: int, steps: int, device: torch.device) -> int:
    """Parts to split a reduction of `steps` loop steps into, for `programs` output tiles."""
    return max(1, min(MAX_PARTS, 2 * multiprocessor_count(device) // programs, steps // PART_MIN_STEPS))


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
    depth = out_features if backward else in_features
    out = torch.empty((tokens, width), dtype=a.dtype, device=a.device)
    may_split = MAX_PARTS * tokens * width * 4 <= PARTIAL_LIMIT
    nested = weight.nested
    # Unused pointers (of the plain layout, or a missing `add`) are bound to tensors the kernel
    # does not read.
    scale_code = weight.scale_code if nested else weight.absmax
    scale_absmax = weight.scale_absmax if nested else weight.absmax
    offset = weight.offset if nested else weight.absmax
    weights = (a, weight.data.reshape(-1).view(torch.uint8), weight.code, weight.absmax, scale_code, scale_absmax,
               offset, out if add is None else add, out)
    sizes = (tokens, out_features, in_features, a.stride(0), a.stride(1),
             out.stride(0) if add is None else add.stride(0), out.stride(0), _tokens_bucket(tokens))
    # enable_fp_fusion off: the double-quantised absmax is a multiply then an add, never one FMA.
    options = dict(BACKWARD=backward, HAS_ADD=add is not None, BLOCKSIZE=weight.blocksize,
                   SCALE_BLOCKSIZE=weight.scale_blocksize, NESTED=nested,
                   PRECISION="ieee" if a.dtype == torch.float32 else "tf32", enable_fp_fusion=False)

    def grid(meta):
        programs = cdiv(tokens, meta["BLOCK_M"]) * cdiv(width, meta["BLOCK_K" if backward else "BLOCK_N"])
        step = meta["BLOCK_N" if backward else "BLOCK_K"]
        return programs, _parts(programs, cdiv(depth, step), a.device) if may_split else 1

    def sums(parts: int) -> torch.Tensor:  # where `parts` parts store their fp32 sums (1: none do)
        return torch.empty((parts, tokens, width) if parts > 1 else (1,), dtype=torch.float32, device=a.device)

    def add_parts(partial: torch.Tensor, parts: int) -> torch.Tensor:  # with `add`, in fp32, rounded once
        if parts == 1:
            return out
        total = partial[:parts].sum(0)
        return out.copy_(total if add is None else total.add_(add))

    options["LOOKUP"] = _code_lookup(weight.code) if a.device.type == "cuda" and not INTERPRET else ""
    if _TUNED is None or a.device.type != "cuda":
        launch = grid(INTERPRETER_TILE)
        partial = sums(launch[1])
        _gemm_4bit_kernel[launch](*weights, partial, *sizes, **options, **INTERPRETER_TILE)
        return add_parts(partial, launch[1])
    key = (a.device, a.dtype, sizes[-1], out_features, in_features, backward, weight.blocksize, nested, add is not None)
    tile = _CHOSEN.get(key)
    if tile is None:  # the tiles timed may split in up to MAX_PARTS parts
        if not _CHOSEN:  # said once: the first tokens of a generation wait on it
            log.info("tigon: the fused 4-bit GEMM times its tiles at each weight shape's first use (seconds "
                     "each, unless Triton's disk cache has the choice)")
        partial = sums(MAX_PARTS if may_split else 1)
        _TUNED[grid](*weights, partial, *sizes, **options)
        tile = _CHOSEN[key] = _TUNED.best_config
        parts = grid(tile.kwargs)[1]
    else:
        launch = grid(tile.kwargs)
        parts, partial = launch[1], sums(launch[1])
        _PREBOUND[launch](*weights, partial, *sizes, **options, **tile.all_kwargs())
    return add_parts(partial, parts)


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
