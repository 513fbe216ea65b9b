"""The causal LM's head under tigon.patch: its loss from the last hidden states through the fused
linear + cross-entropy (the logits never exist) or from HF's logits through tigon's
cross-entropy, the weights read whole under FSDP2 and ZeRO-3, and the decoder called so that HF's
mask code need not look at the device for packed sequences (nor build a mask a captured step
replays without).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import weakref
from typing import Any, Callable, Iterator

import torch

from tigon import functional as F
from tigon.ops.cross_entropy import token_hits
from tigon.patch.families import Head
from tigon.patch.handoff import LayerPlan, capturing, live
from tigon.patch.modules import plain_linear, zero3_partitioned


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
    if plain_linear(lm_head):
        return contextlib.nullcontext()
    if _fsdp2_linear(lm_head):
        return _fsdp2_group_ready(lm_head)
    if type(lm_head) is torch.nn.Linear and zero3_partitioned(lm_head.weight):
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


class _PackedSequenceFinder:
    """``transformers.masking_utils.find_packed_sequence_indices``, answering None (no packed
    sequences) for the positions :func:`run_decoder` made for whole sequences, without the look at
    the device's data that `original` takes: a device-to-host synchronisation that would stall
    every training step until the GPU had drained the previous one. Every other tensor gets
    `original`'s answer. It knows the positions made last, held weakly: they live for their
    decoder call."""

    def __init__(self, original: Callable[[torch.Tensor], Any]) -> None:
        self.original = original
        self.made: weakref.ref | None = None

    def __call__(self, position_ids: torch.Tensor) -> Any:
        made = self.made if live() else None
        return None if made is not None and made() is position_ids else self.original(position_ids)


@functools.lru_cache(maxsize=None)
def packed_sequence_finder(original: Callable[[torch.Tensor], Any]) -> _PackedSequenceFinder:
    """The one :class:`_PackedSequenceFinder` in place of `original`."""
    return _PackedSequenceFinder(original)


@functools.lru_cache(maxsize=None)
def captured_causal_mask_skip(original: Callable[..., bool]) -> Callable[..., bool]:
    """``transformers.masking_utils._ignore_causal_mask_sdpa``, answering True (no mask: SDPA's
    ``is_causal``) inside a CUDA-graph capture for a causal mask with no padding over as many keys
    as queries and no local window, as `original` answers outside one. transformers counts a
    capture as tracing and there builds the full mask (an export may not bake ``is_causal`` in for
    other shapes), which SDPA runs as a masked attention, several times slower; a captured graph
    replays its own shapes only. Every other call, and any signature this does not know, gets
    `original`'s answer."""
    signature = inspect.signature(original)

    def ignore_causal_mask_sdpa(*args: Any, **kwargs: Any) -> bool:
        if live() and capturing():
            try:
                given = signature.bind(*args, **kwargs).arguments
            except TypeError:
                return original(*args, **kwargs)
            queries = given.get("q_length", given.get("query_length"))
            keys, window = given.get("kv_length"), given.get("local_attention_size")
            if (given.get("padding_mask", 0) is None and queries is not None and queries == keys
                    and (window is None or keys < window)):
                return True
        return original(*args, **kwargs)

    return ignore_causal_mask_sdpa


def run_decoder(
    decoder: torch.nn.Module,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    positions: bool = True,
    **kwargs: Any,
) -> Any:
    """``decoder(input_ids=..., attention_mask=..., position_ids=..., **kwargs)`` for a causal LM's
    backbone. Given no positions, no mask and no cache (whole, unpadded sequences, as in training),
    it passes the positions HF would make (unless `positions` is False: the model makes its own),
    and where tigon's finder is in place it tells the finder they are whole sequences, so that HF's
    mask code does not look for packed sequences on the device (:class:`_PackedSequenceFinder`)."""
    tokens = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
    no_cache = kwargs.get("past_key_values") is None and kwargs.get("cache") is None
    if positions and position_ids is None and attention_mask is None and no_cache and tokens is not None:
        batch, length = tokens.shape[:2]
        position_ids = torch.arange(length, device=tokens.device).expand(batch, length)
        masking = sys.modules.get("transformers.masking_utils") if live() else None
        finder = getattr(masking, "find_packed_sequence_indices", None)
        if isinstance(finder, _PackedSequenceFinder):
            finder.made = weakref.ref(position_ids)
    return decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)


