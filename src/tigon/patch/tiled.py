"""Sequence-tiled MLP: the MLP run over chunks of tokens, for long-context training.

A gated MLP's ``gate``, ``up`` and ``act(gate) * up`` are tokens x intermediate each, 3.5x-4x the
size of the hidden states; at long sequence lengths they are the peak of every layer's forward and
of its recomputation under gradient checkpointing. :func:`tiled_mlp` runs the MLP one chunk of
tokens at a time without keeping anything but its input for backward, and in backward recomputes
each chunk and takes its gradients before moving to the next, so those tensors only ever exist for
one chunk. The MLP is token-wise, so the result and every gradient are those of the whole-sequence
MLP (weight gradients are summed over chunks in at least fp32).

``tigon.patch(model, tiled_mlp=True)`` wraps the family's MLP module (tigon's fused one or Hugging
Face's) in it.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import torch


# Chunks of this many times the width: big enough that the per-chunk work (recomputation, its
# autograd call, many small LoRA kernels) is not dominated by launching it, still a small fraction
# of a long sequence (8192 of 262144 tokens for a 2048-wide model).
CHUNK_WIDTHS = 4


def chunk_size(tokens: int, hidden: int) -> int:
    """Tokens per chunk for an MLP of width `hidden` over `tokens` tokens.

    About ``CHUNK_WIDTHS * hidden`` tokens, balanced so the chunks are equal to within one token:
    each chunk's intermediates then hold ``CHUNK_WIDTHS x hidden x intermediate`` elements apiece,
    a few weight matrices' worth, whatever the sequence length.
    """
    if tokens < 1 or hidden < 1:
        raise ValueError(f"tokens and hidden must be >= 1, got {tokens} and {hidden}")
    chunks = math.ceil(tokens / (CHUNK_WIDTHS * hidden))
    return math.ceil(tokens / chunks)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@functools.lru_cache(maxsize=None)
def _fork_devices(device: torch.device) -> tuple[torch.device, ...]:
    return (device,) if device.type == "cuda" else ()


class _TiledFunction(torch.autograd.Function):
    # custom_fwd/custom_bwd: the backward's recomputation runs under the forward's autocast state.
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, forward, chunk, x, *params):
        rows = x.reshape(-1, x.shape[-1])
        out, states = None, []
        for start in range(0, rows.shape[0], chunk):
            # Dropout inside the MLP (LoRA's) must draw the same masks when backward recomputes.
            states.append(_rng_state(x.device))
            piece = forward(rows[start:start + chunk].unsqueeze(0)).squeeze(0)
            if out is None:  # written chunk by chunk: no second whole-sequence copy from a cat
                out = piece.new_empty(rows.shape[0], piece.shape[-1])
            out[start:start + chunk] = piece
        ctx.save_for_backward(x, *params)
        ctx.forward, ctx.chunk, ctx.states = forward, chunk, states
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_out):
        x, *params = ctx.saved_tensors
        needs_x, needs_params = ctx.needs_input_grad[2], ctx.needs_input_grad[3:]
        rows = x.reshape(-1, x.shape[-1])
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])
        wanted = [p for p, needed in zip(params, needs_params) if needed]
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        grad_x = torch.empty_like(rows) if needs_x else None
        for index, start in enumerate(range(0, rows.shape[0], ctx.chunk)):
            stop = min(start + ctx.chunk, rows.shape[0])
            piece = rows[start:stop].detach().requires_grad_(needs_x)
            cpu_state, cuda_state = ctx.states[index]
            with torch.random.fork_rng(_fork_devices(x.device)), torch.enable_grad():
                torch.set_rng_state(cpu_state)
                if cuda_state is not None:
                    torch.cuda.set_rng_state(cuda_state, x.device)
                out = ctx.forward(piece.unsqueeze(0)).squeeze(0)
            inputs = ([piece] if needs_x else []) + wanted
            grads = list(torch.autograd.grad(out, inputs, grad_rows[start:stop], allow_unused=True))
            if needs_x:
                grad_x[start:stop] = grads.pop(0)
            for i, grad in enumerate(grads):
                if grad is None:
                    continue
                if sums[i] is None:
                    sums[i] = grad.to(torch.promote_types(grad.dtype, torch.float32), copy=True)
                else:
                    sums[i].add_(grad)
        grad_params = iter(None if s is None else s.to(p.dtype) for s, p in zip(sums, wanted))
        return (
            None, None, None if grad_x is None else grad_x.view(x.shape),
            *(next(grad_params) if needed else None for needed in needs_params),
        )


def tiled_mlp(
    forward: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    params: Sequence[torch.Tensor],
    *,
    chunk: int | None = None,
) -> torch.Tensor:
    """``forward(x)`` for a token-wise `forward`, computed over chunks of tokens.

    Only `x` is kept for backward; backward recomputes ``forward`` one chunk at a time (with the
    forward's RNG state, so dropout repeats) and returns the gradients of `x` and of `params`.

    Args:
        forward: maps ``(1, n, hidden)`` to ``(1, n, out)`` token by token (an MLP module's forward).
        x: ``(..., hidden)`` input.
        params: every tensor requiring grad that `forward` reads (the module's trainable
            parameters); their gradients flow through autograd as usual.
        chunk: tokens per chunk; default :func:`chunk_size` of the token count and `x`'s width.

    Returns:
        ``(..., out)``. With one chunk or fewer tokens, just ``forward(x)``.
    """
    tokens = x.numel() // max(x.shape[-1], 1) if x.dim() else 0
    if chunk is None:
        chunk = chunk_size(tokens, x.shape[-1]) if tokens else 1
    elif chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if tokens <= chunk:
        return forward(x)
    return _TiledFunction.apply(forward, chunk, x, *params)


def tiled_forward(inner: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """An MLP module forward that runs ``inner(module, x)`` through :func:`tiled_mlp`, with the
    module's trainable parameters."""

    def forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        params = [p for p in self.parameters() if p.requires_grad]
        return tiled_mlp(functools.partial(inner, self), x, params)

    forward.__qualname__ = f"tigon_tiled.{getattr(inner, '__qualname__', 'forward')}"
    return forward
