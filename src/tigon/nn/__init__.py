"""Drop-in modules over tigon.functional, state-dict compatible with the modules they replace."""

from tigon.nn.mlp import GeGLUMLP, SwiGLUMLP
from tigon.nn.norms import LayerNorm, RMSNorm

__all__ = ["GeGLUMLP", "LayerNorm", "RMSNorm", "SwiGLUMLP"]
