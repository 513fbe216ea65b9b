"""Multimodal rotary embedding (M-RoPE, Qwen2-VL / Qwen2.5-VL / Qwen3-VL) and the vision towers'
rotary embedding (Qwen2-VL / Qwen2.5-VL / Qwen3-VL), both on one kernel that rotates q and k in
one launch.

    mrope(q, k, cos, sin, section) = (q * c + rotate_half(q) * s, k * c + rotate_half(k) * s)

where cos/sin hold one table per position axis, ``(3, batch, tokens, R)`` for the temporal, height
and width position ids (what the Qwen-VL rotary embeddings compute before they merge the three),
and c/s take each frequency pair's column from the table of its axis:

    interleaved=False   (Qwen2-VL, Qwen2.5-VL) pairs [0, t) from the temporal table, [t, t + h)
                        from the height one, the rest from the width one, for
                        ``mrope_section = (t, h, w)``, ``t + h + w = R / 2``;
    interleaved=True    (Qwen3-VL) pair i from the height table when ``i % 3 == 1`` and ``i < 3h``,
                        from the width one when ``i % 3 == 2`` and ``i < 3w``, else the temporal one.

Pair i is dims (i, i + R/2) of a head (``rotate_half``); dims past R pass through. The merged table
is never formed: each program reads the columns it needs from the three tables. Transformers >= 5
merges the tables inside its rotary embedding and calls the plain ``apply_rotary_pos_emb``; on
that merged table :func:`tigon.functional.rope` is the same computation.

    vision_rope(q, k, cos, sin)   q/k ``(tokens, heads, head_dim)``, cos/sin ``(tokens, R)``

is ``apply_rotary_pos_emb_vision``: the rotation in fp32, the result in q's dtype (the vision
towers keep cos/sin in fp32).

The rotation is linear; its backward is the rotation by the transpose (-sin, the halves' sin
swapped), by the same kernel. Nothing of q or k is saved. Each program takes a block of tokens and
the heads of q and k as one range (q's heads, then k's), so cos/sin are read once per token and a
head count that is not a power of two costs no padded heads when q's and k's add up to one
(Qwen2.5-VL-7B: 28 + 4).
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from tigon.ops._checks import KERNEL_DTYPES, check_device, check_float
from tigon.ops._dispatch import Op, backward_fallback, library_op, tl, triton
from tigon.ops._launch import cdiv, launched, next_power_of_2
from tigon.ops.rope import rope_reference

# Elements of a (tokens, heads, pairs) half-tile one program holds per loop step, and per warp:
# rope's choice, the fastest of its sweep on the H200 (scripts/tune_rope.py); not yet swept here.
TILE_ELEMENTS = 4096
ELEMENTS_PER_WARP = 4096


@triton.jit
def _load_either(q_at, k_at, q_mask, k_mask):
    """The element at q_at where q_mask holds, at k_at where k_mask does (never both), 0 elsewhere,
    in the input dtype."""
    return tl.load(q_at, mask=q_mask, other=0.0) + tl.load(k_at, mask=k_mask, other=0.0)


@launched
@triton.jit
def _mrope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    n_tokens, n_token_blocks, n_q_heads, n_heads,
    q_batch_stride, q_head_stride, q_token_stride,
    k_batch_stride, k_head_stride, k_token_stride,
    q_out_batch_stride, q_out_head_stride, q_out_token_stride,
    k_out_batch_stride, k_out_head_stride, k_out_token_stride,
    cos_axis_stride, cos_batch_stride, cos_token_stride,
    sin_axis_stride, sin_batch_stride, sin_token_stride,
    section_t, section_h, section_w,
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    batch = pid // n_token_blocks
    tokens = (pid % n_token_blocks) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS).to(tl.int64)
    token_mask = tokens < n_tokens
    pairs = tl.arange(0, BLOCK_HALF)
    if INTERLEAVED:
        axis = tl.where((pairs % 3 == 1) & (pairs < 3 * section_h), 1, tl.where((pairs % 3 == 2) & (pairs < 3 * section_w), 2, 0))
    else:
        axis = (pairs >= section_t).to(tl.int32) + (pairs >= section_t + section_h).to(tl.int32)
    axis = axis.to(tl.int64)[None, :]
    table_mask = token_mask[:, None] & (pairs < HALF)[None, :]
    cos_at = cos_ptr + axis * cos_axis_stride + batch * cos_batch_stride + tokens[:, None] * cos_token_stride + pairs[None, :]
    sin_at = sin_ptr + axis * sin_axis_stride + batch * sin_batch_stride + tokens[:, None] * sin_token_stride + pairs[None, :]
    cos1 = tl.load(cos_at, mask=table_mask, other=0.0).to(tl.float32)[:, None, :]
    cos2 = tl.load(cos_at + HALF, mask=table_mask, other=0.0).to(tl.float32)[:, None, :]
    sin1 = tl.load(sin_at, mask=table_mask, other=0.0).to(tl.float32)[:, None, :]
    sin2 = tl.load(sin_at + HALF, mask=table_mask, other=0.0).to(tl.float32)[:, None, :]
    # Pair (x1, x2) -> (x1 c1 - x2 s1, x2 c2 + x1 s2); backward: the transpose, s1 and s2 swapped and negated.
    if BACKWARD:
        sin_first = -sin2
        sin_second = -sin1
    else:
        sin_first = sin1
        sin_second = sin2
    q_rows = q_ptr + batch * q_batch_stride + tokens[:, None] * q_token_stride
    k_rows = k_ptr + batch * k_batch_stride + tokens[:, None] * k_token_stride
    q_out_rows = q_out_ptr + batch * q_out_batch_stride + tokens[:, None] * q_out_token_stride
    k_out_rows = k_out_ptr + batch * k_out_batch_stride + tokens[:, None] * k_out_token_stride
    cols = pairs[None, None, :]
    for head_start in range(0, n_heads, BLOCK_HEADS):
        heads = head_start + tl.arange(0, BLOCK_HEADS).to(tl.int64)
        row_mask = (token_mask[:, None] & (heads < n_heads)[None, :])[:, :, None]
        is_q = (heads < n_q_heads)[None, :, None]
        # q's heads first, then k's: two predicated accesses per element, never a select of
        # pointers (which costs the loads their vectorization)
        q_mask = row_mask & is_q
        k_mask = row_mask & ~is_q
        q_src = q_rows[:, :, None] + heads[None, :, None] * q_head_stride
        k_src = k_rows[:, :, None] + (heads - n_q_heads)[None, :, None] * k_head_stride
        q_dst = q_out_rows[:, :, None] + heads[None, :, None] * q_out_head_stride
        k_dst = k_out_rows[:, :, None] + (heads - n_q_heads)[None, :, None] * k_out_head_stride
        half_mask = cols < HALF
        x1 = _load_either(q_src + cols, k_src + cols, q_mask & half_mask, k_mask & half_mask).to(tl.float32)
        x2 = _load_either(q_src + cols + HALF, k_src + cols + HALF, q_mask & half_mask, k_mask & half_mask).to(tl.float32)
        y1 = x1 * cos1 - x2 * sin_first
        y2 = x2 * cos2 + x1 * sin_second
        tl.store(q_dst + cols, y1, mask=q_mask & half_mask)
        tl.store(k_dst + cols, y1, mask=k_mask & half_mask)
        tl.store(q_dst + cols + HALF, y2, mask=q_mask & half_mask)
        tl.store(k_dst + cols + HALF, y2, mask=k_mask & half_mask)
        if BLOCK_PASS > 0:
            passed = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, None, :]
            pass_mask = passed < HEAD_DIM
            kept = _load_either(q_src + passed, k_src + passed, q_mask & pass_mask, k_mask & pass_mask)
            tl.store(q_dst + passed, kept, mask=q_mask & pass_mask)
            tl.store(k_dst + passed, kept, mask=k_mask & pass_mask)


def _axis_columns(rot: int, mrope_section: Sequence[int], interleaved: bool, device: torch.device) -> torch.Tensor:
    """The table (0 temporal, 1 height, 2 width) each of the R columns is read from."""
    pairs = torch.arange(rot // 2, device=device)
    _, section_h, section_w = mrope_section
    if interleaved:
        axis = torch.zeros_like(pairs)
        axis[(pairs % 3 == 1) & (pairs < 3 * section_h)] = 1
        axis[(pairs % 3 == 2) & (pairs < 3 * section_w)] = 2
    else:
        axis = torch.repeat_interleave(torch.arange(3, device=device), torch.tensor(list(mrope_section), device=device))
    return torch.cat((axis, axis))


def merge_tables(table: torch.Tensor, mrope_section: Sequence[int], interleaved: bool = False) -> torch.Tensor:
    """The ``(batch, tokens, R)`` cos or sin of ``(3, batch, tokens, R)`` per-axis tables: each column
    from its axis's table (what the Qwen-VL rotary embeddings of transformers >= 5 return)."""
    axis = _axis_columns(table.shape[-1], mrope_section, interleaved, table.device)
    return table.gather(0, axis.expand(1, *table.shape[1:])).squeeze(0)


