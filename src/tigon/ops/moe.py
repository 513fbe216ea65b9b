"""The routed experts of a mixture-of-experts block, forward and backward, as one op.

    moe_experts(x, idx, w, W1, W2)[t] = Σ_k w[t, k] · y_{idx[t, k]}(x[t])
    y_e(z) = W2[e] · gated(W1[e] · z)        gated(g | u) = act(g) * u

for transformers 5's 3-D expert weights: ``W1 = gate_up_proj (E, 2I, H)``, ``W2 = down_proj (E, H, I)``
(Mixtral, Qwen3-MoE, DeepSeek-V3 and the other ``@use_experts_implementation`` classes), with the
options gpt-oss needs (biases, gate/up interleaved by column, a clamped SwiGLU with ``σ(α g)`` and
``up + 1``). The router stays the model's: this op starts from its top-k indices and weights, and
the router's gradient flows back through `w`.

Transformers runs this as a Python loop over the experts (one ``nonzero`` sync, then per expert a
gather, two linears, the activation, a scale and an ``index_add_``), or with
``experts_implementation="grouped_mm"`` as a sort, a gather, two ``torch._grouped_mm`` and five
elementwise passes around them. Here, for the S = N·K (token, expert) pairs:

* **routing** on the device, without a host sync: a stable sort of the expert ids, ``searchsorted``
  for each expert's first row (int64), the inverse permutation, and for the Triton GEMMs a map from
  row tile to expert (an upper bound of tiles is launched; the spare ones exit);
* **gate/up GEMM** over each expert's rows, ``x`` gathered by token as the GEMM reads it, with the
  bias, the gated activation and the rounding of both halves in its epilogue: it writes the
  pre-activations (kept for backward) and the down projection's input ``h``;
* **down GEMM**, then one **combine** pass that, per token, sums its K rows times their routing
  weights in fp32 (deterministic: no atomics) and rounds once;
* **backward**: ``g = dy_perm · W2[e]`` with the activation's backward in its epilogue: it forms
  ``dh = w · g``, the gate/up gradients (written over the saved pre-activations), ``w · h`` for the
  down weight's gradient and ``dw = g · h`` per row (the routing weights' gradient: ``dy · y`` without
  keeping y); then ``dx_perm = d(gate|up) · W1[e]``, combined back per token; and the two grouped
  weight-gradient GEMMs, skipped for frozen weights. Saved: x (which the caller keeps anyway),
  the (S, 2I) pre-activations and index vectors; x gathered is recomputed, h is recomputed in the
  backward epilogue, y is never needed.

The GEMMs run on one of three back ends (``gemm=``): ``"triton"`` (the fused grouped GEMMs above,
also the CPU interpreter's), ``"grouped_mm"`` (``torch._grouped_mm`` for every GEMM, the gathers as
``index_select`` and the activation passes as row kernels; bf16 on Hopper, or CPU), and
``"hybrid"`` (Triton for the two GEMMs with fused epilogues, ``torch._grouped_mm`` for the plain
ones). ``"auto"`` picks by device and dtype (:data:`PREFERRED_GEMM`, set from the H200 benchmark).

LoRA on the experts (PEFT's ``target_parameters``): per projection ``(A (E, r, in), B (E, out, r),
scaling)``, ``y = z Wᵀ + s (z Aᵀ) Bᵀ`` per expert. The rank-r products are grouped GEMMs of their own;
in the Triton GEMMs the ``s (z Aᵀ) Bᵀ`` term is a second, K = r product in the same accumulator. A
frozen base weight gets no weight-gradient GEMM, which is the whole point: PEFT's own path folds the
adapters into a full-size ``W + s B A`` per forward and backpropagates a full-size gradient through it.

Expert ids ``>= E`` drop their slot (transformers' loop skips the expert-parallel sentinel ``E``);
ids must not be negative. Row indices, offsets and every ``row × stride`` are int64.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as torch_f

from tigon.ops._checks import KERNEL_DTYPES, check_choice, check_device, check_float
from tigon.ops._dispatch import Op, autocast_dtype, backward_fallback, empty_if, library_op, tl, triton
from tigon.ops._launch import cdiv, launched, next_power_of_2, row_block_config
from tigon.ops.glu import ACTIVATIONS, activate, activation_grad, activation_reference

GEMMS = ("auto", "triton", "grouped_mm", "hybrid")
# What "auto" runs for bfloat16 on a CUDA device of compute capability >= 9.0 (where
# torch._grouped_mm has its CUTLASS kernels): the back end that measured fastest in
# `tigon bench --ops moe_gemm_triton moe_gemm_grouped_mm moe_gemm_hybrid` (BENCHMARKS.md).
PREFERRED_GEMM = "grouped_mm"

_grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class GateOptions(NamedTuple):
    """The gated activation ``act(g) * (u + up_offset)`` of an expert.

    `activation` is one of :data:`tigon.ops.glu.ACTIVATIONS`; with ``"silu"``, ``act(g) = g σ(α g)``
    (`alpha`; 1 is SiLU). `limit` clamps ``g <= limit`` and ``-limit <= u <= limit`` first (None: no
    clamp). `interleaved`: gate and up are the even and odd columns of the gate/up projection
    (gpt-oss) instead of its first and second halves.
    """

    activation: str = "silu"
    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0
    interleaved: bool = False


@triton.jit
def _gated(gate, up, alpha, limit, up_offset, ACTIVATION: tl.constexpr, CLAMP: tl.constexpr):
    """``act(gate) * (up + up_offset)`` in fp32. act(α g) / α is g σ(α g) for SiLU (exactly
    act(g) for α = 1); the clamps are comparisons, so NaN passes through them."""
    if CLAMP:
        gate = tl.where(gate > limit, limit, gate)
        up = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up))
    return activate(gate * alpha, ACTIVATION) / alpha * (up + up_offset)


@triton.jit
def _gated_backward(grad, gate, up, alpha, limit, up_offset, ACTIVATION: tl.constexpr, CLAMP: tl.constexpr):
    """(d gate, d up, the forward's output) for the output gradient `grad`; a clamped element
    gets no gradient, as in torch.clamp's backward."""
    gate_c = gate
    up_c = up
    if CLAMP:
        gate_c = tl.where(gate > limit, limit, gate)
        up_c = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up))
    act = activate(gate_c * alpha, ACTIVATION) / alpha
    up_term = up_c + up_offset
    grad_gate = grad * up_term * activation_grad(gate_c * alpha, ACTIVATION)
    grad_up = grad * act
    if CLAMP:
        grad_gate = tl.where(gate <= limit, grad_gate, 0.0)
        grad_up = tl.where((up >= -limit) & (up <= limit), grad_up, 0.0)
    return grad_gate, grad_up, act * up_term


@triton.jit
def _gate_columns(cols, inter, INTERLEAVED: tl.constexpr):
    """Columns of the gate and up halves of a (rows, 2I) gate/up tensor for h's columns `cols`."""
    first = cols
    second = cols + inter
    if INTERLEAVED:
        first = 2 * cols
        second = 2 * cols + 1
    return first, second


