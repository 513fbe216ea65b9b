"""tigon's ops as plain functions: drop-in, differentiable, Triton where it can run."""

from tigon.ops.layer_norm import layer_norm
from tigon.ops.rms_norm import add_rms_norm, rms_norm

__all__ = ["add_rms_norm", "layer_norm", "rms_norm"]
