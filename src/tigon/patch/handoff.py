"""The values tigon's patched forwards hand to one another, all declared here.

Some fusions compute, in one forward, what another forward will need: a decoder layer's closing
residual add runs with the next layer's input norm, so that norm's output already exists when the
norm is called; an attention's q/k/v projections run as one op, so each projection's own call
must return its part. Such a value goes through a :class:`Slot` of this module, keyed by the
identity of the object it belongs to (a tensor or a module, held weakly: an entry goes when its
key is freed). No other module of tigon sets attributes on tensors or modules to pass values; the
forwards that :func:`tigon.patch` binds are recorded by the patch itself and undone by
:func:`tigon.unpatch`.

The slots, with who writes each, who reads it, and how long a value lives:

``NEXT_NORM``
    key: a decoder layer; value: the norm module its output goes through next (the next layer's
    ``input_layernorm``, or the model's final norm). Written by :func:`tigon.patch` of a model
    instance (:mod:`tigon.patch.apply`); read by the fused decoder-layer forward
    (:func:`tigon.patch.forwards.decoder_layer_forward`). Lives until that patch is undone.
``NORMED``
    key: the residual sum a fused decoder layer returns; value: ``(norm module, that norm of the
    sum)``, formed with the add in one kernel. Written by the decoder-layer forward; taken by the
    norm's forward (:func:`~tigon.patch.forwards.rms_norm_forward`) or, for a layer's input norm, by
    the next layer's forward. Lives until taken, until the sum is freed, or until the next value is
    written: the slot holds one value at a time, so a forward that stopped between the add and the
    norm leaves nothing behind past the next step.
``NORMED_INPUT``
    key: the normed tensor a fused decoder layer passes to its MLP or its attention; value: the
    :class:`~tigon.ops.rms_norm.NormedInput` saying which tensor and weight it was normed from (by
    tigon's RMSNorm kernel). Written by the decoder-layer forward around its MLP and attention
    calls; read by the MLP forward (:func:`~tigon.patch.forwards.mlp_forward`: ``glu_mlp``,
    ``lora_gated_mlp``) and by the q/k/v group of the attention forward (``lora_linear_group``),
    which then save that input, which the norm keeps anyway, instead of the normed tensor. Lives
    for that call.
``WHOLE_SEQUENCES``
    key: position ids the causal-LM forward made for a batch of whole sequences; value: True.
    Written by :func:`~tigon.patch.forwards.causal_lm_forward` around its decoder call; read by
    :func:`~tigon.patch.forwards.packed_sequence_finder`, which then answers "no packed sequences"
    without reading the positions back from the device. Lives for that decoder call.
``PROJECTION_CALLS``
    key: a projection module (an attention's q/k/v linear, plain or PEFT LoRA); value: the
    function answering its calls and the forward it displaced. Written by :func:`answered_calls`
    for the attention forward (:func:`~tigon.patch.forwards.attention_forward`), which for the
    duration of the attention call also sets the projection's forward to :func:`_answered_forward`
    (the one forward-attribute change not made by the patch itself); read by that forward. Lives
    for the attention call.
``TOKEN_ACCURACY``
    key: the labels tensor a training step passes to a causal LM; value: a list, to which the
    patched causal-LM forward (:func:`~tigon.patch.forwards.causal_lm_forward`, either loss path)
    appends ``(hits, count)``: 0-dim device tensors, the targets its loss did not ignore that the
    model's argmax predicts, and their number, taken from the loss kernel's pass (no logits, no
    host sync). Lent by the trainer of ``tigon sft``
    (:meth:`~tigon.train.trainer.TigonTrainer.compute_loss`) around its loss; read back once per
    log as the ``accuracy`` metric. Lives for that loss call. A forward that finds no list computes
    no argmax; a run whose loss is not tigon's reports no accuracy.

Every reader computes its value itself when the slot holds nothing for it, so a hand-off that
does not happen (another thread, a hook that replaced a tensor, a forward that stopped early)
costs time, never a different result.

Under ``torch.compile`` every hand-off is off: :func:`available` is False, writers do not write
(nor do the work that only a reader would use), and every slot reads empty. Traced code would
otherwise bake lookups keyed by object identity and per-call attribute changes into guards that
fail on every call. Compiled models run each fusion's ops unfused across modules instead, with
the same results.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch

from tigon.patch.modules import forward_attr

_MISSING = object()


def available() -> bool:
    """Whether hand-offs happen here: everywhere but inside torch.compile's tracing."""
    return not torch.compiler.is_compiling()


