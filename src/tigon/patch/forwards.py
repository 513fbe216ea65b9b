"""The forwards and functions tigon puts in place of Hugging Face's.

Each factory returns one function per table entry and returns the *same* function for the same
entry (``lru_cache``), so patching twice installs an identical object and torch.compile sees a
stable callee. A forward reads only the attributes the HF module already has, so it can be bound
to a live module (instance patching) or set on the class (class patching) alike.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from typing import Any, Callable, Iterator

import torch

from tigon import functional as F
from tigon._checks import has_hooks
from tigon.ops.composite.linear_group import run_linear_group
from tigon.ops import autocast_dtype
from tigon.ops.rms_norm import NormedInput
from tigon.patch.families import MLP, QKV_PROJECTIONS, Head, Layer, Norm, Rope


@functools.lru_cache(maxsize=None)
def rms_norm_forward(norm: Norm) -> Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]:
    """Forward for an HF RMSNorm module: its `weight` and epsilon through :func:`tigon.functional.rms_norm`."""

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = _take_normed(hidden_states, self)
        if normed is not None:
            return normed
        return F.rms_norm(
            hidden_states, self.weight, getattr(self, norm.eps), offset=norm.offset, casting=norm.casting
        )

    forward.__qualname__ = f"tigon_{norm.cls}.forward"
    return forward


def _summands(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` and `residual` in the dtype ``residual + x`` would have, so a fused sum is the unfused one."""
    if x.dtype == residual.dtype:
        return x, residual
    dtype = torch.promote_types(x.dtype, residual.dtype)
    return x.to(dtype), residual.to(dtype)


def _add_norm(norm: Norm, module: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor):
    """``(module(residual + x), residual + x)`` in one kernel."""
    x, residual = _summands(x, residual)
    return F.add_rms_norm(x, residual, module.weight, getattr(module, norm.eps), offset=norm.offset, casting=norm.casting)


