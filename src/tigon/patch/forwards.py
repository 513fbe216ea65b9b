"""The forwards tigon puts in place of Hugging Face's inside a decoder: its norms, decoder layers,
MLPs and attention inputs (the rotary function is :mod:`tigon.patch.rope`'s, the causal LM's head
and loss :mod:`tigon.patch.head`'s).

A forward reads only the attributes the HF module already has, so it can be bound to a live module
(instance patching) or set on the class (class patching) alike. The forwards whose fusions reach
across modules are made for a :class:`~tigon.patch.handoff.LayerPlan` (its relay, and for a decoder
layer the norm after it) and read what crosses modules from it alone.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Callable, Iterator, Sequence

import torch

from tigon import functional as F
from tigon.nn.activations import glu, glu_kind
from tigon.ops import autocast_dtype
from tigon.ops.rms_norm import NormedInput
from tigon.patch import lora
from tigon.patch.families import MLP, Attention, Layer, Norm
from tigon.patch.handoff import LayerPlan, live, recomputing, replaying, sharded
from tigon.patch.modules import forward_attr, has_hooks, module_activation, plain_linear, readable, zero3_partitioned


def norm_eps(norm: Norm, module: torch.nn.Module) -> float:
    """`module`'s epsilon: the value the module hard-codes, or the attribute the table names (the
    first of its names the module has)."""
    if isinstance(norm.eps, float):
        return norm.eps
    names = (norm.eps,) if isinstance(norm.eps, str) else norm.eps
    for name in names[:-1]:
        if hasattr(module, name):
            return getattr(module, name)
    return getattr(module, names[-1])


def rms_norm_forward(
    norm: Norm, plan: LayerPlan | None = None
) -> Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]:
    """Forward for an HF RMSNorm module: its `weight` (if it has one) and epsilon through
    :func:`tigon.functional.rms_norm`, or the output the layer before formed with its add
    (`plan`'s relay)."""
    relay = plan.relay if plan is not None else None

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = relay.take_normed(hidden_states, self) if relay is not None else None
        if normed is not None:
            return normed
        # (Gemma 4 builds some modules of its norm class without a weight.)
        weight = getattr(self, "weight", None) if norm.weight else None
        return F.rms_norm(hidden_states, weight, norm_eps(norm, self), offset=norm.offset, casting=norm.casting)

    forward.__qualname__ = f"tigon_{norm.cls}.forward"
    return forward


@functools.lru_cache(maxsize=None)
def layer_norm_forward(
    norm: Norm, original: Callable[..., torch.Tensor]
) -> Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]:
    """Forward for a LayerNorm module: its weight, bias and epsilon through
    :func:`tigon.functional.layer_norm` (which computes in float32 and rounds once), where that is
    what `original` computes; else `original` runs.

    torch's ``nn.LayerNorm``: under CUDA autocast in float32, as autocast runs torch's there; under
    another device's autocast (which keeps the input's dtype), and for a LayerNorm over more than
    the last dim, `original`. A family's float32 LayerNorm (OLMo's, Cohere's) rounds to the input's
    dtype under autocast too; one with a weight per head (Cohere's QK norms) runs `original`. A
    subclass of torch's that follows autocast (Nemotron's, scaled by ``offset + weight``) runs
    `original` under autocast.
    """

    def forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        weight = getattr(self, "weight", None) if norm.weight else None
        if weight is not None and weight.dim() != 1:
            return original(self, x)
        autocast = autocast_dtype(x) is not None
        if norm.casting != "float32" and (
            len(self.normalized_shape) != 1 or (autocast and (x.device.type != "cuda" or norm.casting == "torch"))
        ):
            return original(self, x)
        if weight is not None and norm.offset:
            weight = weight + norm.offset
        bias = getattr(self, "bias", None)
        if autocast and norm.casting != "float32":
            x, weight, bias = (None if t is None else t.float() for t in (x, weight, bias))
        return F.layer_norm(x, weight, bias, norm_eps(norm, self))

    forward.__qualname__ = f"tigon_{norm.cls.rpartition('.')[2]}.forward"
    return forward


