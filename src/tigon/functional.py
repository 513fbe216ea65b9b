"""tigon's ops as plain functions: drop-in, differentiable, Triton where it can run."""

from tigon.ops.composite.glu_mlp import glu_mlp
from tigon.ops.composite.linear_group import linear_group
from tigon.ops.composite.lora import lora_linear, lora_linear_group
from tigon.ops.composite.lora_mlp import lora_gated_mlp
from tigon.ops.composite.norm_mlp import add_rms_norm_glu_mlp
from tigon.ops.cross_entropy import cross_entropy
from tigon.ops.dequantize import dequantize
from tigon.ops.dora import dora_norm, dora_scale
from tigon.ops.glu import geglu, swiglu
from tigon.ops.layer_norm import layer_norm
from tigon.ops.linear_cross_entropy import linear_cross_entropy
from tigon.ops.linear_distill import linear_distill_loss
from tigon.ops.linear_log_probs import linear_log_probs
from tigon.ops.linear_policy import linear_policy_loss
from tigon.ops.linear_preference import linear_preference_loss
from tigon.ops.moe import moe_experts
from tigon.ops.rms_norm import add_rms_norm, rms_norm
from tigon.ops.rope import rope

__all__ = ["cross_entropy", "linear_cross_entropy", "linear_log_probs", "linear_preference_loss", "linear_policy_loss", "linear_distill_loss", "add_rms_norm", "add_rms_norm_glu_mlp", "dequantize", "dora_norm", "dora_scale", "geglu", "glu_mlp", "swiglu", "layer_norm", "linear_group", "lora_gated_mlp", "lora_linear", "lora_linear_group", "moe_experts", "rms_norm", "rope"]