def _add_norm_mlp(
    norm: Norm, module: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor, weights: tuple, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mlp(module(residual + x)), residual + x)`` as one op."""
    x, residual = _summands(x, residual)
    return F.add_rms_norm_glu_mlp(
        x, residual, module.weight, getattr(module, norm.eps), *weights,
        offset=norm.offset, casting=norm.casting, activation=activation,
    )


# (normed tensor, NormedInput) while a fused decoder layer calls its MLP on the output of its
# fused add + RMSNorm: the MLP forward, reached through the module call (so hooks still run),
# recognises its input and lets glu_mlp keep the sum, which the norm keeps anyway, instead of it.
_MLP_NORMED_INPUT: contextvars.ContextVar[tuple[torch.Tensor, NormedInput] | None] = contextvars.ContextVar(
    "tigon_mlp_normed_input", default=None
)


@contextlib.contextmanager
def _mlp_input_from_norm(norm: Norm, module: torch.nn.Module, normed: torch.Tensor, source: torch.Tensor) -> Iterator[None]:
    if torch.compiler.is_compiling():  # traced code runs the references, which keep x anyway
        yield
        return
    eps = float(getattr(module, norm.eps))
    token = _MLP_NORMED_INPUT.set((normed, NormedInput(source, module.weight, eps, norm.offset, norm.casting)))
    try:
        yield
    finally:
        _MLP_NORMED_INPUT.reset(token)


def _normed_input(x: torch.Tensor) -> NormedInput | None:
    current = _MLP_NORMED_INPUT.get()
    return current[1] if current is not None and current[0] is x else None


# A fused decoder layer that knows the norm its output goes through next (the following layer's
# `input_layernorm`, or the model's final norm: `tigon.patch` of a model instance records it as
# `NEXT_NORM`, a weak reference) forms its closing residual add and that norm in one kernel, and
# leaves the normed tensor on the sum it returns, under `_NORMED`, for that norm to take instead of
# computing it again. Only the named norm module takes it.
NEXT_NORM = "_tigon_next_norm"
_NORMED = "_tigon_normed"


def _take_normed(x: torch.Tensor, norm_module: torch.nn.Module | None) -> torch.Tensor | None:
    """The normed `x` a fused layer left for `norm_module`, removed from `x`; None if there is none."""
    if torch.compiler.is_compiling():
        return None
    left = x.__dict__.pop(_NORMED, None)
    return left[1] if left is not None and left[0] is norm_module else None


def _next_norm(layer: torch.nn.Module, residual: torch.Tensor, norm_forward: Callable[..., Any]) -> torch.nn.Module | None:
    """The norm `layer`'s output goes through next, if its add can be fused with it here: not under
    gradient checkpointing (the recomputed layer must save what the first pass saved), nor into a
    module whose hooks or ZeRO-3 partitioning a direct read would skip, nor across devices, nor in
    a distributed run, where FSDP gathers each layer's weights only for its own forward and
    reduces their gradients right after its own backward."""
    ref = getattr(layer, NEXT_NORM, None)
    if ref is None or torch.compiler.is_compiling():
        return None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return None
    # (Reentrant checkpointing runs the first pass without grad mode: test the flags only.)
    if getattr(layer, "gradient_checkpointing", False) and layer.training:
        return None
    norm_module = ref()
    if (
        norm_module is None
        or has_hooks(norm_module, own_forward=norm_forward)
        or _zero3_partitioned(norm_module.weight)
        or norm_module.weight.device != residual.device
    ):
        return None
    return norm_module


def _zero3_partitioned(param: torch.Tensor) -> bool:
    """A DeepSpeed ZeRO-3 parameter (DeepSpeed's own test: it has a `ds_id`). Its data is whole
    only while its own module's forward runs, so no other forward may read it directly."""
    return hasattr(param, "ds_id")


@functools.lru_cache(maxsize=None)
def decoder_layer_forward(
    layer: Layer,
    norm: Norm,
    original: Callable[..., torch.Tensor],
    mlp: MLP | None = None,
    patched_mlp_forward: Callable[..., torch.Tensor] | None = None,
) -> Callable[..., torch.Tensor]:
    """Forward for an HF decoder layer with its residual add and following RMSNorm fused.

    The same module calls in the same order as `original`, so outputs, hooks and gradient
    checkpointing are unchanged. Every argument but the hidden states reaches the attention as HF
    passes it, by keyword; a positional one sends the call to `original`, and so does a ZeRO-3
    partitioned weight of the norm that the fused add reads without calling its module.

    With `mlp` (the family's gated MLP, whose modules run `patched_mlp_forward`), a plain-linear MLP
    with nothing but that forward to run goes into the same op as the add + RMSNorm before it
    (:func:`tigon.functional.add_rms_norm_glu_mlp`): the same kernels, less host time per layer.
    """
    fused_norm = "pre_feedforward_layernorm" if layer.fuse == "sandwich" else "post_attention_layernorm"
    norm_forward = rms_norm_forward(norm)  # the norms' own forward when tigon patched them: not a hook

    def branch(self: torch.nn.Module, out: torch.Tensor, index: int) -> torch.Tensor:
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
            or type(module).__name__ != mlp.cls  # a mixture-of-experts block in the MLP's place
            or has_hooks(module, own_forward=patched_mlp_forward)
        ):
            return None, None
        activation = _mlp_activation(mlp, module)
        weights = _glu_mlp_weights(mlp, module) if activation is not None else None
        return weights, activation

    def fused(self: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        normed = _take_normed(hidden_states, self.input_layernorm)
        norm_module = getattr(self, fused_norm)
        # The fused add reads the norm's weight without calling it: a norm with hooks (or a forward
        # of its own) runs in the original layer, as a module call.
        if args or _zero3_partitioned(norm_module.weight) or has_hooks(norm_module, own_forward=norm_forward):
            return inner(self, hidden_states, *args, **kwargs)
        residual = hidden_states
        if normed is None:
            normed = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=normed, **kwargs)
        if layer.fuse == "sandwich":
            hidden_states = self.post_attention_layernorm(hidden_states)
        else:
            hidden_states = branch(self, hidden_states, 0)
        weights, activation = _fusable_mlp(self.mlp)
        if weights is not None:
            hidden_states, residual = _add_norm_mlp(norm, norm_module, hidden_states, residual, weights, activation)
        else:
            hidden_states, residual = _add_norm(norm, norm_module, hidden_states, residual)
            with _mlp_input_from_norm(norm, norm_module, hidden_states, residual):
                hidden_states = self.mlp(hidden_states)
        if layer.fuse == "sandwich":
            hidden_states = self.post_feedforward_layernorm(hidden_states)
        out = branch(self, hidden_states, 1)
        next_norm = _next_norm(self, residual, norm_forward)
        if next_norm is None:
            return residual + out
        normed, total = _add_norm(norm, next_norm, out, residual)
        setattr(total, _NORMED, (next_norm, normed))
        return total

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if checkpoints_in_forward and self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            kwargs["use_cache"] = False  # as HF's wrapper: a replayed layer must not write the cache again
            return self._gradient_checkpointing_func(functools.partial(fused, self, **kwargs), hidden_states, *args)
        return fused(self, hidden_states, *args, **kwargs)

    forward.__qualname__ = f"tigon_{layer.cls}.forward"
    return forward


