"""tigon: fused Triton kernels for fine-tuning decoder-only LLMs."""

from tigon import functional, nn
from tigon.patch import patch, unpatch

__version__ = "0.1.0"
__all__ = ["functional", "nn", "patch", "unpatch", "__version__"]
