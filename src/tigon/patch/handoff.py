"""The one channel through which a patched model's forwards hand values to one another.

Some fusions compute, in one forward, what another forward will need: a decoder layer's closing
residual add runs with the next layer's input norm, so that norm's output already exists when the
norm is called; a norm made by tigon's kernel keeps its input, which the q/k/v group and the MLP
after it may save instead of the normed tensor. :func:`tigon.patch` of a model instance gives the
model one :class:`Relay`, and binds it into every forward that takes part; nothing else carries
such a value (no module-level registry, no attribute on a tensor or a module), and two patched
models never see each other's values.

What is planned once is in :class:`LayerPlan`: the norm each decoder layer's output goes through
next. What a relay holds lives for one forward at most:

``normed``
    ``(sum, norm module, that norm of the sum)``: the residual sum a fused decoder layer returns,
    formed with the add in one kernel. Written by the decoder-layer forward; taken by the norm's
    forward, or by the next layer's forward for its input norm. One at a time: the next write
    replaces it.
``normed_input``
    ``(normed tensor, NormedInput)``: the tensor a fused decoder layer passes to its attention or
    its MLP, and which tensor and weight tigon's RMSNorm made it from. Set by the decoder-layer
    forward for the duration of that call; read by the MLP (``glu_mlp``, ``lora_gated_mlp``) and the
    q/k/v group (``lora_linear_group``).
``accuracy``
    a list lent by :func:`tigon.patch.token_accuracy` for the duration of a loss: the patched
    causal-LM forward appends ``(hits, count)`` to it, 0-dim device tensors taken from the loss
    kernel's pass.

Every reader computes its value itself when the relay holds nothing for it, so a hand-off that
does not happen (a hook that replaced a tensor, a forward that stopped early) costs time, never a
different result.

Under ``torch.compile`` every hand-off is off (:func:`live`, the one place that says so): writers
do not write (nor do the work only a reader would use) and readers find nothing, so compiled code
bakes no identity test of a tensor into its guards. Compiled models run each fusion's ops unfused
across modules instead, with the same results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def live() -> bool:
    """Whether hand-offs happen here: everywhere but inside torch.compile's tracing."""
    return not torch.compiler.is_compiling()


class Relay:
    """The in-flight hand-offs of one patched model's forward (see the module docstring)."""

    __slots__ = ("normed", "normed_input", "accuracy")

    def __init__(self) -> None:
        self.normed: tuple[torch.Tensor, torch.nn.Module, torch.Tensor] | None = None
        self.normed_input: tuple[torch.Tensor, Any] | None = None
        self.accuracy: list | None = None

    def take_normed(self, x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor | None:
        """`norm`'s output for `x` if the layer before formed it, no longer held; else None."""
        if not live():
            return None
        held = self.normed
        if held is None or held[1] is not norm:
            return None
        self.normed = None
        return held[2] if held[0] is x else None

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