@launched
@triton.jit
def _gmm_rows_kernel(
    a_ptr, a_rows_ptr, b_ptr, a2_ptr, b2_ptr, out_ptr, gu_ptr, bias_ptr,
    weights_ptr, order_ptr, partial_ptr,
    tile_expert_ptr, tile_row_ptr, offsets_ptr,
    n_experts, n_cols, k_dim, k2_dim, inter, n_rows, scale, lora_scale, alpha, limit, up_offset,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk,
    stride_a2m, stride_a2k, stride_b2e, stride_b2n, stride_b2k,
    stride_om, stride_gum, stride_bias_e,
    GATHER: tl.constexpr, HAS_LORA: tl.constexpr, EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, CLAMP: tl.constexpr, INTERLEAVED: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One (row tile, column tile) of ``out[r] = scale · a[src(r)] · b[e]ᵀ (+ lora_scale · a2[r] · b2[e]ᵀ)``
    over the rows r of expert e, src(r) = a_rows[r] when gathering; b is (E, N, K) by strides.

    EPILOGUE is "plain" (store out), "gate_up" or "down_backward": strings, as ACTIVATION is, since
    compiled code may read a module-level name only when it is a tl.constexpr.
    "gate_up": N is I; the tile computes both halves (b's gate and up rows), adds the bias, stores
    both rounded pre-activations to gu and the gated activation to out. "down_backward": the tile is
    g = dy_perm · W2[e]; with w the row's routing weight, it stores d(gate|up) of ``w g`` over gu,
    ``w h`` to out and ``Σ g h`` over its columns to partial[column tile, r].
    """
    # Column tiles vary fastest: the programs running at once share their rows of `a` in L2.
    pid = tl.program_id(0)
    n_col_tiles = tl.cdiv(n_cols, BLOCK_N)
    pid_m = pid // n_col_tiles
    pid_n = pid % n_col_tiles
    expert = tl.load(tile_expert_ptr + pid_m)
    if expert >= n_experts:
        return
    rows = tl.load(tile_row_ptr + pid_m) + tl.arange(0, BLOCK_M)
    row_mask = rows < tl.load(offsets_ptr + expert + 1)
    src = rows
    if GATHER:
        src = tl.load(a_rows_ptr + rows, mask=row_mask, other=0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    gate_cols, up_cols = _gate_columns(cols, inter, INTERLEAVED)
    b_cols = cols  # b's rows this tile reads: the gate half's, with the up half's second
    if EPILOGUE == "gate_up":
        b_cols = gate_cols
    expert = expert.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_base = b_ptr + expert * stride_be
    for k0 in range(0, k_dim, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < k_dim
        a = tl.load(a_ptr + src[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & col_mask[None, :]
        b = tl.load(b_base + b_cols[None, :] * stride_bn + ks[:, None] * stride_bk, mask=b_mask, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if EPILOGUE == "gate_up":
            b = tl.load(b_base + up_cols[None, :] * stride_bn + ks[:, None] * stride_bk, mask=b_mask, other=0.0)
            acc_up = tl.dot(a, b, acc_up, input_precision=PRECISION)
    acc = acc * scale
    acc_up = acc_up * scale
    if HAS_LORA:
        lora = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        lora_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        b2_base = b2_ptr + expert * stride_b2e
        for k0 in range(0, k2_dim, BLOCK_K):
            ks = k0 + offs_k
            k_mask = ks < k2_dim
            a = tl.load(a2_ptr + rows[:, None] * stride_a2m + ks[None, :] * stride_a2k,
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b_mask = k_mask[:, None] & col_mask[None, :]
            b = tl.load(b2_base + b_cols[None, :] * stride_b2n + ks[:, None] * stride_b2k, mask=b_mask, other=0.0)
            lora = tl.dot(a, b, lora, input_precision=PRECISION)
            if EPILOGUE == "gate_up":
                b = tl.load(b2_base + up_cols[None, :] * stride_b2n + ks[:, None] * stride_b2k, mask=b_mask, other=0.0)
                lora_up = tl.dot(a, b, lora_up, input_precision=PRECISION)
        acc += lora_scale * lora
        acc_up += lora_scale * lora_up

    mask = row_mask[:, None] & col_mask[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    dtype = out_ptr.dtype.element_ty
    if EPILOGUE == "plain":
        tl.store(out_ptrs, acc.to(dtype), mask=mask)
    else:
        gate_ptrs = gu_ptr + rows[:, None] * stride_gum + gate_cols[None, :]
        up_ptrs = gu_ptr + rows[:, None] * stride_gum + up_cols[None, :]
        if EPILOGUE == "gate_up":
            if HAS_BIAS:
                bias = bias_ptr + expert * stride_bias_e
                acc += tl.load(bias + gate_cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                acc_up += tl.load(bias + up_cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            # h from the rounded pre-activations, which is what backward recomputes it from.
            gate = acc.to(dtype)
            up = acc_up.to(dtype)
            tl.store(gate_ptrs, gate, mask=mask)
            tl.store(up_ptrs, up, mask=mask)
            h = _gated(gate.to(tl.float32), up.to(tl.float32), alpha, limit, up_offset, ACTIVATION, CLAMP)
            tl.store(out_ptrs, h.to(dtype), mask=mask)
        else:
            slots = tl.load(order_ptr + rows, mask=row_mask, other=0)
            w = tl.load(weights_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)[:, None]
            gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(up_ptrs, mask=mask, other=0.0).to(tl.float32)
            grad_gate, grad_up, h = _gated_backward(w * acc, gate, up, alpha, limit, up_offset, ACTIVATION, CLAMP)
            tl.store(gate_ptrs, grad_gate.to(dtype), mask=mask)
            tl.store(up_ptrs, grad_up.to(dtype), mask=mask)
            tl.store(out_ptrs, (w * h).to(dtype), mask=mask)
            tl.store(partial_ptr + pid_n.to(tl.int64) * n_rows + rows, tl.sum(tl.where(mask, acc * h, 0.0), axis=1), mask=row_mask)


@launched
@triton.jit
def _gmm_weights_kernel(
    a_ptr, a_rows_ptr, b_ptr, b_rows_ptr, out_ptr, offsets_ptr,
    m_dim, n_dim, scale,
    stride_ar, stride_am, stride_br, stride_bn, stride_oe, stride_om, stride_on,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One (M, N) tile of ``out[e] = scale · Σ_{r of e} a[src_a(r)]ᵀ b[src_b(r)]``: a weight gradient,
    reduced over the expert's rows. An expert with no rows gets zeros."""
    # One expert's tiles run together: its rows of `a` and `b` stay in L2 while they are read.
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(n_dim, BLOCK_N)
    per_expert = tl.cdiv(m_dim, BLOCK_M) * n_tiles
    expert = (pid // per_expert).to(tl.int64)
    pid = pid % per_expert
    ms = (pid // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = ms < m_dim
    n_mask = ns < n_dim
    start = tl.load(offsets_ptr + expert)
    end = tl.load(offsets_ptr + expert + 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        rs = r0 + tl.arange(0, BLOCK_K)
        r_mask = rs < end
        src_a = rs
        if GATHER_A:
            src_a = tl.load(a_rows_ptr + rs, mask=r_mask, other=0)
        src_b = rs
        if GATHER_B:
            src_b = tl.load(b_rows_ptr + rs, mask=r_mask, other=0)
        a = tl.load(a_ptr + src_a[None, :] * stride_ar + ms[:, None] * stride_am,
                    mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        b = tl.load(b_ptr + src_b[:, None] * stride_br + ns[None, :] * stride_bn,
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(out_ptr + expert * stride_oe + ms[:, None] * stride_om + ns[None, :] * stride_on,
             (acc * scale).to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@launched
@triton.jit
def _gate_fwd_kernel(
    gu_ptr, h_ptr, bias_ptr, experts_ptr, offsets_ptr,
    n_experts, inter, stride_gu, stride_h, stride_bias_e, alpha, limit, up_offset,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, CLAMP: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    """The gate/up GEMM's epilogue as a pass of its own (for torch's grouped GEMM): h from gu, and
    the bias added to gu first (written back, so backward sees the biased pre-activations)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < tl.load(offsets_ptr + n_experts)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = row_mask[:, None] & (cols < inter)[None, :]
    first, second = _gate_columns(cols, inter, INTERLEAVED)
    gate_ptrs = gu_ptr + rows[:, None] * stride_gu + first[None, :]
    up_ptrs = gu_ptr + rows[:, None] * stride_gu + second[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0)
    up = tl.load(up_ptrs, mask=mask, other=0.0)
    if HAS_BIAS:
        experts = tl.load(experts_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        bias = bias_ptr + experts[:, None] * stride_bias_e
        gate = (gate.to(tl.float32) + tl.load(bias + first[None, :], mask=mask, other=0.0).to(tl.float32)).to(gate.dtype)
        up = (up.to(tl.float32) + tl.load(bias + second[None, :], mask=mask, other=0.0).to(tl.float32)).to(up.dtype)
        tl.store(gate_ptrs, gate, mask=mask)
        tl.store(up_ptrs, up, mask=mask)
    h = _gated(gate.to(tl.float32), up.to(tl.float32), alpha, limit, up_offset, ACTIVATION, CLAMP)
    tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], h, mask=mask)


@launched
@triton.jit
def _gate_bwd_kernel(
    g_ptr, gu_ptr, weights_ptr, order_ptr, offsets_ptr, partial_ptr,
    n_experts, inter, stride_g, stride_gu, alpha, limit, up_offset,
    ACTIVATION: tl.constexpr, CLAMP: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    """The down-backward GEMM's epilogue as a pass of its own, whole rows per program: over g it
    writes ``w h``, over gu the gradients of gate and up, and ``Σ g h`` to partial[row]."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < tl.load(offsets_ptr + n_experts)
    slots = tl.load(order_ptr + rows, mask=row_mask, other=0)
    w = tl.load(weights_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    total = tl.zeros((BLOCK_ROWS, BLOCK), dtype=tl.float32)
    for c0 in range(0, inter, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = row_mask[:, None] & (cols < inter)[None, :]
        first, second = _gate_columns(cols, inter, INTERLEAVED)
        g_ptrs = g_ptr + rows[:, None] * stride_g + cols[None, :]
        gate_ptrs = gu_ptr + rows[:, None] * stride_gu + first[None, :]
        up_ptrs = gu_ptr + rows[:, None] * stride_gu + second[None, :]
        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(up_ptrs, mask=mask, other=0.0).to(tl.float32)
        grad_gate, grad_up, h = _gated_backward(w * g, gate, up, alpha, limit, up_offset, ACTIVATION, CLAMP)
        tl.store(gate_ptrs, grad_gate, mask=mask)
        tl.store(up_ptrs, grad_up, mask=mask)
        tl.store(g_ptrs, w * h, mask=mask)
        total += tl.where(mask, g * h, 0.0)
    tl.store(partial_ptr + rows, tl.sum(total, axis=1), mask=row_mask)


@launched
@triton.jit
def _combine_kernel(
    src_ptr, pos_ptr, index_ptr, weights_ptr, bias_ptr, out_ptr,
    n_tokens, n_cols, top_k, n_experts, stride_src, stride_out, stride_bias_e,
    HAS_WEIGHTS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    """``out[t] = Σ_k w[t, k] · (src[pos[t, k]] + bias[e])`` in fp32, over the slots whose expert
    id is < E (dropped slots are skipped, not multiplied by zero, so their rows may hold anything)."""
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    token_mask = tokens < n_tokens
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = token_mask[:, None] & (cols < n_cols)[None, :]
    acc = tl.zeros((BLOCK_ROWS, BLOCK), dtype=tl.float32)
    for k in range(0, top_k):
        slots = tokens * top_k + k
        experts = tl.load(index_ptr + slots, mask=token_mask, other=0)
        rows = tl.load(pos_ptr + slots, mask=token_mask, other=0)
        value = tl.load(src_ptr + rows[:, None] * stride_src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            bias = bias_ptr + tl.minimum(experts, n_experts - 1).to(tl.int64)[:, None] * stride_bias_e
            value += tl.load(bias + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            value = value * tl.load(weights_ptr + slots, mask=token_mask, other=0.0).to(tl.float32)[:, None]
        acc += tl.where((experts < n_experts)[:, None], value, 0.0)
    tl.store(out_ptr + tokens[:, None] * stride_out + cols[None, :], acc, mask=mask)


@launched
@triton.jit
def _segment_sum_kernel(
    src_ptr, rows_ptr, weights_ptr, order_ptr, offsets_ptr, out_ptr,
    n_cols, stride_src, stride_out,
    GATHER: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``out[e] = Σ_{r of e} w(r) · src[src_row(r)]``: a bias gradient per expert."""
    expert = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    end = tl.load(offsets_ptr + expert + 1)
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for r0 in range(tl.load(offsets_ptr + expert), end, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        r_mask = rs < end
        src = rs
        if GATHER:
            src = tl.load(rows_ptr + rs, mask=r_mask, other=0)
        mask = r_mask[:, None] & col_mask[None, :]
        value = tl.load(src_ptr + src[:, None] * stride_src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            slots = tl.load(order_ptr + rs, mask=r_mask, other=0)
            value = value * tl.load(weights_ptr + slots, mask=r_mask, other=0.0).to(tl.float32)[:, None]
        acc += tl.sum(value, axis=0)
    tl.store(out_ptr + expert * stride_out + cols, acc, mask=col_mask)


# ----------------------------------------------------------------------------------------------
# Reference


def gate_reference(gate: torch.Tensor, up: torch.Tensor, options: GateOptions) -> torch.Tensor:
    """``act(g) * (u + up_offset)`` as the models write it (gpt-oss: ``g * sigmoid(g * alpha)``)."""
    if options.limit is not None:
        gate = gate.clamp(max=options.limit)
        up = up.clamp(min=-options.limit, max=options.limit)
    if options.activation == "silu" and options.alpha != 1.0:
        act = gate * torch.sigmoid(gate * options.alpha)
    else:
        act = activation_reference(gate, options.activation)
    return act * (up + options.up_offset) if options.up_offset else act * up


def _expert_linear(z, weight, bias, lora_a, lora_b, scaling):
    out = torch_f.linear(z, weight, bias)
    if lora_a is not None:
        out = out + scaling * torch_f.linear(torch_f.linear(z, lora_a.to(z.dtype)), lora_b.to(z.dtype))
    return out


class _Config(NamedTuple):
    """The op's non-tensor arguments, passed through dispatch and autograd as one value."""

    gate: GateOptions
    gate_up_scaling: float
    down_scaling: float
    gemm: str


def moe_experts_reference(
    hidden, top_k_index, top_k_weights, gate_up_weight, down_weight, gate_up_bias, down_bias,
    gate_up_lora_a, gate_up_lora_b, down_lora_a, down_lora_b, config: _Config,
) -> torch.Tensor:
    """The experts as transformers' loop computes them, one expert at a time (a host sync per
    expert; fp32 accumulation for half-precision inputs): the oracle and the fallback."""
    options = config.gate
    acc_dtype = torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.dtype
    out = torch.zeros(hidden.shape, dtype=acc_dtype, device=hidden.device)
    for expert in range(gate_up_weight.shape[0]):
        token, k = torch.where(top_k_index == expert)
        z = hidden[token]
        gu = _expert_linear(
            z, gate_up_weight[expert], None if gate_up_bias is None else gate_up_bias[expert],
            None if gate_up_lora_a is None else gate_up_lora_a[expert],
            None if gate_up_lora_b is None else gate_up_lora_b[expert], config.gate_up_scaling,
        )
        gate, up = (gu[:, 0::2], gu[:, 1::2]) if options.interleaved else gu.chunk(2, dim=-1)
        y = _expert_linear(
            gate_reference(gate, up, options), down_weight[expert],
            None if down_bias is None else down_bias[expert],
            None if down_lora_a is None else down_lora_a[expert],
            None if down_lora_b is None else down_lora_b[expert], config.down_scaling,
        )
        out = out.index_add(0, token, (y * top_k_weights[token, k, None]).to(acc_dtype))
    return out.to(hidden.dtype)


# ----------------------------------------------------------------------------------------------
# Routing and the grouped GEMMs


class _Routing(NamedTuple):
    """Where each (token, expert) slot goes, all on the device. Rows are the slots sorted by
    expert; slot t·K + k is token t's k-th choice."""

    index: torch.Tensor  # (S,) the expert id of each slot
    weights: torch.Tensor  # (S,) the routing weight of each slot
    order: torch.Tensor  # (S,) int64: the slot of each row
    token: torch.Tensor  # (S,) int64: the token of each row
    pos: torch.Tensor  # (S,) int64: the row of each slot
    offsets: torch.Tensor  # (E + 1,) int64: each expert's first row; offsets[E] = rows routed
    ends32: torch.Tensor | None  # (E,) int32 row ends, for torch._grouped_mm
    tile_expert: torch.Tensor | None  # (tiles,) the expert of each row tile (E: spare tile)
    tile_row: torch.Tensor | None  # (tiles,) int64: the first row of each tile
    block_m: int


def _route(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, n_experts: int, block_m: int | None,
           torch_gemm: bool) -> _Routing:
    index = top_k_index.reshape(-1)
    n_slots = index.numel()
    sorted_ids, order = torch.sort(index, stable=True)
    device = index.device
    offsets = torch.searchsorted(sorted_ids, torch.arange(n_experts + 1, device=device, dtype=sorted_ids.dtype))
    slots = torch.arange(n_slots, device=device)
    pos = torch.empty_like(order).scatter_(0, order, slots)
    tile_expert = tile_row = None
    if block_m is not None:
        counts = offsets[1:] - offsets[:-1]
        tiles = (counts + block_m - 1) // block_m
        tile_end = torch.cumsum(tiles, 0)
        # Each expert's last tile may be partial: at most one spare tile per expert with rows.
        ids = torch.arange(cdiv(n_slots, block_m) + min(n_experts, n_slots), device=device)
        tile_expert = torch.searchsorted(tile_end, ids, right=True)
        expert = tile_expert.clamp(max=n_experts - 1)
        tile_row = offsets[expert] + (ids - (tile_end - tiles)[expert]) * block_m
    return _Routing(
        index, top_k_weights.reshape(-1), order, order // top_k_index.shape[1], pos, offsets,
        offsets[1:].to(torch.int32) if torch_gemm else None, tile_expert, tile_row, block_m or 0,
    )


def _precision(dtype: torch.dtype) -> str:
    # fp32 GEMMs in full precision, as torch.matmul computes them by default (not TF32).
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_k(k_dim: int, dtype: torch.dtype) -> int:
    # 64 deep for 16-bit operands; 32 for fp32, whose tiles take twice the shared memory per stage.
    return min(64 if dtype.itemsize <= 2 else 32, max(16, next_power_of_2(k_dim)))


def _rows_config(n_cols: int, k_dim: int, epilogue: str, dtype: torch.dtype,
                 device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of the row-grouped GEMM; BLOCK_M is the routing's."""
    if device.type != "cuda":  # the interpreter: few, large programs
        return 64, 64, 4, 1
    # The gated epilogues hold two tiles of the accumulator's size (the up half's accumulator, or
    # the loaded gate and up): half as many columns per tile keeps them in registers.
    widest = 128 if epilogue == "plain" else 64
    return min(widest, max(16, next_power_of_2(n_cols))), _block_k(k_dim, dtype), 8, 3


def _weights_config(m_dim: int, n_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K (rows per step), num_warps, num_stages) of the weight-gradient GEMM."""
    if device.type != "cuda":
        return 64, 64, 64, 4, 1
    return (min(128, max(16, next_power_of_2(m_dim))), min(128, max(16, next_power_of_2(n_dim))),
            _block_k(64, dtype), 8, 3)


def _row_blocks(n_cols: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK, num_warps) of the row passes: columns in blocks of at most 2048."""
    if device.type != "cuda":  # the interpreter: few, large programs
        return 64, min(256, next_power_of_2(n_cols)), 4
    return row_block_config(min(n_cols, 2048))


def _gate_scalars(options: GateOptions) -> tuple[float, float, float]:
    """The kernels' (alpha, limit, up_offset); limit is unused without a clamp."""
    return options.alpha, 0.0 if options.limit is None else options.limit, options.up_offset


def _block_m(device: torch.device) -> int:
    return 128 if device.type == "cuda" else 64


class _Lora(NamedTuple):
    """A rank-r term ``scale · a2 · b2[e]ᵀ`` added to a row-grouped GEMM; a2 is (S, r) in row order."""

    a2: torch.Tensor
    b2: torch.Tensor  # (E, N, r) by strides
    scale: float


def _triton_rows(a, b, routing, *, gather, lora=None, scale=1.0, epilogue="plain", gu=None, bias=None,
                 partial=None, options=GateOptions()):
    """`out` (S, N) of the row-grouped GEMM kernel (see its docstring); b is (E, N, K) by strides,
    N = I for the gated epilogues."""
    n_rows = routing.order.numel()
    n_cols = b.shape[1] if epilogue == "plain" else gu.shape[1] // 2
    k_dim = b.shape[2]
    out = torch.empty((n_rows, n_cols), dtype=a.dtype, device=a.device)
    block_n, block_k, warps, stages = _rows_config(n_cols, k_dim, epilogue, a.dtype, a.device)
    a2, b2, lora_scale = lora if lora is not None else (a, b, 0.0)
    gu_, bias_ = gu if gu is not None else out, bias if bias is not None else out
    partial_ = partial if partial is not None else out
    grid = (routing.tile_expert.numel() * cdiv(n_cols, block_n),)
    _gmm_rows_kernel[grid](
        a, routing.token, b, a2, b2, out, gu_, bias_,
        routing.weights, routing.order, partial_,
        routing.tile_expert, routing.tile_row, routing.offsets,
        b.shape[0], n_cols, k_dim, a2.shape[1], n_cols, n_rows, scale, lora_scale, *_gate_scalars(options),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
        a2.stride(0), a2.stride(1), b2.stride(0), b2.stride(1), b2.stride(2),
        out.stride(0), gu_.stride(0), bias_.stride(0),
        GATHER=gather, HAS_LORA=lora is not None, EPILOGUE=epilogue, HAS_BIAS=bias is not None,
        ACTIVATION=options.activation, CLAMP=options.limit is not None, INTERLEAVED=options.interleaved,
        PRECISION=_precision(a.dtype), BLOCK_M=routing.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )
    return out


def _weight_grad_buffer(like: torch.Tensor) -> torch.Tensor:
    """An uninitialised gradient laid out like the parameter (transposed storage stays transposed)."""
    return torch.empty_like(like, memory_format=torch.preserve_format)


def _triton_weights(a, b, routing, like, *, gather_a=False, gather_b=False, scale=1.0):
    """``out[e] = scale · a[rows of e]ᵀ b[rows of e]``, (E, a's width, b's width), shaped like `like`."""
    out = _weight_grad_buffer(like)
    m_dim, n_dim = a.shape[1], b.shape[1]
    block_m, block_n, block_k, warps, stages = _weights_config(m_dim, n_dim, a.dtype, a.device)
    grid = (out.shape[0] * cdiv(m_dim, block_m) * cdiv(n_dim, block_n),)
    _gmm_weights_kernel[grid](
        a, routing.token, b, routing.token, out, routing.offsets, m_dim, n_dim, scale,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1), out.stride(2),
        GATHER_A=gather_a, GATHER_B=gather_b, PRECISION=_precision(a.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )
    return out


def _torch_rows(a, b, routing, lora=None, scale=1.0):
    """`a` (S, K, already in row order) times each row's expert's ``b[e]ᵀ`` by torch's grouped GEMM.
    Rows past the routed ones are left as the GEMM leaves them (uninitialised)."""
    out = _grouped_mm(a, b.transpose(-2, -1), offs=routing.ends32)
    if scale != 1.0:
        out.mul_(scale)
    if lora is not None:
        out.add_(_grouped_mm(lora.a2, lora.b2.transpose(-2, -1), offs=routing.ends32), alpha=lora.scale)
    return out


def _torch_weights(a, b, routing, like, scale=1.0):
    """``scale · a[rows of e]ᵀ b[rows of e]`` per expert by torch's grouped GEMM, laid out like `like`."""
    if like.stride(-2) == 1 and like.stride(-1) != 1:  # transposed storage: compute the transpose
        out = _grouped_mm(b.t(), a, offs=routing.ends32).transpose(-2, -1)
    else:
        out = _grouped_mm(a.t(), b, offs=routing.ends32)
    if out.is_cuda and torch.cuda.get_device_capability(out.device)[0] != 9:
        # Off Hopper, torch's grouped GEMM has left an expert without rows uninitialised
        # (pytorch/pytorch#172439); on Hopper it writes zeros.
        empty = (routing.offsets[1:] == routing.offsets[:-1]).view(-1, 1, 1)
        out = out.masked_fill_(empty, 0)
    return out.mul_(scale) if scale != 1.0 else out


class _TritonGemms:
    """Every GEMM a Triton grouped GEMM; the gathers and the activation live in the GEMMs."""

    gathers_in_gemm = True
    torch_gemm = False

    def rows(self, a, b, routing, *, gather, lora=None, scale=1.0):
        return _triton_rows(a, b, routing, gather=gather, lora=lora, scale=scale)

    def weights(self, a, b, routing, like, *, gather_a=False, gather_b=False, scale=1.0):
        return _triton_weights(a, b, routing, like, gather_a=gather_a, gather_b=gather_b, scale=scale)

    def gate_up(self, x, weight, bias, lora, routing, options):
        """(gu, h): the (S, 2I) pre-activations and the (S, I) gated activation."""
        gu = torch.empty((routing.order.numel(), weight.shape[1]), dtype=x.dtype, device=x.device)
        h = _triton_rows(x, weight, routing, gather=self.gathers_in_gemm, lora=lora, epilogue="gate_up",
                         gu=gu, bias=bias, options=options)
        return gu, h

    def down_backward(self, dy, weight_t, lora, gu, routing, options):
        """(w h, Σ g h per row) for g = dy_perm W2[e] (+ LoRA); d(gate|up) overwrites gu."""
        n_cols = gu.shape[1] // 2
        block_n = _rows_config(n_cols, weight_t.shape[2], "down_backward", gu.dtype, gu.device)[0]
        partial = torch.empty((cdiv(n_cols, block_n), gu.shape[0]), dtype=torch.float32, device=gu.device)
        wh = _triton_rows(dy, weight_t, routing, gather=self.gathers_in_gemm, lora=lora, epilogue="down_backward",
                          gu=gu, partial=partial, options=options)
        return wh, partial.sum(0)


class _TorchGemms(_TritonGemms):
    """Every GEMM torch's grouped GEMM; gathers as index_select, the activation as row passes."""

    gathers_in_gemm = False
    torch_gemm = True

    def rows(self, a, b, routing, *, gather, lora=None, scale=1.0):
        return _torch_rows(a.index_select(0, routing.token) if gather else a, b, routing, lora, scale)

    def weights(self, a, b, routing, like, *, gather_a=False, gather_b=False, scale=1.0):
        a = a.index_select(0, routing.token) if gather_a else a
        b = b.index_select(0, routing.token) if gather_b else b
        return _torch_weights(a, b, routing, like, scale)

    def gate_up(self, x, weight, bias, lora, routing, options):
        gu = _torch_rows(x, weight, routing, lora)
        inter = gu.shape[1] // 2
        h = torch.empty((gu.shape[0], inter), dtype=gu.dtype, device=gu.device)
        block_rows, block, warps = _row_blocks(inter, gu.device)
        _gate_fwd_kernel[(cdiv(gu.shape[0], block_rows), cdiv(inter, block))](
            gu, h, bias if bias is not None else gu, routing.index[routing.order] if bias is not None else gu,
            routing.offsets,
            weight.shape[0], inter, gu.stride(0), h.stride(0), bias.stride(0) if bias is not None else 0,
            *_gate_scalars(options),
            HAS_BIAS=bias is not None, ACTIVATION=options.activation, CLAMP=options.limit is not None,
            INTERLEAVED=options.interleaved, BLOCK_ROWS=block_rows, BLOCK=block, num_warps=warps,
        )
        return gu, h

    def down_backward(self, dy, weight_t, lora, gu, routing, options):
        g = _torch_rows(dy, weight_t, routing, lora)
        inter = g.shape[1]
        partial = torch.empty(g.shape[0], dtype=torch.float32, device=g.device)
        block_rows, block, warps = _row_blocks(inter, g.device)
        _gate_bwd_kernel[(cdiv(g.shape[0], block_rows),)](
            g, gu, routing.weights, routing.order, routing.offsets, partial,
            weight_t.shape[0], inter, g.stride(0), gu.stride(0), *_gate_scalars(options),
            ACTIVATION=options.activation, CLAMP=options.limit is not None, INTERLEAVED=options.interleaved,
            BLOCK_ROWS=block_rows, BLOCK=block, num_warps=warps,
        )
        return g, partial


class _HybridGemms(_TorchGemms):
    """Triton's grouped GEMMs where they carry an epilogue (gate/up, down backward), torch's for
    the plain ones."""

    gathers_in_gemm = True
    gate_up = _TritonGemms.gate_up
    down_backward = _TritonGemms.down_backward


_GEMMS = {"triton": _TritonGemms(), "grouped_mm": _TorchGemms(), "hybrid": _HybridGemms()}


def _combine(src, routing, top_k, *, weighted, bias=None):
    """(N, width): each token's K rows of `src` summed (times their routing weights, plus the
    expert's bias), dropped slots skipped."""
    n_tokens = routing.index.numel() // top_k
    width = src.shape[1]
    out = torch.empty((n_tokens, width), dtype=src.dtype, device=src.device)
    block_rows, block, warps = _row_blocks(width, src.device)
    _combine_kernel[(cdiv(n_tokens, block_rows), cdiv(width, block))](
        src, routing.pos, routing.index, routing.weights, bias if bias is not None else src, out,
        n_tokens, width, top_k, routing.offsets.numel() - 1, src.stride(0), out.stride(0),
        bias.stride(0) if bias is not None else 0,
        HAS_WEIGHTS=weighted, HAS_BIAS=bias is not None, BLOCK_ROWS=block_rows, BLOCK=block, num_warps=warps,
    )
    return out


def _segment_sum(src, routing, like, *, gather, weighted):
    """(E, width) in `like`'s dtype: per expert, the sum of its rows of `src` (gathered by token,
    times the routing weights)."""
    width = src.shape[1]
    out = torch.empty(like.shape, dtype=torch.float32, device=src.device)
    block_c = min(256, next_power_of_2(width))
    _segment_sum_kernel[(like.shape[0], cdiv(width, block_c))](
        src, routing.token, routing.weights, routing.order, routing.offsets, out, width,
        src.stride(0), out.stride(0), GATHER=gather, HAS_WEIGHTS=weighted, BLOCK_R=32, BLOCK_C=block_c,
    )
    return out.to(like.dtype)


def _lora_or_none(a, b, scale):
    return None if a is None else _Lora(a, b, scale)


def _reference_point(ctx, saved):
    hidden, _, _, _, w1, w2, b1, b2, *adapters = saved[:12]
    index, weights = saved[12:14]
    # The adapters in their own dtypes: the reference casts them as the op does, so their
    # gradients come back in those dtypes.
    adapters = [None if t is None else t.to(dtype) for t, dtype in zip(adapters, ctx.adapter_dtypes)]
    inputs = (hidden, index.view(-1, ctx.top_k), weights.view(-1, ctx.top_k), w1, w2, b1, b2, *adapters, ctx.config)
    return MOE_EXPERTS, moe_experts_reference, inputs


def _routing_block_m(gemm: str, device: torch.device) -> int | None:
    """Rows per tile of the Triton grouped GEMMs (which route by tile), None when none runs."""
    return None if gemm == "grouped_mm" else _block_m(device)


def _forward(hidden, top_k_index, top_k_weights, w1, w2, b1, b2, a1, l1, a2, l2, config):
    """(out, gu, xa, ha, routing): the output and what backward needs; adapters in hidden's dtype, dense."""
    gemms = _GEMMS[config.gemm]
    options = config.gate
    routing = _route(top_k_index, top_k_weights, w1.shape[0], _routing_block_m(config.gemm, hidden.device),
                     gemms.torch_gemm)
    x_rows = hidden if gemms.gathers_in_gemm else hidden.index_select(0, routing.token)
    xa = None if a1 is None else gemms.rows(x_rows, a1, routing, gather=gemms.gathers_in_gemm)
    gu, h = gemms.gate_up(x_rows, w1, b1, _lora_or_none(xa, l1, config.gate_up_scaling), routing, options)
    del x_rows
    ha = None if a2 is None else gemms.rows(h, a2, routing, gather=False)
    y = gemms.rows(h, w2, routing, gather=False, lora=_lora_or_none(ha, l2, config.down_scaling))
    del h
    return _combine(y, routing, top_k_index.shape[1], weighted=True, bias=b2), gu, xa, ha, routing


class _MoeExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, top_k_index, top_k_weights, w1, w2, b1, b2, a1, l1, a2, l2, config):
        # Adapters are tiny: cast and made dense here (torch's grouped GEMM needs one unit stride).
        ctx.adapter_dtypes = [None if t is None else t.dtype for t in (a1, l1, a2, l2)]
        a1, l1, a2, l2 = (None if t is None else t.to(hidden.dtype).contiguous() for t in (a1, l1, a2, l2))
        out, gu, xa, ha, routing = _forward(hidden, top_k_index, top_k_weights, w1, w2, b1, b2, a1, l1, a2, l2, config)
        ctx.save_for_backward(hidden, gu, xa, ha, w1, w2, b1, b2, a1, l1, a2, l2, *routing[:-1])
        ctx.config, ctx.block_m, ctx.top_k = config, routing.block_m, top_k_index.shape[1]
        return out

    @staticmethod
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_out):
        hidden, gu, xa, ha, w1, w2, b1, b2, a1, l1, a2, l2, *routing = saved
        routing = _Routing(*routing, ctx.block_m)
        grads = _backward(ctx.config, ctx.needs_input_grad, ctx.top_k, grad_out, hidden, gu, xa, ha, w1, w2, b1, b2,
                          a1, l1, a2, l2, routing)
        for i, dtype in zip((7, 8, 9, 10), ctx.adapter_dtypes):
            if grads[i] is not None:
                grads[i] = grads[i].to(dtype)
        return tuple(grads)


def _backward(config, needs, top_k, grad_out, hidden, gu, xa, ha, w1, w2, b1, b2, a1, l1, a2, l2, routing):
    """The gradients of :class:`_MoeExpertsFunction`'s inputs (None where `needs` has no need);
    writes over `gu` and `ha`."""
    gemms = _GEMMS[config.gemm]
    gather = gemms.gathers_in_gemm
    s1, s2 = config.gate_up_scaling, config.down_scaling
    grads = [None] * 12
    dy = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
    dy_rows = dy if gather else dy.index_select(0, routing.token)
    # Down projection, LoRA side first: g needs dy_perm B2 A2 (the dropped rows are garbage).
    dyb = None if a2 is None else gemms.rows(dy_rows, l2.transpose(1, 2), routing, gather=gather)
    wh, dw = gemms.down_backward(
        dy_rows, w2.transpose(1, 2), _lora_or_none(dyb, a2.transpose(1, 2) if a2 is not None else None, s2),
        gu, routing, config.gate,
    )
    # gu now holds d(gate|up): a second backward through a retained graph must fail loudly.
    torch.autograd.graph.increment_version(gu)
    grad_gu = gu
    if needs[2]:
        valid = routing.index < w1.shape[0]
        grads[2] = torch.where(valid, dw[routing.pos], 0.0)
        if b2 is not None:
            # y includes the down bias: d w = dy · (W2 h + b2[e]); the bias part as a (N, E) GEMM.
            bias_part = torch.mm(dy.float(), b2.float().t())
            index = routing.index.clamp(max=w1.shape[0] - 1).view(-1, top_k).long()
            grads[2] = grads[2] + torch.where(valid, bias_part.gather(1, index).view(-1), 0.0)
        grads[2] = grads[2].view(-1, top_k).to(routing.weights.dtype)
    if needs[4]:
        grads[4] = gemms.weights(dy_rows, wh, routing, w2, gather_a=gather)
    if needs[6]:
        grads[6] = _segment_sum(dy_rows, routing, b2, gather=gather, weighted=True)
    if a2 is not None and needs[9]:
        grads[9] = gemms.weights(dyb, wh, routing, a2, scale=s2)
    if a2 is not None and needs[10]:
        wha = ha.mul_(routing.weights[routing.order].to(ha.dtype)[:, None])  # ha is ours alone
        grads[10] = gemms.weights(dy_rows, wha, routing, l2, gather_a=gather, scale=s2)
    del wh, dyb, dy_rows

    # Gate/up projection.
    grad_xa = None
    if a1 is not None and (needs[0] or needs[7]):
        grad_xa = gemms.rows(grad_gu, l1.transpose(1, 2), routing, gather=False, scale=s1)
    if a1 is not None and needs[8]:
        grads[8] = gemms.weights(grad_gu, xa, routing, l1, scale=s1)
    if needs[5]:
        grads[5] = _segment_sum(grad_gu, routing, b1, gather=False, weighted=False)
    if needs[3] or needs[7]:
        x_rows = hidden if gather else hidden.index_select(0, routing.token)
        if needs[3]:
            grads[3] = gemms.weights(grad_gu, x_rows, routing, w1, gather_b=gather)
        if needs[7]:
            grads[7] = gemms.weights(grad_xa, x_rows, routing, a1, gather_b=gather)
        del x_rows
    if needs[0]:
        lora = _lora_or_none(grad_xa, a1.transpose(1, 2) if a1 is not None else None, 1.0)
        grad_rows = gemms.rows(grad_gu, w1.transpose(1, 2), routing, gather=False, lora=lora)
        grads[0] = _combine(grad_rows, routing, top_k, weighted=False)
    return grads


# ----------------------------------------------------------------------------------------------
# Inside torch.compile: forward and backward as library ops, the routing among their tensors.

_CONFIG_SCHEMA = (
    "str activation, float alpha, float? limit, float up_offset, bool interleaved, float gate_up_scaling, "
    "float down_scaling, str gemm"
)
_WEIGHTS_SCHEMA = (
    "Tensor gate_up_weight, Tensor down_weight, Tensor? gate_up_bias, Tensor? down_bias, Tensor? gate_up_lora_a, "
    "Tensor? gate_up_lora_b, Tensor? down_lora_a, Tensor? down_lora_b"
)


def _config_args(config: _Config) -> tuple:
    gate = config.gate
    return (gate.activation, float(gate.alpha), None if gate.limit is None else float(gate.limit),
            float(gate.up_offset), gate.interleaved, float(config.gate_up_scaling), float(config.down_scaling),
            config.gemm)


def _config_of(activation, alpha, limit, up_offset, interleaved, gate_up_scaling, down_scaling, gemm) -> _Config:
    return _Config(GateOptions(activation, alpha, limit, up_offset, interleaved), gate_up_scaling, down_scaling, gemm)


def _forward_fake(hidden, top_k_index, top_k_weights, w1, w2, b1, b2, a1, l1, a2, l2, *config):
    gemm = config[-1]
    n_slots, n_experts = top_k_index.numel(), w1.shape[0]
    block_m = _routing_block_m(gemm, hidden.device)
    tiles = (cdiv(n_slots, block_m) + torch.sym_min(n_experts, n_slots)) if block_m else None

    def rows(width, dtype=hidden.dtype):
        return hidden.new_empty((n_slots, width) if width is not None else (n_slots,), dtype=dtype)

    def absent():
        return hidden.new_empty(0)

    return (
        hidden.new_empty(hidden.shape), rows(w1.shape[1]),
        rows(a1.shape[1]) if a1 is not None else absent(), rows(a2.shape[1]) if a2 is not None else absent(),
        *(rows(None, torch.int64) for _ in range(3)),  # order, token, pos
        hidden.new_empty((n_experts + 1,), dtype=torch.int64),
        hidden.new_empty((n_experts,), dtype=torch.int32) if _GEMMS[gemm].torch_gemm else absent(),
        *((hidden.new_empty((tiles,), dtype=torch.int64) if block_m else absent()) for _ in range(2)),
    )


@library_op(
    "moe_experts",
    f"(Tensor hidden, Tensor top_k_index, Tensor top_k_weights, {_WEIGHTS_SCHEMA}, {_CONFIG_SCHEMA}) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _forward_fake,
)
def _forward_op(hidden, top_k_index, top_k_weights, w1, w2, b1, b2, a1, l1, a2, l2, *config):
    """(out, gu, xa, ha, order, token, pos, offsets, ends32, tile_expert, tile_row), empty where
    absent; the adapters in hidden's dtype, dense."""
    config = _config_of(*config)
    w1, w2 = _op_weights(config, w1, w2)
    out, gu, xa, ha, routing = _forward(hidden, top_k_index, top_k_weights, w1, w2, b1, b2, a1, l1, a2, l2, config)
    return tuple(hidden.new_empty(0) if t is None else t for t in (out, gu, xa, ha, *routing[2:-1]))


def _op_weights(config: _Config, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert weights a library op's GEMMs take: torch's grouped GEMM was chosen while tracing,
    blind to their addresses (:func:`_misaligned`), so a misaligned one is copied here."""
    return (_aligned(w1), _aligned(w2)) if _GEMMS[config.gemm].torch_gemm else (w1, w2)


# The gradients the backward op returns: of hidden, top_k_weights and the weights, in input order.
_GRAD_INPUTS = (0, *range(2, 11))


def _backward_fake(grad_out, hidden, top_k_index, top_k_weights, w1, w2, b1, b2, a1, l1, a2, l2, *rest):
    needs = rest[-1]
    likes = (hidden, top_k_weights, w1, w2, b1, b2, a1, l1, a2, l2)
    grads = []
    for i, like in zip(_GRAD_INPUTS, likes):
        if not needs[i]:
            grads.append(hidden.new_empty(0))
        elif i in (3, 4, 7, 8, 9, 10):  # the weights' gradients keep their layout
            grads.append(torch.empty_like(like, memory_format=torch.preserve_format))
        else:
            grads.append(empty_if(True, like))
    return tuple(grads)


@library_op(
    "moe_experts_backward",
    f"(Tensor grad_out, Tensor hidden, Tensor top_k_index, Tensor top_k_weights, {_WEIGHTS_SCHEMA}, Tensor gu, "
    "Tensor? xa, Tensor? ha, Tensor order, Tensor token, Tensor pos, Tensor offsets, Tensor? ends32, "
    f"Tensor? tile_expert, Tensor? tile_row, {_CONFIG_SCHEMA}, bool[] needs) -> ({', '.join(['Tensor'] * 10)})",
    _backward_fake,
)
def _backward_op(grad_out, hidden, top_k_index, top_k_weights, w1, w2, b1, b2, a1, l1, a2, l2, gu, xa, ha,
                 order, token, pos, offsets, ends32, tile_expert, tile_row, *config_and_needs):
    *config, needs = config_and_needs
    config = _config_of(*config)
    w1, w2 = _op_weights(config, w1, w2)
    block_m = _routing_block_m(config.gemm, hidden.device)
    routing = _Routing(top_k_index.reshape(-1), top_k_weights.reshape(-1), order, token, pos, offsets, ends32,
                       tile_expert, tile_row, block_m or 0)
    # Backward writes over the pre-activations (and ha): here inputs, so over copies.
    grads = _backward(config, needs, top_k_index.shape[1], grad_out, hidden, gu.clone(), xa,
                      None if ha is None else ha.clone(), w1, w2, b1, b2, a1, l1, a2, l2, routing)
    return tuple(hidden.new_empty(0) if grads[i] is None else grads[i] for i in _GRAD_INPUTS)


def _setup_context(ctx, inputs, output):
    hidden, top_k_index, top_k_weights, w1, w2, b1, b2, a1, l1, a2, l2, *config = inputs
    _, gu, xa, ha, order, token, pos, offsets, ends32, tile_expert, tile_row = output
    gemm = config[-1]
    routed_by_tile = _routing_block_m(gemm, hidden.device) is not None
    ctx.save_for_backward(
        hidden, top_k_index, top_k_weights, w1, w2, b1, b2, a1, l1, a2, l2, gu,
        xa if a1 is not None else None, ha if a2 is not None else None, order, token, pos, offsets,
        ends32 if _GEMMS[gemm].torch_gemm else None,
        tile_expert if routed_by_tile else None, tile_row if routed_by_tile else None,
    )
    ctx.config = config


def _op_backward(ctx, grad_out, *_):
    needs = list(ctx.needs_input_grad[:11])
    grads = _backward_op(grad_out, *ctx.saved_tensors, *ctx.config, needs)
    by_input = dict(zip(_GRAD_INPUTS, grads))
    return tuple(by_input[i] if i in by_input and needs[i] else None for i in range(11 + len(ctx.config)))


_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


def _moe_experts_compiled(hidden, top_k_index, top_k_weights, w1, w2, b1, b2, a1, l1, a2, l2, config):
    # Cast and dense as the Function makes them; autograd of the casts returns the adapters'
    # gradients in their own dtypes.
    a1, l1, a2, l2 = (None if t is None else t.to(hidden.dtype).contiguous() for t in (a1, l1, a2, l2))
    return _forward_op(hidden, top_k_index, top_k_weights, w1, w2, b1, b2, a1, l1, a2, l2, *_config_args(config))[0]


MOE_EXPERTS = Op("moe_experts", _MoeExpertsFunction.apply, moe_experts_reference, compiled=_moe_experts_compiled)


# ----------------------------------------------------------------------------------------------
# Public function


def _check_lora(name: str, lora, n_experts: int, out_features: int, in_features: int, device) -> tuple:
    """(A, B, scaling) of one projection's adapters, checked; (None, None, 1.0) without."""
    if lora is None:
        return None, None, 1.0
    if not isinstance(lora, (tuple, list)) or len(lora) != 3:
        raise ValueError(f"{name} must be a tuple (lora_a, lora_b, scaling), got {lora!r}")
    lora_a, lora_b, scaling = lora
    for arg, t in ((f"{name}[0] (lora_a)", lora_a), (f"{name}[1] (lora_b)", lora_b)):
        check_float(arg, t)
        check_device(arg, t, device)
    rank = lora_a.shape[1] if lora_a.dim() == 3 else 0
    if lora_a.dim() != 3 or tuple(lora_a.shape) != (n_experts, rank, in_features) or rank == 0:
        raise ValueError(f"{name}[0] (lora_a) must have shape ({n_experts}, r, {in_features}) with r >= 1, "
                         f"got {tuple(lora_a.shape)}")
    if tuple(lora_b.shape) != (n_experts, out_features, rank):
        raise ValueError(f"{name}[1] (lora_b) must have shape ({n_experts}, {out_features}, {rank}), "
                         f"got {tuple(lora_b.shape)}")
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
        raise ValueError(f"{name}[2] (scaling) must be a finite number, got {scaling!r}")
    return lora_a, lora_b, float(scaling)


def _check_gate(options: GateOptions) -> None:
    check_choice("activation", options.activation, ACTIVATIONS)
    alpha = options.alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha must be a positive finite number, got {alpha!r}")
    if alpha != 1.0 and options.activation != "silu":
        raise ValueError(f"alpha applies to activation='silu' only, got alpha={alpha!r} with {options.activation!r}")
    limit = options.limit
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                              or not math.isfinite(limit) or limit <= 0):
        raise ValueError(f"limit must be None or a positive finite number, got {limit!r}")
    if not isinstance(options.up_offset, (int, float)) or not math.isfinite(options.up_offset):
        raise ValueError(f"up_offset must be a finite number, got {options.up_offset!r}")
    if not isinstance(options.interleaved, bool):
        raise ValueError(f"interleaved must be a bool, got {options.interleaved!r}")


def _check_shapes(hidden, top_k_index, top_k_weights, gate_up_weight, down_weight, gate_up_bias, down_bias):
    check_float("hidden", hidden)
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D (tokens, hidden), got shape {tuple(hidden.shape)}")
    n_tokens, width = hidden.shape
    device = hidden.device
    if not isinstance(top_k_index, torch.Tensor) or top_k_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"top_k_index must be an int64 or int32 tensor, got {getattr(top_k_index, 'dtype', top_k_index)!r}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != n_tokens or top_k_index.shape[1] == 0:
        raise ValueError(f"top_k_index must have shape ({n_tokens}, K) with K >= 1, got {tuple(top_k_index.shape)}")
    check_device("top_k_index", top_k_index, device)
    check_float("top_k_weights", top_k_weights)
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"top_k_weights must have top_k_index's shape {tuple(top_k_index.shape)}, "
                         f"got {tuple(top_k_weights.shape)}")
    check_device("top_k_weights", top_k_weights, device)
    check_float("gate_up_weight", gate_up_weight)
    if gate_up_weight.dim() != 3 or gate_up_weight.shape[2] != width or gate_up_weight.shape[1] % 2:
        raise ValueError(f"gate_up_weight must have shape (experts, 2 * intermediate, {width}), "
                         f"got {tuple(gate_up_weight.shape)}")
    n_experts, inter = gate_up_weight.shape[0], gate_up_weight.shape[1] // 2
    for name, t, shape in (
        ("down_weight", down_weight, (n_experts, width, inter)),
        ("gate_up_bias", gate_up_bias, (n_experts, 2 * inter)),
        ("down_bias", down_bias, (n_experts, width)),
    ):
        if t is None and name.endswith("bias"):
            continue
        check_float(name, t)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        check_device(name, t, device)
    for name, t in (("gate_up_weight", gate_up_weight), ("down_weight", down_weight)):
        if t.stride(-1) != 1 and t.stride(-2) != 1:
            raise ValueError(f"{name} must have a unit stride in one of its last two dims, got strides {t.stride()}")
        check_device(name, t, device)
    return n_experts, inter


def _torch_gemm_reason(hidden: torch.Tensor, widths, weights) -> str | None:
    """Why torch's grouped GEMM cannot take these operands, or None."""
    device = hidden.device
    if _grouped_mm is None:
        return "this torch has no grouped_mm"
    if device.type == "cuda" and (hidden.dtype != torch.bfloat16 or torch.cuda.get_device_capability(device) < (9, 0)):
        return "torch's grouped GEMM runs bfloat16 on compute capability >= 9.0 only"
    if device.type not in ("cuda", "cpu"):
        return f"no grouped GEMM on {device.type}"
    # Its operands need 16-byte aligned addresses and row strides.
    per_16_bytes = 16 // hidden.element_size()
    if any(width % per_16_bytes for width in widths):
        return f"hidden, intermediate and LoRA widths {sorted(set(widths))} must be multiples of {per_16_bytes}"
    if any(_misaligned(w) or any(s != 1 and s % per_16_bytes for s in w.stride()) for w in weights):
        return "an expert weight's address or strides are not multiples of 16 bytes"
    return None


def _misaligned(t: torch.Tensor) -> bool:
    """Whether `t`'s first element is not 16-byte aligned, as far as can be told now. Dynamo can
    trace neither data_ptr() nor storage_offset(): inside torch.compile the weights are taken as
    aligned (parameters are), and the library ops copy one that is not (:func:`_aligned`)."""
    return not torch.compiler.is_compiling() and t.data_ptr() % 16 != 0


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it at a fresh (aligned) address, in its layout where it is dense: what
    torch's grouped GEMM can take when the choice of it was made while tracing."""
    if t.data_ptr() % 16 == 0:
        return t
    return torch.empty_like(t, memory_format=torch.preserve_format).copy_(t)


def _pick_gemm(gemm: str, hidden: torch.Tensor, widths, weights) -> str:
    if gemm == "triton":
        return gemm
    reason = _torch_gemm_reason(hidden, widths, weights)
    if gemm == "auto":
        return PREFERRED_GEMM if hidden.is_cuda and reason is None else "triton"
    if reason is not None:
        raise ValueError(f"gemm={gemm!r} cannot run these inputs: {reason}; use gemm='triton' or 'auto'")
    return gemm


def moe_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    *,
    activation: str = "silu",
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    interleaved: bool = False,
    alpha: float = 1.0,
    limit: float | None = None,
    up_offset: float = 0.0,
    gate_up_lora: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    down_lora: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    gemm: str = "auto",
) -> torch.Tensor:
    """The routed experts of a mixture-of-experts block (see the module docstring), forward and
    backward, without a host sync.

    Args:
        hidden: ``(N, H)`` token states, float16/bfloat16/float32 (float64 runs the reference).
        top_k_index: ``(N, K)`` int64/int32 expert ids from the router; an id ``>= E`` drops its
            slot (transformers' expert-parallel sentinel), a negative one is not allowed.
        top_k_weights: ``(N, K)`` routing weights, any float dtype (their gradient comes back in
            it): the router's gradient flows through them.
        gate_up_weight: ``(E, 2I, H)``, transformers' ``gate_up_proj`` (a transposed view of
            gpt-oss's ``(E, H, 2I)`` storage is fine: any strides with one unit stride).
        down_weight: ``(E, H, I)``, transformers' ``down_proj`` (or a transposed view).
        activation: the gate's activation, ``"silu"``, ``"gelu_tanh"`` or ``"gelu"``.
        gate_up_bias, down_bias: optional ``(E, 2I)`` and ``(E, H)`` biases (gpt-oss).
        interleaved: gate and up are gate_up's even and odd rows (gpt-oss) instead of its halves.
        alpha: SiLU's slope, ``act(g) = g σ(α g)`` (gpt-oss: 1.702); silu only.
        limit: clamp ``g <= limit`` and ``|u| <= limit`` before the activation (gpt-oss: 7.0).
        up_offset: the gate multiplies ``u + up_offset`` (gpt-oss: 1.0).
        gate_up_lora, down_lora: LoRA adapters per projection, ``(lora_a (E, r, in), lora_b
            (E, out, r), scaling)`` with in/out of the projection (H→2I and I→H); the delta of
            expert e is ``scaling · lora_b[e] @ lora_a[e]`` in the weight's layout. Adapters may
            have another float dtype (gradients come back in it).
        gemm: ``"auto"``, ``"triton"``, ``"grouped_mm"`` or ``"hybrid"`` (see the module
            docstring); ``"grouped_mm"``/``"hybrid"`` need widths that are multiples of 16 bytes,
            16-byte aligned weights (bfloat16 on a GPU). Inside torch.compile, which cannot trace an
            address, a misaligned weight is copied for them instead of refused.

    Weights, biases and hidden share a dtype unless autocast is on (then all are computed in the
    autocast dtype, as ``F.linear`` would). Weights that do not require grad get no
    weight-gradient GEMM.

    Returns:
        ``(N, H)`` in hidden's dtype (the autocast dtype under autocast). Inside torch.compile the
        same kernels run as the library ops ``tigon::moe_experts`` and ``_backward`` (whose
        backward writes over a copy of the saved pre-activations: (N K, 2I) more at its peak).
    """
    n_experts, inter = _check_shapes(hidden, top_k_index, top_k_weights, gate_up_weight, down_weight,
                                     gate_up_bias, down_bias)
    options = GateOptions(activation, alpha, limit, up_offset, interleaved)
    _check_gate(options)
    check_choice("gemm", gemm, GEMMS)
    width = hidden.shape[1]
    device = hidden.device
    a1, l1, s1 = _check_lora("gate_up_lora", gate_up_lora, n_experts, 2 * inter, width, device)
    a2, l2, s2 = _check_lora("down_lora", down_lora, n_experts, width, inter, device)
    dtype = autocast_dtype(hidden)
    params = [gate_up_weight, down_weight, gate_up_bias, down_bias]
    if dtype is None:
        for name, t in zip(("gate_up_weight", "down_weight", "gate_up_bias", "down_bias"), params):
            if t is not None and t.dtype != hidden.dtype:
                raise ValueError(f"{name} must have the dtype of hidden ({hidden.dtype}), got {t.dtype}")
    else:
        hidden = hidden.to(dtype)
        params = [None if t is None else t.to(dtype) for t in params]
    if hidden.dtype in KERNEL_DTYPES:
        ranks = [t.shape[1] for t in (a1, a2) if t is not None]
        gemm = _pick_gemm(gemm, hidden, [width, inter, *ranks], params[:2])
    else:  # float64 runs the reference, whichever back end was asked for
        gemm = "triton"
    config = _Config(options, s1, s2, gemm)
    return MOE_EXPERTS.without_autocast(dtype, None, hidden, top_k_index, top_k_weights, *params, a1, l1, a2, l2, config)