class Slot:
    """Values keyed by the identity of a live object, each held until taken or dropped, or until
    its key is freed. `single`: holds one value at a time (a put replaces what it held)."""

    def __init__(self, name: str, *, single: bool = False) -> None:
        self.name = name
        self._single = single
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Slot({self.name!r}, {len(self)} held)"

    def put(self, key: Any, value: Any) -> None:
        if not available():
            return
        if self._single:
            self._entries.clear()
        entries, ident = self._entries, id(key)

        def forget(ref: weakref.ref) -> None:  # `key` was freed
            if entries.get(ident, (None,))[0] is ref:
                del entries[ident]

        entries[ident] = (weakref.ref(key, forget), value)

    def get(self, key: Any) -> Any:
        """The value held for `key`, or None."""
        if not available():
            return None
        entry = self._entries.get(id(key))
        return entry[1] if entry is not None and entry[0]() is key else None

    def drop(self, key: Any) -> None:
        if not available():  # nothing was put; and torch 2.11's dynamo breaks the graph at id(tensor)
            return
        entry = self._entries.get(id(key))
        if entry is not None and entry[0]() is key:
            del self._entries[id(key)]

    def take(self, key: Any) -> Any:
        """The value held for `key`, no longer held; or None."""
        value = self.get(key)
        if value is not None:
            self.drop(key)
        return value

    @contextlib.contextmanager
    def lent(self, key: Any, value: Any) -> Iterator[None]:
        """`value` held for `key` for the duration of the block."""
        self.put(key, value)
        try:
            yield
        finally:
            self.drop(key)


NEXT_NORM = Slot("next_norm")
NORMED = Slot("normed", single=True)
NORMED_INPUT = Slot("normed_input")
WHOLE_SEQUENCES = Slot("whole_sequences")
PROJECTION_CALLS = Slot("projection_calls")
TOKEN_ACCURACY = Slot("token_accuracy")
SLOTS = (NEXT_NORM, NORMED, NORMED_INPUT, WHOLE_SEQUENCES, PROJECTION_CALLS, TOKEN_ACCURACY)


def _answered_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A projection's forward while :func:`answered_calls` holds it: the answer for a call on one
    tensor, if there is one, else the forward it displaced."""
    entry = PROJECTION_CALLS.get(self)
    if entry is None:  # another thread's call, after this one's attention ended
        return type(self).forward(self, *args, **kwargs)
    answer, displaced = entry
    if len(args) == 1 and not kwargs:
        out = answer(self, args[0])
        if out is not None:
            return out
    return displaced(*args, **kwargs)


@contextlib.contextmanager
def answered_calls(modules: Iterable[torch.nn.Module], answer: Callable[[torch.nn.Module, Any], Any]) -> Iterator[None]:
    """For the duration of the block, a call of any of `modules` on one tensor returns
    ``answer(module, tensor)`` when that is not None, and runs the module's own forward otherwise.
    Hooks still run: the module is still called, only the forward its call ends in is displaced."""
    displaced: list[tuple[torch.nn.Module, str, Any]] = []
    try:
        for module in modules:
            attr = forward_attr(module)
            previous = vars(module).get(attr, _MISSING)
            own = previous if previous is not _MISSING else types.MethodType(type(module).forward, module)
            PROJECTION_CALLS.put(module, (answer, own))
            setattr(module, attr, types.MethodType(_answered_forward, module))
            displaced.append((module, attr, previous))
        yield
    finally:
        for module, attr, previous in reversed(displaced):
            PROJECTION_CALLS.drop(module)
            if previous is _MISSING:
                delattr(module, attr)
            else:
                setattr(module, attr, previous)
