"""Drop-in modules over tigon.functional, state-dict compatible with the modules they replace."""

from tigon.nn.fp8 import Fp8Linear
from tigon.nn.mlp import GeGLUMLP, SwiGLUMLP
from tigon.nn.loss import CrossEntropyLoss, LinearCrossEntropyLoss
from tigon.nn.norms import LayerNorm, RMSNorm

__all__ = ["CrossEntropyLoss", "Fp8Linear", "LinearCrossEntropyLoss", "GeGLUMLP", "LayerNorm", "RMSNorm", "SwiGLUMLP"]
