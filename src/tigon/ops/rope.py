"""Rotary position embedding of queries and keys, both in one launch.

    rope(q, k, cos, sin) = (q * cos + rotate(q) * sin, k * cos + rotate(k) * sin)

on the first R dims of each head (R = cos.shape[-1] <= head_dim); the other dims pass through
(partial rotary). cos/sin are what Hugging Face's rotary-embedding modules return: R columns, the
R/2 frequencies written twice (``cat(freqs, freqs)``).

    interleaved=False   NeoX/Llama ``rotate_half``: dim i pairs with dim i + R/2, and is scaled by
                        cos[..., i] (all R columns are read, as HF's formula does);
    interleaved=True    GPT-J / GLM: dims 2i and 2i + 1 pair, both scaled by cos[..., i]
                        (only the first R/2 columns are read).

One kernel serves forward and backward: the rotation is linear, and its transpose is the rotation
by -sin with the two halves' sin swapped (the same as -sin when the halves are equal). Each program
takes a block of tokens and every head of q and k, so cos/sin are read once per token. Nothing of
q/k is saved: backward needs only cos and sin.
"""

from __future__ import annotations

import functools

import torch

from tigon.ops._checks import KERNEL_DTYPES, check_device, check_float
from tigon.ops._dispatch import Op, backward_fallback, library_op, tl, triton
from tigon.ops._launch import cdiv, launched, next_power_of_2

# Elements of one half-tile (tokens x heads x pairs) that a program loads at a time.
TILE_ELEMENTS = 4096


