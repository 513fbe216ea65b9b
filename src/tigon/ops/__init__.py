"""tigon's kernel floor: fused Triton kernels, one op per file (``tigon/ops/<op>.py``: kernels,
PyTorch reference, autograd Function, public function), and in :mod:`tigon.ops.composite` the ops
that are cuBLAS choreography around them (LoRA on plain, quantised and DoRA projections, linear
groups, gated MLPs). One dispatcher
(:mod:`tigon.ops._dispatch`) decides for every op where it runs. Imports torch and triton only.

The public functions are in :mod:`tigon.functional`; this package exports what the layers above
need besides them: the argument types, the references (test oracles and benchmark baselines) and
the dispatch introspection of ``tigon env``.
"""

# In dispatch order: what `tigon env` lists and TIGON_DISABLE names.
from tigon.ops import rms_norm as _rms_norm  # noqa: F401
from tigon.ops import layer_norm as _layer_norm  # noqa: F401
from tigon.ops import rope as _rope  # noqa: F401
from tigon.ops import glu as _glu  # noqa: F401
from tigon.ops.composite import glu_mlp as _glu_mlp  # noqa: F401
from tigon.ops import cross_entropy as _cross_entropy  # noqa: F401
from tigon.ops import linear_cross_entropy as _linear_cross_entropy  # noqa: F401
from tigon.ops import linear_log_probs as _linear_log_probs  # noqa: F401
from tigon.ops import linear_preference as _linear_preference  # noqa: F401
from tigon.ops import linear_policy as _linear_policy  # noqa: F401
from tigon.ops import linear_distill as _linear_distill  # noqa: F401
from tigon.ops.composite import linear_group as _linear_group  # noqa: F401
from tigon.ops import dequantize as _dequantize  # noqa: F401
from tigon.ops import dora as _dora  # noqa: F401
from tigon.ops.composite import lora as _lora  # noqa: F401
from tigon.ops.composite import lora_mlp as _lora_mlp  # noqa: F401
from tigon.ops.composite import norm_mlp as _norm_mlp  # noqa: F401
from tigon.ops import moe as _moe  # noqa: F401
from tigon.ops._dispatch import (
    INTERPRET,
    autocast_dtype,
    disabled,
    op_names,
    placement,
    reset,
    why_not_triton,
)
from tigon.ops.composite.glu_mlp import glu_mlp_reference
from tigon.ops.composite.linear_group import linear_group_reference
from tigon.ops.composite.lora import LoraProjection, lora_linear_group_reference, lora_linear_reference
from tigon.ops.composite.lora_mlp import lora_gated_mlp_reference
from tigon.ops.composite.norm_mlp import add_rms_norm_glu_mlp_reference
from tigon.ops.cross_entropy import LossOptions, LossOutput, check_flags, check_loss_options, cross_entropy_reference
from tigon.ops.dequantize import QuantizedWeight, dequantize_reference
from tigon.ops.dora import dora_norm_reference, dora_scale_reference
from tigon.ops.glu import geglu_reference, swiglu_reference
from tigon.ops.layer_norm import layer_norm_reference
from tigon.ops.linear_cross_entropy import linear_cross_entropy_reference
from tigon.ops.rms_norm import NormedInput, add_rms_norm_reference, rms_norm_reference
from tigon.ops.rope import rope_reference

__all__ = [
    "INTERPRET", "LoraProjection", "LossOptions", "LossOutput", "NormedInput", "QuantizedWeight", "autocast_dtype",
    "check_flags", "check_loss_options",
    "disabled", "op_names", "placement", "reset", "why_not_triton",
    "add_rms_norm_glu_mlp_reference", "add_rms_norm_reference", "cross_entropy_reference", "dequantize_reference",
    "dora_norm_reference", "dora_scale_reference", "geglu_reference",
    "glu_mlp_reference", "layer_norm_reference", "linear_cross_entropy_reference", "linear_group_reference",
    "lora_gated_mlp_reference", "lora_linear_group_reference", "lora_linear_reference", "rms_norm_reference",
    "rope_reference", "swiglu_reference",
]
