"""Activation offload for gradient checkpointing: the hidden states it keeps wait in host memory.

Under gradient checkpointing a decoder keeps, per layer, only the layer's input hidden states
(tokens x hidden); at long sequence lengths those add up to the largest thing left on the GPU.
:class:`ActivationOffload` catches them as autograd saves them (``saved_tensors_hooks``, which see
the inputs of both reentrant and non-reentrant ``torch.utils.checkpoint``), copies each one to
pinned host memory on a side stream while the forward goes on, and in backward copies it back on
that stream one layer ahead of need: unpacking layer k's input starts the copy of layer k-1's, which
then overlaps layer k's recomputation and backward. The bytes are the same, so loss and gradients
are exactly those without offload.

Tensors on the CPU (a machine without GPU) are copied to plain CPU memory instead, with no streams:
nothing is saved, but the same bookkeeping runs, so it can be tested anywhere.

``tigon.patch(model, offload_activations=True)`` wraps the ``*ForCausalLM`` forward in it, on while
training with gradient checkpointing on; `tigon embed`, which runs the decoder without its LM
head, opens :func:`offload_scope` around each forward itself.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable

import torch

from tigon.patch.handoff import recomputing


class _Stored:
    """One offloaded tensor: its host copy and, once fetched, the device copy and its ready event.

    It is what autograd keeps for the saved tensor, so the host copy lives exactly as long as the
    graph needs it: freed back to the pinned-memory cache when backward releases the graph, for the
    next step to reuse (a fresh pinned allocation per step costs seconds at long context)."""

    __slots__ = ("host", "device", "index", "fetched", "ready", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, index: int) -> None:
        self.host = host
        self.device = device
        self.index = index
        self.fetched: torch.Tensor | None = None
        self.ready: Any = None


class ActivationOffload:
    """Context manager offloading the hidden states saved for backward inside it.

    Args:
        hidden_size: the model width; a saved tensor is offloaded when it is shaped like the hidden
            states: floating point, last dimension `hidden_size` and `tokens` rows, not a
            parameter. Weights and small tensors (RoPE tables, norm statistics) stay put.
        tokens: tokens in the batch (batch x sequence).

    ``offloaded`` counts the tensors sent to the host so far, ``held`` those whose host copy is
    still alive (backward frees each once autograd releases the graph).
    """

    def __init__(self, hidden_size: int, tokens: int) -> None:
        if hidden_size < 1 or tokens < 1:
            raise ValueError(f"hidden_size and tokens must be >= 1, got {hidden_size} and {tokens}")
        self.hidden_size = hidden_size
        self.tokens = tokens
        self.offloaded = 0
        # Weak: the saved-tensor slots own the copies; this only finds the one to prefetch next.
        self._stored: list[weakref.ref[_Stored]] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> "ActivationOffload":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    @property
    def held(self) -> int:
        return sum(ref() is not None for ref in self._stored)

    def _wanted(self, tensor: torch.Tensor) -> bool:
        return (
            tensor.is_floating_point()
            and not isinstance(tensor, torch.nn.Parameter)
            and tensor.dim() >= 2
            and tensor.shape[-1] == self.hidden_size
            and tensor.numel() == self.tokens * self.hidden_size
        )

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _pack(self, tensor: torch.Tensor) -> Any:
        if not self._wanted(tensor):
            return tensor
        index = len(self._stored)
        if tensor.device.type != "cuda":
            stored = _Stored(tensor.detach().to("cpu", copy=True), tensor.device, index)
        else:
            stream = self._stream(tensor.device)
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is computed
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
            # The caller may free `tensor` now; its memory must not be reused before the copy ends.
            tensor.record_stream(stream)
            stored = _Stored(host, tensor.device, index)
        self._stored.append(weakref.ref(stored))
        self.offloaded += 1
        return stored

    def _fetch(self, stored: _Stored) -> None:
        if stored.fetched is not None:
            return
        if stored.device.type != "cuda":
            stored.fetched = stored.host.to(stored.device, copy=True)
            return
        stream = self._stream(stored.device)
        # The copy's destination may be memory the compute stream has just freed.
        stream.wait_stream(torch.cuda.current_stream(stored.device))
        with torch.cuda.stream(stream):
            stored.fetched = stored.host.to(stored.device, non_blocking=True)
            stored.ready = stream.record_event()

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        stored = packed
        self._fetch(stored)
        tensor, ready = stored.fetched, stored.ready
        # Not kept: the tensor is freed when autograd is done with it (a second backward refetches).
        stored.fetched = stored.ready = None
        if ready is not None:
            current = torch.cuda.current_stream(stored.device)
            current.wait_event(ready)
            tensor.record_stream(current)
        previous = self._stored[stored.index - 1]() if stored.index > 0 else None
        if previous is not None:
            # Backward unpacks in reverse order of saving: the previous layer's input is next.
            self._fetch(previous)
        return tensor


def _tokens(args: tuple, kwargs: dict) -> int | None:
    input_ids = args[0] if args else kwargs.get("input_ids")
    if input_ids is not None:
        return input_ids.numel()
    embeds = kwargs.get("inputs_embeds")
    return None if embeds is None else embeds.shape[:-1].numel()


def checkpointed(model: torch.nn.Module) -> bool:
    """Whether a forward of `model` now trains under gradient checkpointing (grad enabled, a module
    recomputing)."""
    return torch.is_grad_enabled() and any(recomputing(module) for module in model.modules())


def offload_scope(model: torch.nn.Module, tokens: int | None) -> Any:
    """:class:`ActivationOffload` for a forward of `model` over `tokens` tokens when it trains with
    gradient checkpointing on (:func:`checkpointed`); a no-op context otherwise."""
    if tokens and checkpointed(model):
        return ActivationOffload(model.config.get_text_config().hidden_size, tokens)
    return contextlib.nullcontext()


def offloaded_forward(inner: Callable[..., Any]) -> Callable[..., Any]:
    """A ``*ForCausalLM`` forward running ``inner`` inside :func:`offload_scope`; its signature is
    `inner`'s."""

    @functools.wraps(inner)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        with offload_scope(self, _tokens(args, kwargs)):
            return inner(self, *args, **kwargs)

    return forward