def mrope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mrope_section: Sequence[int],
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE in PyTorch: the tables merged, then the Llama rotation (the test oracle and the fallback)."""
    return rope_reference(q, k, merge_tables(cos, mrope_section, interleaved), merge_tables(sin, mrope_section, interleaved))


def vision_rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_pos_emb_vision`` in PyTorch: at least fp32 inside, q's and k's dtypes out."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    q_embed, k_embed = rope_reference(q.to(dtype).transpose(0, 1), k.to(dtype).transpose(0, 1), cos.to(dtype), sin.to(dtype))
    return q_embed.transpose(0, 1).to(q.dtype), k_embed.transpose(0, 1).to(k.dtype)


@functools.lru_cache(maxsize=None)  # called on every launch: host time is part of a step's cost
def _launch_config(half: int, head_dim: int, n_tokens: int, n_heads: int) -> tuple[int, ...]:
    """(BLOCK_HALF, BLOCK_PASS, BLOCK_HEADS, BLOCK_TOKENS, token blocks, num_warps)."""
    block_half = next_power_of_2(half)
    block_heads = min(next_power_of_2(n_heads), max(1, TILE_ELEMENTS // block_half))
    # Few or narrow heads: several tokens per program, so each moves a full tile.
    block_tokens = min(next_power_of_2(n_tokens), max(1, TILE_ELEMENTS // (block_heads * block_half)))
    num_warps = min(16, max(1, block_tokens * block_heads * block_half // ELEMENTS_PER_WARP))
    pass_dims = head_dim - 2 * half
    block_pass = next_power_of_2(pass_dims) if pass_dims else 0
    return block_half, block_pass, block_heads, block_tokens, cdiv(n_tokens, block_tokens), num_warps


def _table_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(axis, batch, token) strides of a (3, batch or 1, tokens, R) table; 0 for a broadcast batch."""
    return t.stride(0), (t.stride(1) if t.shape[1] > 1 else 0), t.stride(2)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(q, k, cos, sin, q_out, k_out, section, interleaved, backward):
    """Rotate q into q_out and k into k_out in one launch; a None pair gets no heads (its slot
    then holds the other pair's tensors, never read)."""
    pairs = [(x, out) for x, out in ((q, q_out), (k, k_out)) if x is not None]
    n_q_heads = q.shape[1] if q is not None else 0
    n_heads = sum(x.shape[1] for x, _ in pairs)
    (q, q_out), (k, k_out) = pairs[0], pairs[-1]
    batch, _, n_tokens, head_dim = q.shape
    half = cos.shape[-1] // 2
    block_half, block_pass, block_heads, block_tokens, n_token_blocks, num_warps = _launch_config(
        half, head_dim, n_tokens, n_heads
    )
    # (batch, head, token) strides of q, k, q_out, k_out, then (axis, batch, token) of cos, sin
    strides = [t.stride(dim) for t in (q, k, q_out, k_out) for dim in range(3)] + [*_table_strides(cos), *_table_strides(sin)]
    _mrope_kernel[(batch * n_token_blocks,)](
        q, k, cos, sin, q_out, k_out, n_tokens, n_token_blocks, n_q_heads, n_heads, *strides, *section,
        INTERLEAVED=interleaved, BACKWARD=backward, HALF=half, HEAD_DIM=head_dim, BLOCK_TOKENS=block_tokens,
        BLOCK_HEADS=block_heads, BLOCK_HALF=block_half, BLOCK_PASS=block_pass, num_warps=num_warps,
    )


