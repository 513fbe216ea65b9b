"""The switches of :func:`tigon.patch`: one table, read by everything that takes or shows them.

A switch turns one of tigon's replacements on or off for a whole model. Its name is a keyword of
:func:`tigon.patch` (and of ``tigon.AutoModelForCausalLM``'s constructors) and a value of
``tigon sft --kernels-off``; the ops it covers are the names ``TIGON_DISABLE`` takes (which force
an op onto its PyTorch reference wherever it runs, while a switch decides whether tigon's forward
runs at all), and ``tigon env`` shows, per op, the switches that cover it.

An op can be covered by more than one switch: ``glu_mlp`` runs in SiLU (``swiglu``) and GELU
(``geglu``) MLPs; ``add_rms_norm_glu_mlp`` is the add + RMSNorm (``add_rms_norm``) joined with the
MLP after it, so it needs both; and the last layer's residual add runs with the model's final norm
(``add_rms_norm``) only when that norm runs tigon's forward (``rms_norm``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from tigon.ops import op_names


@dataclass(frozen=True)
class Switch:
    """One switch of :func:`tigon.patch`.

    Attributes:
        name: the keyword.
        default: its value when not given.
        doc: what it replaces, in one line.
        ops: the op names whose kernels run only with it on (none for a switch that wraps
            modules in a memory-saving scheme rather than running a kernel).
    """

    name: str
    default: bool
    doc: str
    ops: tuple[str, ...] = ()


TABLE: tuple[Switch, ...] = (
    Switch("rms_norm", True, "RMSNorm modules on the RMSNorm kernel", ("rms_norm", "add_rms_norm")),
    Switch("rope", True, "the rotary embedding on the RoPE kernel (partial rotary included)", ("rope",)),
    Switch("swiglu", True, "SiLU-gated MLPs as one op saving x, gate and up",
           ("glu_mlp", "swiglu", "add_rms_norm_glu_mlp")),
    Switch("geglu", True, "GELU-gated MLPs as one op saving x, gate and up",
           ("glu_mlp", "geglu", "add_rms_norm_glu_mlp")),
    Switch("layer_norm", True, "torch LayerNorm modules of a patched model on the LayerNorm kernel", ("layer_norm",)),
    Switch("add_rms_norm", True, "each residual add with the RMSNorm after it in one kernel (with the MLP, as one op)",
           ("add_rms_norm", "add_rms_norm_glu_mlp")),
    Switch("qkv_group", True, "an attention's plain q/k/v linears as one op: one input gradient", ("linear_group",)),
    Switch("linear_cross_entropy", True, "the training loss straight from the hidden states: no logits",
           ("linear_cross_entropy",)),
    Switch("cross_entropy", False, "the loss from materialised logits (exclusive with linear_cross_entropy)",
           ("cross_entropy",)),
    Switch("trl_log_probs", True, "TRL's fused LM head (its trainers' per-token log-probs) on linear_log_probs: no "
           "logits; only when TRL is imported", ("linear_log_probs",)),
    Switch("lora", True, "PEFT LoRA linears (DoRA, 4-/8-bit and FP8 bases too), gated MLPs and q/k/v groups on the fused LoRA ops",
           ("lora_linear", "lora_linear_group", "lora_gated_mlp", "dequantize", "gemm_4bit", "dora_norm", "dora_scale",
            "dora_scale_backward", "fp8_quantize", "fp8_matmul", "fp8_matmul_grad", "add_low_rank")),
    Switch("offload_activations", False, "under gradient checkpointing, the checkpointed hidden states in host memory"),
    Switch("tiled_mlp", False, "the MLP over chunks of tokens: its intermediates never exist whole"),
    Switch("recompute_mlp", False, "gated MLPs keep only their input for backward, which forms gate and up again "
           "(two more GEMMs per layer)"),
    Switch("moe_experts", True, "a patched model's mixture-of-experts experts on the fused experts op (grouped GEMMs)",
           ("moe_experts",)),
    Switch("gelu_mlp", True, "a vision tower's GELU MLPs (fc1, GELU, fc2) as one op keeping fc1's output, not the "
           "activation", ("gelu_mlp", "gelu")),
    Switch("patch_embed", True, "a Qwen-VL / GLM-4V vision tower's patch embedding, a Conv3d whose stride is its "
           "kernel, as the GEMM over the flattened patches it is"),
    Switch("vision_attention", True, "a Qwen-VL / GLM-4V vision tower's attention: the images' lengths read to the "
           "host once per tower forward, not in every block, and images of one size in one attention call"),
)

SWITCHES: tuple[str, ...] = tuple(switch.name for switch in TABLE)
DEFAULTS: dict[str, bool] = {switch.name: switch.default for switch in TABLE}


def covering(op: str) -> tuple[str, ...]:
    """The switches covering the op named `op` (empty for a name no switch covers, such as the
    :data:`UNPATCHED_OPS`)."""
    return tuple(switch.name for switch in TABLE if op in switch.ops)


# The ops no switch covers, which tigon.patch does not apply (TIGON_DISABLE still takes them): the
# fused RL, preference and distillation losses, which a trainer calls on the hidden states itself.
UNPATCHED_OPS: tuple[str, ...] = tuple(op for op in op_names() if not covering(op))


def check_switch_names(names: Iterable[str], where: str) -> None:
    """ValueError, prefixed by `where`, for names that are no switch: an op name is told the
    switches covering it, any other name gets the list of switches."""
    unknown = [name for name in names if name not in DEFAULTS]
    for name in unknown:
        switches = covering(name)
        if name in UNPATCHED_OPS:
            raise ValueError(
                f"{where}: {name!r} is an op name (TIGON_DISABLE takes those) that tigon.patch does not apply, "
                "so no switch covers it"
            )
        if switches:
            raise ValueError(
                f"{where}: {name!r} is an op name (TIGON_DISABLE takes those), not a switch; "
                f"switches covering it: {', '.join(switches)}"
            )
    if unknown:
        raise ValueError(f"{where}: unknown kernel(s) {', '.join(unknown)}; choose from {', '.join(SWITCHES)}")