def _summands(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` and `residual` in the dtype ``residual + x`` would have, so a fused sum is the unfused one."""
    if x.dtype == residual.dtype:
        return x, residual
    dtype = torch.promote_types(x.dtype, residual.dtype)
    return x.to(dtype), residual.to(dtype)


def _add_norm(
    norm: Norm, module: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor, mlp_weights: tuple | None = None,
    activation: str | None = None, recompute: bool = False, discarded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(module(residual + x), residual + x)`` in one kernel; with `mlp_weights`, the gated MLP of
    that norm's output instead of the norm's output, as one op (which, if `discarded`, forms only
    what it keeps for backward: its output is not read)."""
    x, residual = _summands(x, residual)
    eps = norm_eps(norm, module)
    if mlp_weights is None:
        return F.add_rms_norm(x, residual, module.weight, eps, offset=norm.offset, casting=norm.casting)
    return F.add_rms_norm_glu_mlp(x, residual, module.weight, eps, *mlp_weights, offset=norm.offset,
                                  casting=norm.casting, activation=activation, recompute=recompute,
                                  output_discarded=discarded)


def _normed_from(norm: Norm, module: torch.nn.Module, source: torch.Tensor) -> NormedInput:
    """What says that a tensor is `module`'s norm of `source` (a relay's ``normed_input``)."""
    weight = getattr(module, "weight", None) if norm.weight else None  # as rms_norm_forward reads it
    return NormedInput(source, weight, float(norm_eps(norm, module)), norm.offset, norm.casting)


def _calls_only(module: torch.nn.Module, forward: Callable[..., Any]) -> bool:
    """Whether calling `module` runs a forward made as `forward` was (bound to it by tigon.patch,
    or its class's) and nothing else."""
    bound = vars(module).get(forward_attr(module))
    own = getattr(bound, "__func__", None) if bound is not None else getattr(type(module), "forward", None)
    return getattr(own, "__code__", None) is forward.__code__ and not has_hooks(module, own_forward=forward)


def _next_norm(
    plan: LayerPlan, layer: torch.nn.Module, residual: torch.Tensor, norm_forward: Callable[..., Any]
) -> torch.nn.Module | None:
    """The norm `plan` says `layer`'s output goes through next, if its add can be fused with it
    on this call (:mod:`~tigon.patch.handoff`'s per-call questions): not while recomputing, nor
    in a distributed run, nor into a norm that is not :func:`readable` or on another device."""
    norm_module = plan.next_norm
    if norm_module is None or not live() or sharded() or recomputing(layer):
        return None
    if not readable(norm_module, norm_forward) or norm_module.weight.device != residual.device:
        return None
    return norm_module


def decoder_layer_forward(
    layer: Layer,
    norm: Norm,
    original: Callable[..., torch.Tensor],
    mlp: MLP | None = None,
    patched_mlp_forward: Callable[..., torch.Tensor] | None = None,
    recompute_mlp: bool = False,
    plan: LayerPlan | None = None,
) -> Callable[..., torch.Tensor]:
    """Forward for an HF decoder layer with its residual add and following RMSNorm fused.

    The same module calls in the same order as `original`, so outputs, hooks and gradient
    checkpointing are unchanged. Every argument but the hidden states reaches the token mixer (the
    attention, or a hybrid layer's linear attention) by keyword as HF passes it; a positional one
    sends the call to `original`, and so does a norm the fused add may not read.

    With `mlp` (the family's gated MLP, running `patched_mlp_forward`), a plain-linear MLP joins the
    add + RMSNorm before it in one op (:func:`tigon.functional.add_rms_norm_glu_mlp`), which with
    `recompute_mlp` keeps neither gate nor up for backward. With `plan`: the closing add runs with
    ``plan.next_norm``, its output left on the relay; the input norm's output is lent on the relay
    to the attention and the MLP, which may then save the norm's input instead.
    """
    plan = plan if plan is not None else LayerPlan()
    relay = plan.relay
    sandwich = layer.fuse == "sandwich"
    input_norm, fused_norm = layer.norms[0], layer.norms[2 if sandwich else 1]
    norm_forward = rms_norm_forward(norm)  # the norms' own forward when tigon patched them: not a hook

    # The MLP's output goes straight to the residual add: no post-norm, dropout or scale reads it.
    plain_second_branch = not sandwich and layer.dropout is None and layer.scale is None and (
        mlp is None or mlp.dropout is None)

    def branch(self: torch.nn.Module, out: torch.Tensor, index: int) -> torch.Tensor:
        if sandwich:
            return getattr(self, layer.norms[1 + 2 * index])(out)
        if layer.dropout is not None:
            out = getattr(self, layer.dropout[index])(out)
        if layer.scale is not None:
            out = out * getattr(self, layer.scale)
        return out

    # Newer transformers checkpoint a layer in a wrapper around its class's `forward` instead of in
    # `__call__`. A forward installed by tigon replaces that wrapper, so it checkpoints itself, and
    # falls back to the function inside the wrapper so as not to checkpoint twice.
    checkpoints_in_forward = _hf_checkpoints_in_forward()
    wrapped_by_hf = getattr(original, "__code__", None) is not None and original.__code__.co_name == "forward_with_checkpointing"
    inner = original.__wrapped__ if checkpoints_in_forward and wrapped_by_hf else original

    def _fusable_mlp(module: torch.nn.Module) -> tuple[tuple | None, str | None]:
        """(weights, activation) of the layer's MLP if it can join the add + RMSNorm before it."""
        if (
            mlp is None
            or mlp.multipliers is not None
            or type(module).__name__ != mlp.cls  # a mixture-of-experts block in the MLP's place
            or has_hooks(module, own_forward=patched_mlp_forward)
        ):
            return None, None
        activation = mlp_activation(mlp, module)
        weights = _glu_mlp_weights(mlp, module) if activation is not None else None
        return weights, activation

    def mixer(self: torch.nn.Module) -> torch.nn.Module:
        return next(getattr(self, name) for name in layer.mixers if hasattr(self, name))

    def lent(
        x: torch.Tensor, made_from: NormedInput | None, call: Callable[[], Any], discarded: bool = False
    ) -> torch.Tensor:
        """``call()``'s hidden states, while the relay says which input tigon's norm kernel made `x`
        from (`made_from`; None: nothing to say) and, if `discarded`, that the layer will not read
        what the call returns."""
        if made_from is None and not discarded:
            return _first(call())
        relay.normed_input = None if made_from is None else (x, made_from)
        relay.discarded = x if discarded else None
        try:
            return _first(call())
        finally:
            relay.normed_input = relay.discarded = None

    def fused(self: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        first_norm = getattr(self, input_norm)
        handing = relay is not None and live()
        normed = relay.take_normed(hidden_states, first_norm) if handing else None
        norm_module = getattr(self, fused_norm)
        # The fused add reads the norm's weight without calling it: a norm it may not read runs in
        # the original layer, as a module call.
        if args or not readable(norm_module, norm_forward):
            return inner(self, hidden_states, *args, **kwargs)
        residual = hidden_states
        # Made by tigon's kernel (the previous layer's add, or this norm's own forward) from the
        # layer's input: the q/k/v projections may save that input, which the norm keeps anyway.
        made_by_kernel = handing and (normed is not None or _calls_only(first_norm, norm_forward))
        if normed is None:
            normed = first_norm(hidden_states)
        made_from = _normed_from(norm, first_norm, hidden_states) if made_by_kernel else None
        hidden_states = branch(self, lent(normed, made_from, lambda: mixer(self)(hidden_states=normed, **kwargs)), 0)
        feed_forward = getattr(self, layer.feed_forward)
        weights, activation = _fusable_mlp(feed_forward)
        # Replayed, the layer only adds the MLP's output to the residual stream, whose sum torch
        # throws away: what the MLP saves is all that counts (unless a hook reads the output).
        discarded = (handing and plain_second_branch and replaying(self)
                     and not has_hooks(feed_forward, own_forward=patched_mlp_forward))
        if weights is not None:
            hidden_states, residual = _add_norm(norm, norm_module, hidden_states, residual, weights, activation,
                                                recompute_mlp, discarded)
            hidden_states = mlp_dropout(mlp, feed_forward, hidden_states)
        else:
            normed, residual = _add_norm(norm, norm_module, hidden_states, residual)
            made_from = _normed_from(norm, norm_module, residual) if handing else None
            hidden_states = lent(normed, made_from, lambda: feed_forward(normed), discarded)
        # (Llama 4's expert block returns its output flattened to tokens x hidden.)
        out = branch(self, hidden_states, 1).view(residual.shape)
        next_norm = _next_norm(plan, self, residual, norm_forward) if handing else None
        if next_norm is None:
            return residual + out
        normed, total = _add_norm(norm, next_norm, out, residual)
        relay.normed = (total, next_norm, normed)
        return total

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if checkpoints_in_forward and recomputing(self) and torch.is_grad_enabled():
            kwargs["use_cache"] = False  # as HF's wrapper: a replayed layer must not write the cache again
            return self._gradient_checkpointing_func(functools.partial(fused, self, **kwargs), hidden_states, *args)
        return fused(self, hidden_states, *args, **kwargs)

    forward.__qualname__ = f"tigon_{layer.cls}.forward"
    return forward


def _first(out: Any) -> torch.Tensor:
    """A sublayer's hidden states: its output, or the first element of the tuple it returns
    (attention weights, router scores or logits follow)."""
    return out[0] if isinstance(out, tuple) else out


def mlp_dropout(mlp: MLP | None, module: torch.nn.Module, out: torch.Tensor) -> torch.Tensor:
    """`out` after the dropout an MLP applies to its output (Seed-OSS), as its forward does."""
    if mlp is None or mlp.dropout is None:
        return out
    return torch.nn.functional.dropout(out, p=getattr(module, mlp.dropout), training=module.training)


def _hf_checkpoints_in_forward() -> bool:
    """Whether this transformers checkpoints GradientCheckpointingLayer in a wrapper around the
    class's `forward` (newer releases) rather than in its `__call__` (5.17 and earlier)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return "__call__" not in GradientCheckpointingLayer.__dict__


def mlp_activation(mlp: MLP, module: torch.nn.Module) -> str | None:
    """The op's name for `module`'s activation when it is one of `mlp.switch`'s and has no hooks
    (a fused op does not call it) and no sparsity cuts the gate before it, else None."""
    # (A module without the attribute, from a transformers that renamed it, may be sparse.)
    if mlp.sparsity is not None and getattr(module, mlp.sparsity, True):
        return None
    act = getattr(module, mlp.act)
    activation = module_activation(act)
    if activation is None or glu_kind(activation) != mlp.switch or has_hooks(act):
        return None
    return activation


def _glu_mlp_weights(mlp: MLP, module: torch.nn.Module) -> tuple | None:
    """(gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias) of a gated MLP whose
    projections are plain linears, which glu_mlp may read directly; None otherwise."""
    linears = [getattr(module, name) for name in mlp.projections]
    if not all(plain_linear(linear) for linear in linears):
        return None
    if mlp.packed:
        gate_up, down = linears
        gate_w, up_w = gate_up.weight.chunk(2, dim=0)
        gate_b, up_b = (None, None) if gate_up.bias is None else gate_up.bias.chunk(2)
        return gate_w, up_w, down.weight, gate_b, up_b, down.bias
    gate, up, down = linears
    return gate.weight, up.weight, down.weight, gate.bias, up.bias, down.bias


def _lora_projections(layers: Sequence[torch.nn.Module], x: torch.Tensor) -> list | None:
    """The fused-path weights of PEFT LoRA linears on input `x`; None unless every one qualifies
    (:func:`tigon.patch.lora.projection`)."""
    weights = [lora.projection(layer, x) for layer in layers]
    return weights if all(w is not None for w in weights) else None


def mlp_forward(
    mlp: MLP,
    original: Callable[..., torch.Tensor],
    glu_ops: bool,
    lora_forward: Callable[..., Any] | None = None,
    linear_forward: Callable[..., Any] | None = None,
    recompute: bool = False,
    plan: LayerPlan | None = None,
) -> Callable[..., torch.Tensor]:
    """Forward for an HF gated MLP whose activation is one of `mlp.switch`'s (else `original` runs).

    With `lora_forward` (PEFT LoRA linears run it; not for a packed gate_up_proj): gate, up and
    down projections that are such qualifying linears, with no hooks, run as one
    :func:`tigon.functional.lora_gated_mlp`. `linear_forward` is the forward tigon.patch binds to
    PEFT's LoRA linears (it is not a hook) even where the MLP does not fuse them.
    With `glu_ops`: projections that are plain linears run as one :func:`tigon.functional.glu_mlp`
    (saves less for backward), others (LoRA, quantised) their own forwards around
    :func:`tigon.functional.swiglu` / :func:`~tigon.functional.geglu`, and so does an MLP with
    multipliers (Falcon-H1): the GLU op scales the gate before the activation, and the output
    too where the down projection is linear in its input (:func:`scales_through`), else the
    down projection's output is scaled after it, as the MLP's forward does. Anything else runs
    `original`. With `recompute` (the recompute_mlp switch), the one-op MLPs keep neither gate nor
    up for backward, which forms them again. The one-op MLPs save the norm's input instead of `x`
    where `plan`'s relay says which input tigon's norm kernel made `x` from.
    """
    relay = plan.relay if plan is not None else None

    def scales_through(down: torch.nn.Module) -> bool:
        """Whether ``down(y * m)`` is ``down(y) * m`` up to rounding, so that the down multiplier
        can join the GLU op: a bias-free nn.Linear, or a qualifying PEFT LoRA linear on one, with
        nothing that calling it would run besides (a hook would see the scaled input)."""
        if getattr(down, "bias", None) is not None or has_hooks(down, own_forward=linear_forward):
            return False
        if type(down) is torch.nn.Linear:
            return True
        return linear_forward is not None and lora.runs(down, linear_forward) and lora.active_adapter(down)[0] is not None

    def projected(self: torch.nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor:
        if mlp.packed:
            gate, up = getattr(self, mlp.projections[0])(x).chunk(2, dim=-1)
        else:
            gate, up = getattr(self, mlp.projections[0])(x), getattr(self, mlp.projections[1])(x)
        down = getattr(self, mlp.projections[-1])
        if mlp.multipliers is None:
            return down(glu(activation, gate, up))
        gate_multiplier, down_multiplier = (getattr(self, name) for name in mlp.multipliers)
        if scales_through(down):
            return down(glu(activation, gate, up, gate_multiplier, down_multiplier))
        return down(glu(activation, gate, up, gate_multiplier)) * down_multiplier

    def computed(self: torch.nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        discarded = relay is not None and relay.discards_output_of(x)
        if lora_forward is not None and mlp.multipliers is None:
            layers = [getattr(self, name) for name in mlp.projections]
            if all(lora.runs(layer, lora_forward) and not has_hooks(layer, own_forward=lora_forward) for layer in layers):
                projections = _lora_projections(layers, x)
                if projections is not None:
                    return F.lora_gated_mlp(x, *projections, activation=activation, recompute=recompute,
                                            normed_input=relay and relay.normed_input_of(x),
                                            output_discarded=discarded)
        if not glu_ops:
            return None
        weights = _glu_mlp_weights(mlp, self) if mlp.multipliers is None else None
        if weights is not None:
            return F.glu_mlp(x, *weights, activation=activation, normed_input=relay and relay.normed_input_of(x),
                             recompute=recompute, output_discarded=discarded)
        return projected(self, x, activation)

    def forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        activation = mlp_activation(mlp, self)
        out = None if activation is None else computed(self, x, activation)
        return original(self, x) if out is None else mlp_dropout(mlp, self, out)

    forward.__qualname__ = f"tigon_{mlp.cls}.forward"
    return forward


class _Group:
    """An attention's q/k/v projections computed as one op on `x`, at the first of their calls on
    it: after that projection's hooks, one of which may have replaced the tensor or added
    arguments (then that call runs the projection's own forward). `compute` returns the outputs in
    `projections`' order, or None when they must run on their own."""

    __slots__ = ("x", "projections", "compute", "outputs")

    def __init__(self, x: torch.Tensor, projections: tuple, compute: Callable[[], Sequence[torch.Tensor] | None]) -> None:
        self.x, self.projections, self.compute = x, projections, compute
        self.outputs: dict | None = None

    def answer(self, projection: torch.nn.Module, input: Any) -> torch.Tensor | None:
        if input is not self.x:
            return None
        if self.outputs is None:
            outs = self.compute()
            self.outputs = {} if outs is None else dict(zip(self.projections, outs))
        return self.outputs.get(projection)

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        """For the duration of the block, a call of a projection on one tensor returns its
        :meth:`answer` when that is not None, and runs the projection's own forward otherwise.
        Hooks still run: the module is still called, only the forward its call ends in is
        displaced (the one forward attribute not set by the patch itself)."""
        displaced = []
        try:
            for module in self.projections:
                attr = forward_attr(module)
                previous = vars(module).get(attr)
                own = previous if previous is not None else types.MethodType(type(module).forward, module)

                def answered(projection, *args, _own=own, **kwargs):
                    out = self.answer(projection, args[0]) if len(args) == 1 and not kwargs else None
                    return _own(*args, **kwargs) if out is None else out

                setattr(module, attr, types.MethodType(answered, module))
                displaced.append((module, attr, previous))
            yield
        finally:
            for module, attr, previous in reversed(displaced):
                if previous is None:
                    delattr(module, attr)
                else:
                    setattr(module, attr, previous)


def _plain_group(projections: tuple, x: torch.Tensor) -> _Group | None:
    """Plain linears as one :func:`tigon.functional.linear_group` (their input gradient
    accumulated in their backward GEMMs, not summed by autograd): only when calling them would run
    nothing more (no hooks, accelerate or ZeRO-3 wrapping, no forward set on the instance), in
    x's dtype (or under autocast) and on its device, when a backward can follow."""
    if not torch.is_grad_enabled() or not all(plain_linear(p) for p in projections):
        return None
    autocast = autocast_dtype(x) is not None
    for t in (t for p in projections for t in (p.weight, p.bias)):
        if t is not None and (t.device != x.device or (t.dtype != x.dtype and not autocast) or zero3_partitioned(t)):
            return None
    return _Group(x, projections, lambda: F.linear_group(x, [p.weight for p in projections], [p.bias for p in projections]))


def _lora_group(
    projections: tuple, x: torch.Tensor, lora_forward: Callable[..., Any], normed_input: NormedInput | None
) -> _Group | None:
    """PEFT LoRA linears running tigon's LoRA forward as one :func:`tigon.functional.lora_linear_group`
    (x read and saved once, one input gradient), when each qualifies at the time of the call."""
    if not all(lora.runs(p, lora_forward) for p in projections):
        return None

    def compute() -> Sequence[torch.Tensor] | None:  # while their forwards are displaced: no `runs`
        weights = _lora_projections(projections, x)
        return None if weights is None else F.lora_linear_group(x, weights, normed_input=normed_input)

    return _Group(x, projections, compute)


def attention_forward(
    attention: Attention, original: Callable[..., Any], plain: bool, lora_forward: Callable[..., Any] | None = None,
    plan: LayerPlan | None = None,
) -> Callable[..., Any]:
    """Forward for an HF attention whose q/k/v projections read the same `hidden_states`: runs
    `original` with the three computed as one op (`plain`: plain linears; `lora_forward`: PEFT LoRA
    linears that run it), each projection's call on those hidden states returning its part
    (:meth:`_Group.answering`). Off under torch.compile, which would bake the displaced forwards
    into its guards."""
    relay = plan.relay if plan is not None else None

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else (args[0] if args else None)
        group = None
        projections = tuple(getattr(self, name, None) for name in attention.projections)
        # (Gemma 3n's and 4's attentions that reuse another layer's keys and values have a q alone;
        # Gemma 4's whose values are its keys, no v.)
        if isinstance(x, torch.Tensor) and x.is_floating_point() and live() and None not in projections:
            if plain:
                group = _plain_group(projections, x)
            if group is None and lora_forward is not None:
                group = _lora_group(projections, x, lora_forward, relay and relay.normed_input_of(x))
        if group is None:
            return original(self, *args, **kwargs)
        with group.answering():
            return original(self, *args, **kwargs)

    forward.__qualname__ = f"tigon_{attention.cls}.forward"
    return forward
