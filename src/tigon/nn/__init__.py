"""Drop-in modules over tigon.functional, state-dict compatible with the modules they replace."""

from tigon.nn.norms import LayerNorm, RMSNorm

__all__ = ["LayerNorm", "RMSNorm"]