def _recorded(out: Any, accuracy: list | None, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The loss of a loss op's result; with a relay's ``accuracy`` list, the result's argmax hits
    on `targets` and their count appended to it first."""
    if accuracy is None:
        return out
    accuracy.append(token_hits(out.argmax, targets, ignore_index))
    return out.loss


def _mean_as_hf(loss_sum: torch.Tensor, kwargs: dict) -> torch.Tensor:
    count = kwargs["num_items_in_batch"]
    return loss_sum / (count.to(loss_sum.device) if isinstance(count, torch.Tensor) else count)


def causal_lm_forward(
    head: Head, fused: bool, original: Callable[..., Any], aux_loss: Callable[..., torch.Tensor] | None,
    plan: LayerPlan | None = None,
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
    are output. Positional arguments are read in `original`'s order (a multimodal model takes its
    pixels second). Where `plan`'s relay holds an
    ``accuracy`` list, the loss appends its argmax hits and their count to it.
    """
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
    from transformers.utils import can_return_tuple

    relay = plan.relay if plan is not None else None
    signature = inspect.signature(original)
    # A forward that names `output_router_logits` defaults it to the config's; one that names its
    # inputs but reads that one only from its keyword arguments (some multimodal MoE heads of older
    # transformers) to off, adding no router loss unless asked: the patched head follows whichever
    # the installed one does. A wrapper's bare (*args, **kwargs) tells neither: the config's.
    router_logits_from_config = "output_router_logits" in signature.parameters or "labels" not in signature.parameters

    dtensor = _dtensor_type()  # resolved here, once: torch.compile warns on a cached lookup per call

    def moe_setting(self, name: str) -> Any:
        # A causal LM's own attribute, or (a multimodal head over a MoE language model) its text config's.
        return getattr(self, name) if hasattr(self, name) else getattr(self.config.get_text_config(), name)

    def add_aux_loss(self, loss: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        return loss if aux is None else loss + moe_setting(self, "router_aux_loss_coef") * aux.to(loss.device)

    def linear_loss(self, head_weights, input_ids, attention_mask, position_ids, labels, logits_to_keep, kwargs):
        if aux_loss is not None and kwargs.get("output_router_logits") is None:
            kwargs["output_router_logits"] = (
                self.config.get_text_config().output_router_logits if router_logits_from_config else False
            )
        # What every family's forward calls (Llama 4's base_model_prefix names a multimodal model's).
        outputs = run_decoder(self.model, input_ids, attention_mask, position_ids, positions=head.positions, **kwargs)
        hidden = outputs.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:, :]
        config = self.config.get_text_config()
        # Scaling the logits is scaling the hidden states: the heads these families have no bias.
        if head.scale is not None:
            hidden = hidden / getattr(config, head.scale)
        if head.multiplier is not None:
            hidden = hidden * getattr(config, head.multiplier)
        ignore_index = kwargs.get("ignore_index", -100)
        has_count = kwargs.get("num_items_in_batch") is not None
        accuracy = relay.accuracy if relay is not None and live() else None
        targets = _shifted_targets(labels, kwargs, ignore_index).to(hidden.device)
        # The loss computes the weight's gradient in forward: nothing reads the weights after this.
        with head_weights:
            weight = _full(self.lm_head.weight, dtensor)
            loss = F.linear_cross_entropy(
                hidden.to(weight.dtype), weight, targets, _full(self.lm_head.bias, dtensor), ignore_index=ignore_index,
                softcap=getattr(config, head.softcap) if head.softcap is not None else None,
                reduction="sum" if has_count else "mean", max_chunk_bytes=CAUSAL_LM_LOSS_CHUNK_BYTES,
                return_argmax=accuracy is not None,
            )
        loss = _recorded(loss, accuracy, targets, ignore_index)
        if has_count:
            loss = _mean_as_hf(loss, kwargs)
        fields = {key: value for key, value in outputs.items() if key != "last_hidden_state"}
        moe = aux_loss is not None or "router_logits" in fields
        output_cls = MoeCausalLMOutputWithPast if moe else CausalLMOutputWithPast
        # A multimodal model's further outputs (image features, M-RoPE's offsets for generation)
        # are not a training loss's to return.
        fields = {key: value for key, value in fields.items() if key in output_cls.__dataclass_fields__}
        if aux_loss is not None and kwargs["output_router_logits"]:
            fields["aux_loss"] = aux_loss(
                outputs.router_logits, moe_setting(self, "num_experts"), moe_setting(self, "num_experts_per_tok"),
                attention_mask
            )
            loss = add_aux_loss(self, loss, fields["aux_loss"])
        return output_cls(loss=loss, logits=None, **fields)

    def logits_loss(self, out, labels, kwargs):
        ignore_index = kwargs.get("ignore_index", -100)
        has_count = kwargs.get("num_items_in_batch") is not None
        logits = out.logits
        accuracy = relay.accuracy if relay is not None and live() else None
        targets = _shifted_targets(labels, kwargs, ignore_index).to(logits.device)
        loss = F.cross_entropy(
            logits, targets, ignore_index=ignore_index, reduction="sum" if has_count else "mean",
            return_argmax=accuracy is not None,
        )
        loss = _recorded(loss, accuracy, targets, ignore_index)
        if has_count:
            loss = _mean_as_hf(loss, kwargs)
        loss = add_aux_loss(self, loss, out.get("aux_loss"))
        return type(out)(loss=loss, **{key: value for key, value in out.items() if key != "loss"})

    positional = [p.name for p in list(signature.parameters.values())[1:] if p.kind is p.POSITIONAL_OR_KEYWORD]

    def forward(self, *args, **kwargs):
        # Positional arguments name what they do in `original`'s order: a multimodal model's second
        # is its pixels, not a mask.
        if len(args) > len(positional):
            return original(self, *args, return_dict=True, **kwargs)
        for name, value in zip(positional, args):
            if name in kwargs:
                raise TypeError(f"{type(self).__name__}.forward() got multiple values for argument {name!r}")
            kwargs[name] = value
        input_ids, attention_mask, position_ids = (kwargs.pop(n, None) for n in ("input_ids", "attention_mask", "position_ids"))
        labels, logits_to_keep = kwargs.pop("labels", None), kwargs.pop("logits_to_keep", 0)
        ours = labels is not None and self.loss_function is ForCausalLMLoss
        head_weights = _head_weights(self.lm_head) if fused and ours and self.training else None
        if head_weights is not None and isinstance(logits_to_keep, int):
            return linear_loss(self, head_weights, input_ids, attention_mask, position_ids, labels, logits_to_keep, kwargs)
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      logits_to_keep=logits_to_keep, return_dict=True)
        if not fused and ours:
            return logits_loss(self, original(self, **inputs, **kwargs), labels, kwargs)
        return original(self, labels=labels, **inputs, **kwargs)

    forward.__qualname__ = "tigon_causal_lm.forward"
    wrapped = can_return_tuple(forward)
    # Trainer and generate() read the forward's signature to pick the inputs they pass.
    wrapped.__signature__ = signature
    return wrapped
