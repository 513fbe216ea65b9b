"""tigon's ops as plain functions: drop-in, differentiable, Triton where it can run.

One for each public function of the op table, :data:`tigon.ops.OP_MODULES` (rms_norm,
linear_cross_entropy, lora_linear, ...), each documented where its op is.
"""

from tigon.ops import FUNCTIONS

globals().update(FUNCTIONS)
__all__ = list(FUNCTIONS)