def _rotate(q, k, cos, sin, section, interleaved, dtype, backward):
    """q and k (either may be None: skipped) rotated into new tensors of `dtype`, each in its
    input's layout where that is dense."""
    q = _unit_last_stride(q) if q is not None else None
    k = _unit_last_stride(k) if k is not None else None
    q_out = torch.empty_like(q, dtype=dtype) if q is not None else None
    k_out = torch.empty_like(k, dtype=dtype) if k is not None else None
    if q is not None or k is not None:
        _launch(q, k, _unit_last_stride(cos), _unit_last_stride(sin), q_out, k_out, tuple(section), interleaved, backward)
    return q_out, k_out


def _tables_reference(q, k, cos, sin, section, interleaved, dtype, op=None):
    """What the kernel path computes, with its arguments, in PyTorch (the backward's fallback)."""
    compute = torch.promote_types(torch.promote_types(q.dtype, cos.dtype), torch.float32)
    out = mrope_reference(q.to(compute), k.to(compute), cos.to(compute), sin.to(compute), section, interleaved)
    return tuple(o.to(dtype) for o in out)


def _reference_point(ctx, saved):
    cos, sin = saved
    section, interleaved, dtype, shapes, op = ctx.config
    # The rotation is linear: its gradient is the same at any point, zeros will do.
    at = [torch.zeros(shape, dtype=dtype, device=cos.device) for shape in shapes]
    return op, _tables_reference, (*at, cos, sin, section, interleaved, dtype, op)


