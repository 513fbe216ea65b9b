"""The one channel through which a patched model's forwards hand values to one another, and the
questions asked anew on each call.

A decoder layer's closing residual add runs with the next layer's input norm, so that norm's output
exists before the norm is called; a norm made by tigon's kernel keeps its input, which the q/k/v
group and the MLP may save instead of the normed tensor. :func:`tigon.patch` gives each model one
:class:`Relay`, bound into every forward that takes part, and each decoder layer a
:class:`LayerPlan` (decided once: the norm its output goes through next). Nothing else carries such
a value, and two patched models never see each other's. A relay holds, for one forward at most:

``normed``
    ``(sum, norm module, that norm of the sum)``, from a fused layer's closing add; taken by that
    norm's forward or the next layer's. The next write replaces it.
``normed_input``
    ``(normed tensor, NormedInput)`` while a fused layer calls its attention or MLP: which tensor
    and weight tigon's RMSNorm made it from (read by ``glu_mlp``, ``lora_gated_mlp``,
    ``lora_linear_group``).
``discarded``
    the input of the call whose output a decoder layer will not read: its MLP's, while the layer
    is :func:`replaying` and adds that output to the residual stream and nothing else. The MLP may
    skip what only its output needs (``lora_gated_mlp``'s down projection GEMMs).
``accuracy``
    a list lent by :func:`tigon.patch.token_accuracy` for one loss, to which the causal-LM forward
    appends ``(hits, count)`` from the loss kernel's pass.
``segments``
    the last two ``(cu_seqlens, lengths)`` a vision tower's attention read: the boundaries of the
    images packed into its sequence, and their lengths as host integers. Every block of one tower
    forward is given the same ``cu_seqlens`` tensor; the first block reads it to the host (a
    device sync), the others find it here. (Qwen2.5-VL alternates two: windows and whole images.)

A reader finding nothing computes the value itself: a hand-off that does not happen costs time,
never a different result.

What varies from call to call is asked here, and nowhere else on this floor:

* :func:`live`: not in torch.compile's tracing, where every hand-off is off (no identity test of a
  tensor baked into guards; each fusion's ops run unfused across modules, with the same results).
* :func:`recomputing`: a layer under gradient checkpointing, whose replay in backward must save
  what its first pass saved: nothing may cross to the next layer. :func:`replaying`: this call is
  that replay.
* :func:`sharded`: a distributed run, where FSDP gathers a layer's weights for its own forward only.
* :func:`capturing`: a CUDA-graph capture (the ops that keep buffers ask :func:`tigon.ops.capturing`).

Whether a module's weights may be read without calling it (hooks, ZeRO-3) is
:func:`~tigon.patch.modules.readable`'s to say; whether a LoRA adapter is active, :mod:`~tigon.patch.lora`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tigon import ops


def live() -> bool:
    """Whether hand-offs happen here: everywhere but inside torch.compile's tracing."""
    return not torch.compiler.is_compiling()


def recomputing(layer: torch.nn.Module) -> bool:
    """Whether `layer` trains under gradient checkpointing. (Reentrant checkpointing runs the first
    pass without grad mode: the flags are what say it.)"""
    return bool(getattr(layer, "gradient_checkpointing", False)) and layer.training


def replaying(layer: torch.nn.Module) -> bool:
    """Whether this call of `layer` is gradient checkpointing's replay of its forward in backward:
    a layer that trains under checkpointing, called while autograd runs a backward pass (torch's
    checkpointing, reentrant or not, replays there). The replay is run for what its ops save;
    torch throws its outputs away."""
    return recomputing(layer) and torch._C._current_graph_task_id() != -1


def sharded() -> bool:
    """Whether this is a distributed run (FSDP or DDP process group initialised)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return ops.capturing()


class Relay:
    """The in-flight hand-offs of one patched model's forward (see the module docstring)."""

    __slots__ = ("normed", "normed_input", "discarded", "accuracy", "segments")

    def __init__(self) -> None:
        self.normed: tuple[torch.Tensor, torch.nn.Module, torch.Tensor] | None = None
        self.normed_input: tuple[torch.Tensor, Any] | None = None
        self.discarded: torch.Tensor | None = None
        self.accuracy: list | None = None
        self.segments: tuple[tuple[torch.Tensor, list[int]], ...] = ()

    def take_normed(self, x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor | None:
        """`norm`'s output for `x` if the layer before formed it, no longer held; else None."""
        if not live():
            return None
        held = self.normed
        if held is None or held[1] is not norm:
            return None
        self.normed = None
        return held[2] if held[0] is x else None

    def segment_lengths(self, cu_seqlens: torch.Tensor) -> list[int]:
        """The lengths of the segments `cu_seqlens` bounds, as host integers: read from the device
        once per tensor (the two last kept)."""
        for held, lengths in self.segments:
            if held is cu_seqlens:
                return lengths
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        self.segments = ((cu_seqlens, lengths), *self.segments[:1])
        return lengths

    def discards_output_of(self, x: torch.Tensor) -> bool:
        """Whether the layer passing `x` to a sublayer will not read that sublayer's output."""
        return live() and self.discarded is x

    def normed_input_of(self, x: torch.Tensor) -> Any:
        """The NormedInput `x` was made from, if the layer passing it said so; else None."""
        if not live():
            return None
        held = self.normed_input
        return held[1] if held is not None and held[0] is x else None


@dataclass(eq=False)
class LayerPlan:
    """What one decoder layer's forward was planned to do across its own modules.

    Attributes:
        relay: the model's relay.
        next_norm: the norm the layer's output goes through next (the following layer's input
            norm, or the model's final norm), with which its closing residual add runs in one
            kernel; None: the add runs alone.
    """

    relay: Relay | None = None
    next_norm: torch.nn.Module | None = None
