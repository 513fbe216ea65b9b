"""tigon's kernel floor: fused Triton kernels, one op per file (``tigon/ops/<op>.py``: kernels,
PyTorch reference, autograd Function, public function), and in :mod:`tigon.ops.composite` the ops
that are cuBLAS choreography around them (LoRA on plain, quantised and DoRA projections, linear
groups, gated MLPs). One dispatcher (:mod:`tigon.ops._dispatch`) decides for every op where it
runs; the fused linear losses share the chunked LM head of :mod:`tigon.ops._chunked_head`. Imports
torch and triton only.

The public functions are in :mod:`tigon.functional`; this package exports what the layers above
need besides them: the argument types, the references (test oracles and benchmark baselines) and
the dispatch introspection of ``tigon env``.
"""

import importlib
from typing import Callable

# The op table: every op module, in dispatch order (the order their Ops register in, which
# `tigon env` lists and TIGON_DISABLE's messages follow), with the public functions
# tigon.functional exports from it. A new op is its file and one line here; an op module imports
# only ops above it. tigon.patch.switches takes an op that no switch covers for one tigon.patch
# does not apply.
OP_MODULES: dict[str, tuple[str, ...]] = {
    "rms_norm": ("rms_norm", "add_rms_norm"),
    "layer_norm": ("layer_norm",),
    "rope": ("rope",),
    "mrope": ("mrope", "vision_rope"),
    "glu": ("swiglu", "geglu"),
    "composite.glu_mlp": ("glu_mlp",),
    "gelu": ("gelu",),
    "composite.gelu_mlp": ("gelu_mlp",),
    "cross_entropy": ("cross_entropy",),
    "linear_cross_entropy": ("linear_cross_entropy",),
    "linear_log_probs": ("linear_log_probs",),
    "linear_preference": ("linear_preference_loss",),
    "linear_policy": ("linear_policy_loss",),
    "linear_distill": ("linear_distill_loss",),
    "info_nce": ("info_nce",),
    "composite.linear_group": ("linear_group",),
    "fp8": ("quantize_rows", "fp8_linear"),
    "dequantize": ("dequantize",),
    "gemm_4bit": ("linear_4bit",),
    "dora": ("dora_norm", "dora_scale"),
    "low_rank": ("add_low_rank_",),
    "composite.lora": ("lora_linear", "lora_linear_group"),
    "composite.lora_mlp": ("lora_gated_mlp",),
    "composite.norm_mlp": ("add_rms_norm_glu_mlp",),
    "moe": ("moe_experts",),
}

# name -> public function, what tigon.functional exports.
FUNCTIONS: dict[str, Callable] = {
    name: getattr(importlib.import_module(f"tigon.ops.{module}"), name)
    for module, names in OP_MODULES.items()
    for name in names
}

from tigon.ops._dispatch import (
    INTERPRET,
    autocast_dtype,
    capturing,
    disabled,
    op_names,
    placement,
    reset,
    why_not_triton,
)
from tigon.ops.composite.gelu_mlp import gelu_mlp_reference
from tigon.ops.composite.glu_mlp import glu_mlp_reference
from tigon.ops.composite.linear_group import linear_group_reference
from tigon.ops.composite.lora import LoraProjection, lora_linear_group_reference, lora_linear_reference
from tigon.ops.composite.lora_mlp import lora_gated_mlp_reference
from tigon.ops.composite.norm_mlp import add_rms_norm_glu_mlp_reference
from tigon.ops.cross_entropy import LossOptions, LossOutput, check_flags, check_loss_options, cross_entropy_reference
from tigon.ops.dequantize import QuantizedWeight, dequantize_reference
from tigon.ops.fp8 import Fp8Weight, dequantize_fp8, fp8_linear_reference, quantize_rows_reference, quantize_weight
from tigon.ops.dora import dora_norm_reference, dora_scale_reference
from tigon.ops.low_rank import add_low_rank_reference
from tigon.ops._fp8 import FP8_MODES, Float8Rows, fp8_rows_reference
from tigon.ops.gelu import gelu_reference
from tigon.ops.glu import geglu_reference, swiglu_reference
from tigon.ops.info_nce import info_nce_reference
from tigon.ops.layer_norm import layer_norm_reference
from tigon.ops.linear_cross_entropy import linear_cross_entropy_reference
from tigon.ops.rms_norm import NormedInput, add_rms_norm_reference, rms_norm_reference
from tigon.ops.mrope import mrope_reference, vision_rope_reference
from tigon.ops.rope import rope_reference

__all__ = [
    "FP8_MODES", "FUNCTIONS", "Float8Rows", "INTERPRET", "OP_MODULES", "Fp8Weight", "LoraProjection", "LossOptions", "LossOutput", "NormedInput", "QuantizedWeight", "autocast_dtype",
    "check_flags", "check_loss_options",
    "disabled", "op_names", "placement", "reset", "why_not_triton",
    "add_low_rank_reference", "add_rms_norm_glu_mlp_reference", "add_rms_norm_reference", "cross_entropy_reference",
    "dequantize_reference",
    "dequantize_fp8", "dora_norm_reference", "dora_scale_reference", "fp8_linear_reference", "fp8_rows_reference", "geglu_reference", "gelu_mlp_reference", "gelu_reference",
    "glu_mlp_reference", "info_nce_reference", "layer_norm_reference", "linear_cross_entropy_reference",
    "linear_group_reference", "lora_gated_mlp_reference", "lora_linear_group_reference", "lora_linear_reference",
    "mrope_reference", "quantize_rows_reference", "quantize_weight", "rms_norm_reference", "rope_reference", "swiglu_reference", "vision_rope_reference",
]