class _MRopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, section, interleaved, dtype, op):
        ctx.set_materialize_grads(False)  # an unused output's tensor is skipped in backward
        ctx.save_for_backward(cos, sin)
        # Gradients come back in the inputs' dtype, which the output's may promote.
        ctx.config = (section, interleaved, q.dtype, (q.shape, k.shape), op)
        return _rotate(q, k, cos, sin, section, interleaved, dtype, backward=False)

    @staticmethod
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_q_out, grad_k_out):
        cos, sin = saved
        section, interleaved, dtype, _, _ = ctx.config
        grads = _rotate(
            grad_q_out if ctx.needs_input_grad[0] else None, grad_k_out if ctx.needs_input_grad[1] else None,
            cos, sin, section, interleaved, dtype, backward=True,
        )
        return (*grads, None, None, None, None, None, None)


# Inside torch.compile: the same launchers as library ops.
_SCHEMA_TAIL = "Tensor cos, Tensor sin, int[] section, bool interleaved, ScalarType dtype) -> (Tensor, Tensor)"


def _rotated_or_empty(q, k, cos, sin, section, interleaved, dtype, backward):
    # A library op's outputs cannot be None: an empty tensor stands for a tensor not given.
    out = _rotate(q, k, cos, sin, section, interleaved, dtype, backward)
    return tuple(o if o is not None else cos.new_empty(0, dtype=dtype) for o in out)


def _fake(q, k, cos, sin, section, interleaved, dtype):
    return tuple(
        torch.empty_like(_unit_last_stride(t), dtype=dtype) if t is not None else cos.new_empty(0, dtype=dtype)
        for t in (q, k)
    )


@library_op("mrope", f"(Tensor q, Tensor k, {_SCHEMA_TAIL}", _fake)
def _forward_op(q, k, cos, sin, section, interleaved, dtype):
    return _rotated_or_empty(q, k, cos, sin, section, interleaved, dtype, backward=False)


@library_op("mrope_backward", f"(Tensor? grad_q_out, Tensor? grad_k_out, {_SCHEMA_TAIL}", _fake)
def _backward_op(grad_q_out, grad_k_out, cos, sin, section, interleaved, dtype):
    return _rotated_or_empty(grad_q_out, grad_k_out, cos, sin, section, interleaved, dtype, backward=True)