def _hf_checkpoints_in_forward() -> bool:
    """Whether this transformers checkpoints GradientCheckpointingLayer in a wrapper around the
    class's `forward` (newer releases) rather than in its `__call__` (5.17 and earlier)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return "__call__" not in GradientCheckpointingLayer.__dict__


# The activations each GLU switch covers, as the op's activation name.
GLU_ACTIVATIONS = {"swiglu": ("silu",), "geglu": ("gelu_tanh", "gelu")}


@functools.lru_cache(maxsize=None)
def _activation_names() -> dict[type, str]:
    """HF activation module classes that compute exactly one of the ops' activations."""
    from transformers import activations

    return {
        activations.SiLUActivation: "silu",
        torch.nn.SiLU: "silu",
        activations.GELUTanh: "gelu_tanh",
        activations.GELUActivation: "gelu",
    }


def _glu(activation: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if activation == "silu":
        return F.swiglu(gate, up)
    return F.geglu(gate, up, approximate="tanh" if activation == "gelu_tanh" else "none")


def _plain(linear: torch.nn.Module) -> bool:
    """An nn.Linear whose weights a fused op may read directly: not a LoRA or quantised wrapper,
    and nothing (hooks, accelerate's offload wrapper) that calling it would run."""
    return type(linear) is torch.nn.Linear and not has_hooks(linear)


def _mlp_activation(mlp: MLP, module: torch.nn.Module) -> str | None:
    """The op's name for `module`'s activation when it is one of `mlp.switch`'s, else None."""
    activation = _activation_names().get(type(getattr(module, mlp.act)))
    return activation if activation in GLU_ACTIVATIONS[mlp.switch] else None


def _glu_mlp_weights(mlp: MLP, module: torch.nn.Module) -> tuple | None:
    """(gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias) of a gated MLP whose
    projections are plain linears, which glu_mlp may read directly; None otherwise."""
    down = module.down_proj
    if mlp.packed:
        gate_up = module.gate_up_proj
        if not (_plain(gate_up) and _plain(down)):
            return None
        gate_w, up_w = gate_up.weight.chunk(2, dim=0)
        gate_b, up_b = (None, None) if gate_up.bias is None else gate_up.bias.chunk(2)
        return gate_w, up_w, down.weight, gate_b, up_b, down.bias
    gate_proj, up_proj = module.gate_proj, module.up_proj
    if not (_plain(gate_proj) and _plain(up_proj) and _plain(down)):
        return None
    return gate_proj.weight, up_proj.weight, down.weight, gate_proj.bias, up_proj.bias, down.bias


@functools.lru_cache(maxsize=None)
def mlp_forward(mlp: MLP, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Forward for an HF gated MLP: :func:`tigon.functional.glu_mlp` when its projections are
    plain linears (saves less for backward), else the projections' own forwards (LoRA, quantised)
    around :func:`tigon.functional.swiglu` / :func:`~tigon.functional.geglu`. A module whose
    activation is not one of `mlp.switch`'s runs `original`."""

    def forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        activation = _mlp_activation(mlp, self)
        if activation is None:
            return original(self, x)
        weights = _glu_mlp_weights(mlp, self)
        if weights is not None:
            return F.glu_mlp(x, *weights, activation=activation, normed_input=_normed_input(x))
        if mlp.packed:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(_glu(activation, gate, up))

    forward.__qualname__ = f"tigon_{mlp.cls}.forward"
    return forward


def _group_output(module: torch.nn.Module, x: torch.Tensor, out: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """A q/k/v projection's forward while its attention runs: `out`, computed for `x` in the group."""
    if input is x:
        return out
    return torch.nn.Linear.forward(module, input)


def _group_qkv(attention: torch.nn.Module, hidden_states: Any) -> tuple[torch.nn.Module, ...]:
    """Compute the attention's q, k and v projections of `hidden_states` as one
    :func:`tigon.functional.linear_group` (their input gradient accumulated in their backward
    GEMMs, not summed by autograd) and make each projection's call on that tensor return its part,
    until the caller pops the ``forward`` this sets on them; returns the projections so set.

    Only for plain linears that calling would run nothing more (no hooks, accelerate or ZeRO-3
    wrapping, no forward set on the instance), in `hidden_states`' dtype (or under autocast) and on its
    device, when a backward can follow; otherwise the projections run as they are."""
    if not (isinstance(hidden_states, torch.Tensor) and hidden_states.is_floating_point() and torch.is_grad_enabled()):
        return ()
    if torch.compiler.is_compiling():
        return ()
    projections = tuple(getattr(attention, name, None) for name in QKV_PROJECTIONS)
    if not all(_plain(p) for p in projections):
        return ()
    params = tuple(t for p in projections for t in (p.weight, p.bias))
    dtype, device = hidden_states.dtype, hidden_states.device
    autocast = autocast_dtype(hidden_states)
    for t in params:
        if t is not None and (t.device != device or (t.dtype != dtype and autocast is None) or _zero3_partitioned(t)):
            return ()
    outs = run_linear_group(hidden_states, params, autocast)
    for projection, out in zip(projections, outs):
        vars(projection)["forward"] = functools.partial(_group_output, projection, hidden_states, out)
    return projections


@functools.lru_cache(maxsize=None)
def attention_forward(cls: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """Forward for an HF attention whose q/k/v projections read the same `hidden_states`: runs
    `original` with the three computed as one group (see :func:`_group_qkv`)."""

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else (args[0] if args else None)
        grouped = _group_qkv(self, hidden_states)
        try:
            return original(self, *args, **kwargs)
        finally:
            for projection in grouped:
                vars(projection).pop("forward", None)

    forward.__qualname__ = f"tigon_{cls}.forward"
    return forward


@functools.lru_cache(maxsize=None)
def rope_function(rope: Rope, original: Callable[..., tuple]) -> Callable[..., tuple]:
    """``apply_rotary_pos_emb`` over :func:`tigon.functional.rope` (partial rotary included);
    another `unsqueeze_dim` (a different q/k layout) runs `original`."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim != 1:
            return original(q, k, cos, sin, unsqueeze_dim)
        q_embed, k_embed = F.rope(q, k, cos, sin)
        if rope.keep_dtype:
            return q_embed.to(q.dtype), k_embed.to(k.dtype)
        return q_embed, k_embed

    apply_rotary_pos_emb.__qualname__ = f"tigon_{rope.function}"
    return apply_rotary_pos_emb


def _shifted_targets(labels: torch.Tensor, kwargs: dict, ignore_index: int) -> torch.Tensor:
    """The next-token targets HF's ForCausalLMLoss uses: `shift_labels` if given, else `labels`
    moved left by one with `ignore_index` last."""
    shift_labels = kwargs.get("shift_labels")
    if shift_labels is not None:
        return shift_labels
    return torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def _full(tensor: torch.Tensor | None, dtensor: type | None) -> torch.Tensor | None:
    """`tensor` whole, as a plain tensor the kernels can read (`dtensor`: the DTensor class, or
    None where torch has no distributed support).

    Under FSDP2 the head's weight is already whole here (the pre-forward hook of the group that
    owns it has unsharded it), and passes as it is. A DTensor that is still sharded (or replicated)
    is all-gathered; its gradient is averaged over the mesh on the way back, as FSDP and DDP
    reduce gradients across data-parallel ranks, and lands on the sharded parameter.
    """
    if dtensor is None or not isinstance(tensor, dtensor):
        return tensor
    from torch.distributed.tensor import Partial, Replicate

    dims = tensor.device_mesh.ndim
    return tensor.redistribute(placements=[Replicate()] * dims).to_local(grad_placements=[Partial("avg")] * dims)


@functools.lru_cache(maxsize=None)
def _fsdp_module_type() -> type | None:
    """FSDP2's FSDPModule class, or None where torch has none."""
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6 keeps FSDP2 under torch.distributed._composable
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


def _fsdp2_linear(module: torch.nn.Module) -> bool:
    """An nn.Linear that FSDP2's ``fully_shard`` made part of a parameter group (its class becomes
    ``FSDPLinear``), with no hooks but FSDP's own. accelerate 1.15 shards the lm_head this way,
    in one group with the final norm (and the embeddings, when tied)."""
    fsdp_module = _fsdp_module_type()
    if fsdp_module is None or type(module).__bases__ != (fsdp_module, torch.nn.Linear):
        return False
    if vars(module).get("forward") is not None:
        return False
    if module._backward_hooks or getattr(module, "_backward_pre_hooks", None):
        return False
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return all(getattr(getattr(h, "func", h), "__module__", "").startswith("torch.distributed.fsdp") for h in hooks)


@contextlib.contextmanager
def _fsdp2_group_ready(lm_head: torch.nn.Module) -> Iterator[None]:
    """Run the lm_head's FSDP2 hooks through a call on zero rows, so its group is unsharded and
    counts it as having run forward (gradient reduction then follows FSDP's usual path); the
    weight is then whole, or still a sharded DTensor that the loss all-gathers (``_full``)."""
    weight = lm_head.weight
    lm_head(torch.empty(0, lm_head.in_features, dtype=weight.dtype, device=weight.device))
    yield


def _head_weights(lm_head: torch.nn.Module) -> contextlib.AbstractContextManager | None:
    """How the fused loss may read `lm_head`'s weights without calling it on the hidden states: as
    they are for a plain linear; after its FSDP2 group's hooks have run, for one that FSDP2 shards;
    gathered for the duration (DeepSpeed's ``GatheredParameters``, read-only) for a linear whose
    ZeRO-3 partitioned weights DeepSpeed's hooks would gather only inside its own forward. None
    otherwise: then the loss goes through the module and the logits."""
    if _plain(lm_head):
        return contextlib.nullcontext()
    if _fsdp2_linear(lm_head):
        return _fsdp2_group_ready(lm_head)
    if type(lm_head) is torch.nn.Linear and _zero3_partitioned(lm_head.weight):
        try:
            import deepspeed
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        except ImportError:  # a `ds_id` without DeepSpeed to gather it: leave it to the module
            return None
        # Small parameters persist whole, and one may be in use already: gather only what is not.
        partitioned = [p for p in lm_head.parameters(recurse=False) if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None) if partitioned else contextlib.nullcontext()
    return None


# The fused loss's logits budget in a patched model: twice the op's default. The loss runs at the
# end of the forward, but a training step peaks later, in the last layers' backward, so the larger
# chunk leaves the step's peak almost where it was while the thicker weight-gradient GEMMs make the
# step faster (H200, tigon bench --e2e full fine-tune, 2026-11-29: 123.7 -> 120.5 ms per step,
# peak 14.54 -> 14.57 GiB; 512 MiB gave 120.0 ms at 14.81 GiB).
CAUSAL_LM_LOSS_CHUNK_BYTES = 256 * 2**20


# Marks position ids that tigon made for a batch of whole sequences (each row 0, 1, 2, ...).
_WHOLE_SEQUENCES = "_tigon_whole_sequences"


def _whole_sequence_positions(tokens: torch.Tensor) -> torch.Tensor:
    """The positions Hugging Face's decoder would make for `tokens` (ids or embeddings, batch
    first) with no cache, one row per sequence, marked as such for :func:`packed_sequence_finder`."""
    batch, length = tokens.shape[:2]
    positions = torch.arange(length, device=tokens.device).expand(batch, length)
    setattr(positions, _WHOLE_SEQUENCES, True)
    return positions


@functools.lru_cache(maxsize=None)
def packed_sequence_finder(original: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """``transformers.masking_utils.find_packed_sequence_indices``, answering None (no packed
    sequences) for positions tigon made for whole sequences, without the look at the device's data
    that `original` takes: a device-to-host synchronisation that would stall every training step
    until the GPU had drained the previous one. Every other tensor gets `original`'s answer."""

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> Any:
        if not torch.compiler.is_compiling() and getattr(position_ids, _WHOLE_SEQUENCES, False):
            return None
        return original(position_ids)

    return find_packed_sequence_indices


def _mean_as_hf(loss_sum: torch.Tensor, kwargs: dict) -> torch.Tensor:
    count = kwargs["num_items_in_batch"]
    return loss_sum / (count.to(loss_sum.device) if isinstance(count, torch.Tensor) else count)


@functools.lru_cache(maxsize=None)
def causal_lm_forward(
    head: Head, fused: bool, original: Callable[..., Any], aux_loss: Callable[..., torch.Tensor] | None
) -> Callable[..., Any]:
    """Forward for an HF ``*ForCausalLM`` whose loss runs on tigon's kernels, same loss as HF's.

    fused=True (``linear_cross_entropy``): in training, with labels, HF's own loss function and
    an int `logits_to_keep`, the loss comes from :func:`tigon.functional.linear_cross_entropy` on
    the last hidden state, and ``logits`` is None: the logits never exist. Otherwise `original`
    runs unchanged.

    fused=False (``cross_entropy``): with labels, HF computes the logits (softcap and scaling
    included) and :func:`tigon.functional.cross_entropy` the loss.

    Both follow HF's ``ForCausalLMLoss``: shifted labels (or `shift_labels`), `ignore_index`,
    ``sum / num_items_in_batch`` when that is given, and the MoE router loss when router logits
    are output. Arguments after `position_ids` must be passed by keyword (as Trainer, PEFT and
    generate do); a positional one sends the call to `original`.
    """
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
    from transformers.utils import can_return_tuple

    output_cls = MoeCausalLMOutputWithPast if aux_loss is not None else CausalLMOutputWithPast
    dtensor = _dtensor_type()  # resolved here, once: torch.compile warns on a cached lookup per call

    def add_aux_loss(self, loss: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        return loss if aux is None else loss + self.router_aux_loss_coef * aux.to(loss.device)

    def linear_loss(self, head_weights, input_ids, attention_mask, position_ids, labels, logits_to_keep, kwargs):
        if aux_loss is not None and kwargs.get("output_router_logits") is None:
            kwargs["output_router_logits"] = self.config.output_router_logits
        decoder = getattr(self, self.base_model_prefix)
        tokens = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        no_cache = kwargs.get("past_key_values") is None and kwargs.get("cache") is None
        if position_ids is None and attention_mask is None and no_cache and tokens is not None:
            position_ids = _whole_sequence_positions(tokens)
        outputs = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        hidden = outputs.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:, :]
        if head.scale is not None:
            hidden = hidden / getattr(self.config, head.scale)
        ignore_index = kwargs.get("ignore_index", -100)
        has_count = kwargs.get("num_items_in_batch") is not None
        # The loss computes the weight's gradient in forward: nothing reads the weights after this.
        with head_weights:
            weight = _full(self.lm_head.weight, dtensor)
            loss = F.linear_cross_entropy(
                hidden.to(weight.dtype), weight, _shifted_targets(labels, kwargs, ignore_index).to(hidden.device),
                _full(self.lm_head.bias, dtensor), ignore_index=ignore_index,
                softcap=getattr(self.config, head.softcap) if head.softcap is not None else None,
                reduction="sum" if has_count else "mean", max_chunk_bytes=CAUSAL_LM_LOSS_CHUNK_BYTES,
            )
        if has_count:
            loss = _mean_as_hf(loss, kwargs)
        fields = {key: value for key, value in outputs.items() if key != "last_hidden_state"}
        if aux_loss is not None and kwargs["output_router_logits"]:
            fields["aux_loss"] = aux_loss(
                outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask
            )
            loss = add_aux_loss(self, loss, fields["aux_loss"])
        return output_cls(loss=loss, logits=None, **fields)

    def logits_loss(self, out, labels, kwargs):
        ignore_index = kwargs.get("ignore_index", -100)
        has_count = kwargs.get("num_items_in_batch") is not None
        logits = out.logits
        loss = F.cross_entropy(
            logits, _shifted_targets(labels, kwargs, ignore_index).to(logits.device),
            ignore_index=ignore_index, reduction="sum" if has_count else "mean",
        )
        if has_count:
            loss = _mean_as_hf(loss, kwargs)
        loss = add_aux_loss(self, loss, out.get("aux_loss"))
        return type(out)(loss=loss, **{key: value for key, value in out.items() if key != "loss"})

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, *args, labels=None, logits_to_keep=0, **kwargs):
        ours = labels is not None and not args and self.loss_function is ForCausalLMLoss
        head_weights = _head_weights(self.lm_head) if fused and ours and self.training else None
        if head_weights is not None and isinstance(logits_to_keep, int):
            return linear_loss(self, head_weights, input_ids, attention_mask, position_ids, labels, logits_to_keep, kwargs)
        if not fused and ours:
            out = original(
                self, input_ids, attention_mask, position_ids, logits_to_keep=logits_to_keep, return_dict=True, **kwargs
            )
            return logits_loss(self, out, labels, kwargs)
        return original(
            self, input_ids, attention_mask, position_ids, *args, labels=labels, logits_to_keep=logits_to_keep,
            return_dict=True, **kwargs,
        )

    forward.__qualname__ = "tigon_causal_lm.forward"
    wrapped = can_return_tuple(forward)
    # Trainer and generate() read the forward's signature to pick the inputs they pass.
    wrapped.__signature__ = inspect.signature(original)
    return wrapped
