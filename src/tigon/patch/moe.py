"""Transformers 5's mixture-of-experts ``*Experts`` modules, computed by :func:`tigon.functional.moe_experts`.

Every experts class that transformers decorates with ``@use_experts_implementation`` (Mixtral,
Qwen3-MoE, DeepSeek-V3, gpt-oss and some sixty more) holds its experts as 3-D parameters,
``gate_up_proj`` and ``down_proj``, and describes their layout in flags the decorator sets
(``is_transposed``, ``is_concatenated``, ``has_bias``, ``has_gate``, ``has_post_expert_norm``).
:func:`experts_forward` reads those flags and the module's own parameters, so it computes what the
module's forward computes, for the same ``(hidden_states, top_k_index, top_k_weights)``.

Two ways in:

* call ``experts_forward(module, hidden, index, weights)`` from a patched forward, or rebind a
  class's or an instance's forward to it;
* or :func:`register_experts_implementation` once, then ``model.set_experts_implementation("tigon")``
  (or ``config._experts_implementation = "tigon"``): transformers' own dispatch then calls it for
  every experts module of the model, and for a module it cannot take (:func:`unsupported_reason`)
  it runs the module's original loop. ``tigon.patch(model)`` does this for the model instance of a
  mixture-of-experts family (switch ``moe_experts``) and ``tigon.unpatch`` restores the setting.

LoRA: a PEFT model with ``target_parameters`` on the expert weights wraps them in a
parametrization while the module runs; when that is one adapter kept as its two low-rank factors
(PEFT's usual case), the factors go to the op, which then skips the frozen base weights' gradient
GEMMs. Any other parametrization is read as the weight it produces (correct, at PEFT's cost).
"""

from __future__ import annotations

import logging

import torch
from torch.nn.utils import parametrize

import tigon.functional as F
from tigon.patch.modules import module_activation

log = logging.getLogger("tigon")

IMPLEMENTATION = "tigon"

# Experts classes whose ``_apply_gate`` is their own: the op's gate options for each, read from
# the module. Classes not listed here with their own gate run their original forward.
CUSTOM_GATES = {
    # gate * sigmoid(alpha * gate) * (up + 1), gate <= limit, |up| <= limit
    "GptOssExperts": lambda m: dict(alpha=float(m.alpha), limit=float(m.limit), up_offset=1.0),
}


def _gate_options(module: torch.nn.Module) -> dict | str:
    """The op's activation keywords for `module`, or why it has none."""
    from transformers.integrations.moe import _default_apply_gate

    name = type(module).__name__
    if getattr(type(module), "_apply_gate", None) is not _default_apply_gate:
        # By class name, through the MRO: a PEFT parametrization subclasses the module's class.
        custom = next((CUSTOM_GATES[c.__name__] for c in type(module).__mro__ if c.__name__ in CUSTOM_GATES), None)
        if custom is None:
            return f"{name} has a gate of its own (_apply_gate) that tigon does not know"
        return dict(custom(module))
    act = module_activation(getattr(module, "act_fn", None))
    if act is None:
        return f"{name}'s activation {type(getattr(module, 'act_fn', None)).__name__} is not one tigon has"
    return dict(activation=act)


def unsupported_reason(module: torch.nn.Module) -> str | None:
    """None when :func:`experts_forward` computes what `module` computes, else why it cannot."""
    name = type(module).__name__
    if not hasattr(module, "has_gate") or not hasattr(module, "gate_up_proj"):
        return f"{name} is not a transformers experts module with 3-D gate_up_proj / down_proj weights"
    if not module.has_gate:
        return f"{name} has no gate (has_gate=False)"
    if getattr(module, "has_post_expert_norm", False):  # (transformers < 5.2x has no such option)
        return f"{name} normalises each expert's output (has_post_expert_norm=True)"
    options = _gate_options(module)
    return options if isinstance(options, str) else None


def _weight_and_lora(module: torch.nn.Module, name: str) -> tuple[torch.Tensor, tuple | None]:
    """The stored parameter and, when PEFT has one adapter on it as factors, ``(lhs, rhs, scaling)``
    with ``delta = scaling · lhs @ rhs`` in the stored layout."""
    if parametrize.is_parametrized(module, name):
        chain = module.parametrizations[name]
        if len(chain) == 1 and all(hasattr(chain[0], field) for field in ("lhs", "rhs", "scaling")):
            proxy = chain[0]
            return chain.original, (proxy.lhs, proxy.rhs, float(proxy.scaling))
    return getattr(module, name), None


def _projection(module: torch.nn.Module, name: str) -> tuple[torch.Tensor, tuple | None]:
    """The weight as the op takes it, ``(E, out, in)`` (a view of transposed storage), and its
    LoRA as ``(lora_a (E, r, in), lora_b (E, out, r), scaling)``."""
    weight, lora = _weight_and_lora(module, name)
    if not module.is_transposed:
        return weight, None if lora is None else (lora[1], lora[0], lora[2])
    weight = weight.transpose(1, 2)
    return weight, None if lora is None else (lora[0].transpose(1, 2), lora[1].transpose(1, 2), lora[2])


def experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    gemm: str = "auto",
) -> torch.Tensor:
    """What `module` (a transformers 5 experts module) returns for these routed tokens, by
    :func:`tigon.functional.moe_experts` on the module's own parameters.

    Args:
        module: e.g. a ``MixtralExperts``, ``Qwen3MoeExperts``, ``DeepseekV3Experts`` or
            ``GptOssExperts``.
        hidden_states: ``(N, H)``.
        top_k_index, top_k_weights: ``(N, K)`` from the model's router.
        gemm: the op's GEMM back end (``"auto"``: the measured best for the device and dtype).

    Raises:
        ValueError: the module is one the op cannot compute (:func:`unsupported_reason`).
    """
    reason = unsupported_reason(module)
    if reason is not None:
        raise ValueError(f"experts_forward cannot run this module: {reason}")
    gate_up, gate_up_lora = _projection(module, "gate_up_proj")
    down, down_lora = _projection(module, "down_proj")
    biases = {}
    if module.has_bias:
        biases = dict(gate_up_bias=module.gate_up_proj_bias, down_bias=module.down_proj_bias)
    return F.moe_experts(
        hidden_states, top_k_index, top_k_weights, gate_up, down,
        interleaved=not module.is_concatenated, gate_up_lora=gate_up_lora, down_lora=down_lora, gemm=gemm,
        **biases, **_gate_options(module),
    )


_fell_back: set[str] = set()


def _interface_forward(module, hidden_states, top_k_index, top_k_weights):
    """transformers' experts-implementation entry: tigon's op, or the module's own loop."""
    reason = unsupported_reason(module)
    if reason is None:
        return experts_forward(module, hidden_states, top_k_index, top_k_weights)
    name = type(module).__name__
    if name not in _fell_back:
        _fell_back.add(name)
        log.warning("tigon: %s runs transformers' expert loop: %s", name, reason)
    return type(module).forward.__wrapped__(module, hidden_states, top_k_index, top_k_weights)


def register_experts_implementation() -> str:
    """Register :func:`experts_forward` with transformers as the experts implementation
    ``"tigon"`` (idempotent) and return that name, for ``model.set_experts_implementation``."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, _interface_forward)
    return IMPLEMENTATION