def _setup_context(ctx, inputs, output):
    q, _, cos, sin, section, interleaved, _ = inputs
    ctx.save_for_backward(cos, sin)
    ctx.config = (section, interleaved, q.dtype)


def _op_backward(ctx, grad_q_out, grad_k_out):
    grad_q, grad_k = _backward_op(grad_q_out, grad_k_out, *ctx.saved_tensors, *ctx.config)
    return (grad_q if grad_q_out is not None else None, grad_k if grad_k_out is not None else None,
            None, None, None, None, None)


_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


def _out_dtype(q: torch.Tensor, cos: torch.Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, cos.dtype)


MROPE = Op(
    "mrope",
    lambda q, k, cos, sin, section, interleaved: _MRopeFunction.apply(
        q, k, cos, sin, section, interleaved, _out_dtype(q, cos), MROPE
    ),
    mrope_reference,
    compiled=lambda q, k, cos, sin, section, interleaved: _forward_op(
        q, k, cos, sin, section, interleaved, _out_dtype(q, cos)
    ),
)


def _as_heads_first(t: torch.Tensor) -> torch.Tensor:
    """(tokens, heads, D) viewed as (1, heads, tokens, D), the kernel's layout."""
    return t.transpose(0, 1).unsqueeze(0)


def _vision_call(rotate):
    """vision_rope's path on top of `rotate` (the Function or the library op): q/k viewed as one
    batch, cos/sin as one table for every pair, the result in q's dtype."""

    def call(q, k, cos, sin):
        tables = [t[None, None] for t in (cos, sin)]
        out = rotate(_as_heads_first(q), _as_heads_first(k), *tables, (cos.shape[-1] // 2, 0, 0), False, q.dtype)
        return tuple(o.squeeze(0).transpose(0, 1) for o in out)

    return call


VISION_ROPE = Op(
    "vision_rope",
    _vision_call(lambda *args: _MRopeFunction.apply(*args, VISION_ROPE)),
    vision_rope_reference,
    compiled=_vision_call(_forward_op),
)


def _check_pair(q, k, dims: int, layout: str) -> None:
    for name, t in (("q", q), ("k", k)):
        check_float(name, t)
        if t.dim() != dims:
            raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")
    if k.dtype != q.dtype:
        raise ValueError(f"k must have the dtype of q ({q.dtype}), got {k.dtype}")
    check_device("k", k, q.device)


def _check_tables(cos, sin, q, lead: tuple[int, ...], head_dim: int, batch_dim: int | None = None) -> None:
    """cos/sin are float tables of shape (*lead, R) with R even, 2 <= R <= head_dim (dim
    `batch_dim` may also be 1), same shape and dtype, on q's device."""
    for name, t in (("cos", cos), ("sin", sin)):
        check_float(name, t)
        check_device(name, t, q.device)
        rot = t.shape[-1] if t.dim() else 0
        fits = t.dim() == len(lead) + 1 and all(
            size == want or (dim == batch_dim and size == 1) for dim, (size, want) in enumerate(zip(t.shape, lead))
        )
        if not fits or rot % 2 or not 2 <= rot <= head_dim:
            shape = ", ".join(f"{want} or 1" if dim == batch_dim else str(want) for dim, want in enumerate(lead))
            raise ValueError(f"{name} must have shape ({shape}, R) with R even and 2 <= R <= {head_dim}, got {tuple(t.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have the shape of cos {tuple(cos.shape)}, got {tuple(sin.shape)}")
    if sin.dtype != cos.dtype:
        raise ValueError(f"sin must have the dtype of cos ({cos.dtype}), got {sin.dtype}")


def _kernel_reason(q, cos) -> str | None:
    if q.dtype not in KERNEL_DTYPES or cos.dtype not in KERNEL_DTYPES:
        return f"dtype {q.dtype}/{cos.dtype} runs on the reference"
    return None


def _check_mrope(q, k, cos, sin, mrope_section, interleaved) -> tuple[str | None, tuple[int, int, int]]:
    _check_pair(q, k, 4, "(batch, heads, tokens, head_dim)")
    batch, _, n_tokens, head_dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, n_tokens, head_dim):
        raise ValueError(f"k must have shape ({batch}, kv_heads, {n_tokens}, {head_dim}) to match q, got {tuple(k.shape)}")
    _check_tables(cos, sin, q, (3, batch, n_tokens), head_dim, batch_dim=1)
    if not isinstance(interleaved, bool):
        raise ValueError(f"interleaved must be True or False, got {interleaved!r}")
    section = tuple(mrope_section) if isinstance(mrope_section, (list, tuple)) else ()
    half = cos.shape[-1] // 2
    if len(section) != 3 or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section) or sum(section) != half:
        raise ValueError(
            f"mrope_section must be 3 non-negative ints (temporal, height, width) adding up to R/2 = {half}, "
            f"got {mrope_section!r}"
        )
    if cos.requires_grad or sin.requires_grad:
        return "cos/sin require grad, and the kernel does not compute their gradients", section
    return _kernel_reason(q, cos), section


