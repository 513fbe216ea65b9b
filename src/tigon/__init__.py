"""tigon: fused Triton kernels for fine-tuning decoder-only LLMs."""

from tigon import functional, nn

__version__ = "0.1.0"
__all__ = ["functional", "nn", "__version__"]