@triton.jit
def _rope_heads(
    x_ptr, out_ptr, n_heads, batch, tokens, token_mask,
    x_batch_stride, x_head_stride, x_token_stride,
    out_batch_stride, out_head_stride, out_token_stride,
    cos_first, cos_second, sin_first, sin_second,
    INTERLEAVED: tl.constexpr,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    """Rotate every head of a block of tokens of x into out; tiles are (tokens, heads, pairs) and
    each pair (first, second) becomes
    (first * cos_first - second * sin_first, second * cos_second + first * sin_second)."""
    pairs = tl.arange(0, BLOCK_HALF)
    if INTERLEAVED:
        first = 2 * pairs
        second = first + 1
    else:
        first = pairs
        second = pairs + HALF
    first = first[None, None, :]
    second = second[None, None, :]
    x_tokens = x_ptr + batch * x_batch_stride + tokens[:, None, None] * x_token_stride
    out_tokens = out_ptr + batch * out_batch_stride + tokens[:, None, None] * out_token_stride
    for head_start in range(0, n_heads, BLOCK_HEADS):
        heads = head_start + tl.arange(0, BLOCK_HEADS).to(tl.int64)
        row_mask = token_mask[:, None, None] & (heads < n_heads)[None, :, None]
        mask = row_mask & (pairs < HALF)[None, None, :]
        x_rows = x_tokens + heads[None, :, None] * x_head_stride
        out_rows = out_tokens + heads[None, :, None] * out_head_stride
        x1 = tl.load(x_rows + first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_rows + second, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_rows + first, x1 * cos_first - x2 * sin_first, mask=mask)
        tl.store(out_rows + second, x2 * cos_second + x1 * sin_second, mask=mask)
        if BLOCK_PASS > 0:
            cols = 2 * HALF + tl.arange(0, BLOCK_PASS)
            pass_mask = row_mask & (cols < HEAD_DIM)[None, None, :]
            passed = tl.load(x_rows + cols[None, None, :], mask=pass_mask, other=0.0)
            tl.store(out_rows + cols[None, None, :], passed, mask=pass_mask)


@launched
@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    n_tokens, n_token_blocks, n_q_heads, n_k_heads,
    q_batch_stride, q_head_stride, q_token_stride,
    k_batch_stride, k_head_stride, k_token_stride,
    q_out_batch_stride, q_out_head_stride, q_out_token_stride,
    k_out_batch_stride, k_out_head_stride, k_out_token_stride,
    cos_batch_stride, cos_token_stride, sin_batch_stride, sin_token_stride,
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_K_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    batch = pid // n_token_blocks
    tokens = (pid % n_token_blocks) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    token_mask = tokens < n_tokens
    pairs = tl.arange(0, BLOCK_HALF)
    mask = token_mask[:, None] & (pairs < HALF)[None, :]
    # cos/sin are read once per token and broadcast over the heads of q and k.
    cos_rows = cos_ptr + batch * cos_batch_stride + tokens[:, None] * cos_token_stride + pairs[None, :]
    sin_rows = sin_ptr + batch * sin_batch_stride + tokens[:, None] * sin_token_stride + pairs[None, :]
    cos1 = tl.load(cos_rows, mask=mask, other=0.0).to(tl.float32)[:, None, :]
    sin1 = tl.load(sin_rows, mask=mask, other=0.0).to(tl.float32)[:, None, :]
    if INTERLEAVED:
        cos2 = cos1
        sin2 = sin1
    else:
        cos2 = tl.load(cos_rows + HALF, mask=mask, other=0.0).to(tl.float32)[:, None, :]
        sin2 = tl.load(sin_rows + HALF, mask=mask, other=0.0).to(tl.float32)[:, None, :]
    if BACKWARD:
        # Transpose of [[c1, -s1], [s2, c2]] is [[c1, s2], [-s1, c2]].
        sin_first = -sin2
        sin_second = -sin1
    else:
        sin_first = sin1
        sin_second = sin2
    _rope_heads(
        q_ptr, q_out_ptr, n_q_heads, batch, tokens, token_mask,
        q_batch_stride, q_head_stride, q_token_stride,
        q_out_batch_stride, q_out_head_stride, q_out_token_stride,
        cos1, cos2, sin_first, sin_second,
        INTERLEAVED, HALF, HEAD_DIM, BLOCK_Q_HEADS, BLOCK_HALF, BLOCK_PASS,
    )
    _rope_heads(
        k_ptr, k_out_ptr, n_k_heads, batch, tokens, token_mask,
        k_batch_stride, k_head_stride, k_token_stride,
        k_out_batch_stride, k_out_head_stride, k_out_token_stride,
        cos1, cos2, sin_first, sin_second,
        INTERLEAVED, HALF, HEAD_DIM, BLOCK_K_HEADS, BLOCK_HALF, BLOCK_PASS,
    )


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE written the obvious way in PyTorch (HF's formula): the test oracle and the fallback."""
    rot = cos.shape[-1]
    if cos.dim() == 3:  # (B, T, R) -> (B, 1, T, R), broadcast over heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if interleaved:
        cos = cos[..., : rot // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : rot // 2].repeat_interleave(2, dim=-1)

    def apply(x: torch.Tensor) -> torch.Tensor:
        x_rot = x[..., :rot]
        return torch.cat((x_rot * cos + _rotate(x_rot, interleaved) * sin, x[..., rot:]), dim=-1)

    return apply(q), apply(k)


def _cos_strides(t: torch.Tensor) -> tuple[int, int]:
    """(batch, token) strides of a (T, R) or (B, T, R) cos/sin; 0 where it broadcasts over batch."""
    if t.dim() == 2 or t.shape[0] == 1:
        return 0, t.stride(-2)
    return t.stride(0), t.stride(1)


@functools.lru_cache(maxsize=None)  # called on every launch: host time is part of a step's cost
def _launch_config(half: int, head_dim: int, n_tokens: int, n_q_heads: int, n_k_heads: int) -> tuple[int, ...]:
    """(BLOCK_HALF, BLOCK_PASS, BLOCK_Q_HEADS, BLOCK_K_HEADS, BLOCK_TOKENS, token blocks, num_warps)."""
    block_half = next_power_of_2(half)
    max_heads = max(1, TILE_ELEMENTS // block_half)
    block_q_heads = min(next_power_of_2(max(n_q_heads, 1)), max_heads)
    block_k_heads = min(next_power_of_2(max(n_k_heads, 1)), max_heads)
    # Few heads or narrow heads: take several tokens per program so each moves a full tile.
    block_tokens = min(next_power_of_2(n_tokens), max(1, max_heads // max(block_q_heads, block_k_heads)))
    # One warp per tile of up to TILE_ELEMENTS, the most loads in flight per thread: the fastest
    # of scripts/tune_rope.py's sweep on the H200 (BENCHMARKS.md).
    num_warps = max(1, block_tokens * max(block_q_heads, block_k_heads) * block_half // TILE_ELEMENTS)
    pass_dims = head_dim - 2 * half
    block_pass = next_power_of_2(pass_dims) if pass_dims else 0
    return block_half, block_pass, block_q_heads, block_k_heads, block_tokens, cdiv(n_tokens, block_tokens), num_warps


def _launch(q, k, cos, sin, q_out, k_out, interleaved, backward):
    """Rotate q into q_out and k into k_out (either pair may be None: skipped) in one launch."""
    x = q if q is not None else k
    batch, _, n_tokens, head_dim = x.shape
    half = cos.shape[-1] // 2
    n_q_heads = q.shape[1] if q is not None else 0
    n_k_heads = k.shape[1] if k is not None else 0
    # A skipped tensor gets zero heads; its pointer and strides are never used.
    q, q_out = (q, q_out) if q is not None else (k, k_out)
    k, k_out = (k, k_out) if k is not None else (q, q_out)
    block_half, block_pass, block_q_heads, block_k_heads, block_tokens, n_token_blocks, num_warps = _launch_config(
        half, head_dim, n_tokens, n_q_heads, n_k_heads
    )
    _rope_kernel[(batch * n_token_blocks,)](
        q, k, cos, sin, q_out, k_out,
        n_tokens, n_token_blocks, n_q_heads, n_k_heads,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2),
        k_out.stride(0), k_out.stride(1), k_out.stride(2),
        *_cos_strides(cos), *_cos_strides(sin),
        INTERLEAVED=interleaved,
        BACKWARD=backward,
        HALF=half,
        HEAD_DIM=head_dim,
        BLOCK_TOKENS=block_tokens,
        BLOCK_Q_HEADS=block_q_heads,
        BLOCK_K_HEADS=block_k_heads,
        BLOCK_HALF=block_half,
        BLOCK_PASS=block_pass,
        num_warps=num_warps,
    )


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    # The kernels index the last dim directly; any other layout is taken as is.
    return t if t.stride(-1) == 1 else t.contiguous()


def _outputs(q, k, cos):
    """Rotated q and k, unwritten, in the promotion of q's and cos's dtypes; empty_like keeps q's
    layout (HF passes (B, T, H, D) memory transposed to (B, H, T, D))."""
    dtype = torch.promote_types(q.dtype, cos.dtype)
    return torch.empty_like(q, dtype=dtype), torch.empty_like(k, dtype=dtype)


def rope_forward(q, k, cos, sin, interleaved):
    """``(q_embed, k_embed)`` by the kernel, outside autograd."""
    q, k = _unit_last_stride(q), _unit_last_stride(k)
    cos, sin = _unit_last_stride(cos), _unit_last_stride(sin)
    q_out, k_out = _outputs(q, k, cos)
    _launch(q, k, cos, sin, q_out, k_out, interleaved, backward=False)
    return q_out, k_out


def rope_backward(grad_q_out, grad_k_out, cos, sin, interleaved, dtype):
    """The gradients of q and k (in `dtype`; None for a None output gradient) by the kernel: the
    rotation by the transpose."""
    grad_q_out = _unit_last_stride(grad_q_out) if grad_q_out is not None else None
    grad_k_out = _unit_last_stride(grad_k_out) if grad_k_out is not None else None
    grad_q = torch.empty_like(grad_q_out, dtype=dtype) if grad_q_out is not None else None
    grad_k = torch.empty_like(grad_k_out, dtype=dtype) if grad_k_out is not None else None
    if grad_q is not None or grad_k is not None:
        _launch(grad_q_out, grad_k_out, _unit_last_stride(cos), _unit_last_stride(sin), grad_q, grad_k, interleaved, backward=True)
    return grad_q, grad_k


def _reference_point(ctx, saved):
    cos, sin = saved
    interleaved, dtype, shapes = ctx.config
    # The rotation is linear, so its gradient is the same at any point: zeros will do.
    at = [torch.zeros(shape, dtype=dtype, device=cos.device) for shape in shapes]
    return ROPE, rope_reference, (*at, cos, sin, interleaved)


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, interleaved):
        # An unused output gets no gradient (None, not zeros): its tensor is skipped in backward.
        ctx.set_materialize_grads(False)
        q_out, k_out = rope_forward(q, k, cos, sin, interleaved)
        ctx.save_for_backward(_unit_last_stride(cos), _unit_last_stride(sin))
        ctx.config = (interleaved, q.dtype, (q.shape, k.shape))
        return q_out, k_out

    @staticmethod
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_q_out, grad_k_out):
        cos, sin = saved
        interleaved, dtype, _ = ctx.config
        grad_q, grad_k = rope_backward(
            grad_q_out if ctx.needs_input_grad[0] else None, grad_k_out if ctx.needs_input_grad[1] else None,
            cos, sin, interleaved, dtype,
        )
        return grad_q, grad_k, None, None, None


def _check(q, k, cos, sin, interleaved) -> str | None:
    """Validate the arguments; return why the kernel cannot take them, if it cannot."""
    for name, t in (("q", q), ("k", k)):
        check_float(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, heads, tokens, head_dim), got {tuple(t.shape)}")
    batch, _, n_tokens, head_dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, n_tokens, head_dim):
        raise ValueError(
            f"k must have shape ({batch}, kv_heads, {n_tokens}, {head_dim}) to match q, got {tuple(k.shape)}"
        )
    if k.dtype != q.dtype:
        raise ValueError(f"k must have the dtype of q ({q.dtype}), got {k.dtype}")
    check_device("k", k, q.device)
    for name, t in (("cos", cos), ("sin", sin)):
        check_float(name, t)
        check_device(name, t, q.device)
        dims = t.dim()
        rot = t.shape[-1] if dims else 0
        if (
            dims not in (2, 3) or t.shape[-2] != n_tokens or rot % 2 or not 2 <= rot <= head_dim
            or (dims == 3 and t.shape[0] not in (1, batch))
        ):
            raise ValueError(
                f"{name} must have shape ({n_tokens}, R) or ({batch} or 1, {n_tokens}, R) with R even and "
                f"2 <= R <= {head_dim}, got {tuple(t.shape)}"
            )
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have the shape of cos {tuple(cos.shape)}, got {tuple(sin.shape)}")
    if sin.dtype != cos.dtype:
        raise ValueError(f"sin must have the dtype of cos ({cos.dtype}), got {sin.dtype}")
    if not isinstance(interleaved, bool):
        raise ValueError(f"interleaved must be True or False, got {interleaved!r}")
    if q.dtype not in KERNEL_DTYPES or cos.dtype not in KERNEL_DTYPES:
        return f"dtype {q.dtype}/{cos.dtype} runs on the reference"
    if cos.requires_grad or sin.requires_grad:
        return "cos/sin require grad, and the kernel does not compute their gradients"
    return None


# Inside torch.compile: the same launchers as library ops.
@library_op(
    "rope", "(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved) -> (Tensor, Tensor)",
    lambda q, k, cos, sin, interleaved: _outputs(_unit_last_stride(q), _unit_last_stride(k), cos),
)
def _forward_op(q, k, cos, sin, interleaved):
    return rope_forward(q, k, cos, sin, interleaved)


def _grads_or_empty(grads, cos, dtype):
    # A library op's outputs cannot be None: an empty tensor stands for a gradient not computed.
    return tuple(g if g is not None else cos.new_empty(0, dtype=dtype) for g in grads)


def _backward_fake(grad_q_out, grad_k_out, cos, sin, interleaved, dtype):
    grads = [torch.empty_like(_unit_last_stride(g), dtype=dtype) if g is not None else None for g in (grad_q_out, grad_k_out)]
    return _grads_or_empty(grads, cos, dtype)


@library_op(
    "rope_backward",
    "(Tensor? grad_q_out, Tensor? grad_k_out, Tensor cos, Tensor sin, bool interleaved, ScalarType dtype) "
    "-> (Tensor, Tensor)",
    _backward_fake,
)
def _backward_op(grad_q_out, grad_k_out, cos, sin, interleaved, dtype):
    grads = rope_backward(grad_q_out, grad_k_out, cos, sin, interleaved, dtype)
    return _grads_or_empty(grads, cos, dtype)


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, interleaved = inputs
    ctx.save_for_backward(cos, sin)
    ctx.config = (interleaved, q.dtype)


def _op_backward(ctx, grad_q_out, grad_k_out):
    cos, sin = ctx.saved_tensors
    grad_q, grad_k = _backward_op(grad_q_out, grad_k_out, cos, sin, *ctx.config)
    return grad_q if grad_q_out is not None else None, grad_k if grad_k_out is not None else None, None, None, None


_forward_op.register_autograd(_op_backward, setup_context=_setup_context)

ROPE = Op("rope", _RopeFunction.apply, rope_reference, compiled=_forward_op)



def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary position embeddings to queries and keys in one kernel launch.

    A drop-in for ``transformers``' ``apply_rotary_pos_emb(q, k, cos, sin)`` of the Llama family
    (``unsqueeze_dim=1``), with the pass-through of partial rotary built in.

    Args:
        q: ``(batch, heads, tokens, head_dim)``, float16/bfloat16/float32 (float64 runs the
            reference); any strides (HF's transposed projections are read in place, not copied).
        k: ``(batch, kv_heads, tokens, head_dim)``, same dtype and device; kv_heads may differ.
        cos, sin: ``(tokens, R)`` or ``(batch or 1, tokens, R)`` as HF's rotary embedding returns
            them, R even and ``<= head_dim``; only the first R dims of each head rotate.
        interleaved: False for the NeoX/Llama ``rotate_half`` convention, True for GPT-J/GLM
            pairs (2i, 2i + 1); see the module docstring for which cos/sin columns are read.

    Returns:
        ``(q_embed, k_embed)`` with the shapes and layouts of q and k, in the promotion of q's and
        cos's dtypes (as HF's formula gives).
    """
    return ROPE(_check(q, k, cos, sin, interleaved), q, k, cos, sin, interleaved)