def mrope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mrope_section: Sequence[int],
    *,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rotary embedding (M-RoPE) of queries and keys in one kernel launch.

    ``apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section)`` of Qwen2-VL / Qwen2.5-VL
    (transformers < 5), and with ``interleaved=True`` Qwen3-VL's interleaved sections.

    Args:
        q: ``(batch, heads, tokens, head_dim)``, float16/bfloat16/float32 (float64 runs the
            reference); any strides (HF's transposed projections are read in place).
        k: ``(batch, kv_heads, tokens, head_dim)``, same dtype and device.
        cos, sin: ``(3, batch or 1, tokens, R)``: the cos/sin of the temporal, height and width
            position ids (the 3-D ``position_ids``), each ``cat(freqs, freqs)`` over R/2
            frequencies; R even, ``<= head_dim`` (dims past R pass through).
        mrope_section: how many of the R/2 frequencies take the temporal, height and width
            positions (Qwen2.5-VL-7B: ``[16, 24, 24]``); they add up to R/2.
        interleaved: False: the three sections one after the other (Qwen2-VL, Qwen2.5-VL); True:
            Qwen3-VL's layout, height and width at every third frequency (see the module docstring).
            Pairs are ``rotate_half``'s (i, i + R/2) either way.

    Returns:
        ``(q_embed, k_embed)`` shaped as q and k (in their layouts where dense), in the promotion
        of q's and cos's dtypes.
    """
    unsupported, section = _check_mrope(q, k, cos, sin, mrope_section, interleaved)
    return MROPE(unsupported, q, k, cos, sin, section, interleaved)


def vision_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The vision towers' rotary embedding (``apply_rotary_pos_emb_vision`` of Qwen2-VL,
    Qwen2.5-VL and Qwen3-VL) of queries and keys in one kernel launch.

    Args:
        q: ``(tokens, heads, head_dim)``, float16/bfloat16/float32 (float64 runs the reference);
            any strides (the vision attention's slices of one qkv projection are read in place).
        k: ``(tokens, heads, head_dim)``, same dtype and device.
        cos, sin: ``(tokens, R)``, R even and ``<= head_dim`` (the 2-D rotary's merged height and
            width angles, as the towers' rotary embeddings return them, usually fp32).

    Returns:
        ``(q_embed, k_embed)`` in q's dtype, rotated in fp32 as transformers does.
    """
    _check_pair(q, k, 3, "(tokens, heads, head_dim)")
    n_tokens, _, head_dim = q.shape
    if (k.shape[0], k.shape[2]) != (n_tokens, head_dim):
        raise ValueError(f"k must have shape ({n_tokens}, heads, {head_dim}) to match q, got {tuple(k.shape)}")
    _check_tables(cos, sin, q, (n_tokens,), head_dim)
    unsupported = "cos/sin require grad, and the kernel does not compute their gradients" if (
        cos.requires_grad or sin.requires_grad) else _kernel_reason(q, cos)
    return VISION_ROPE(unsupported, q, k, cos, sin)
