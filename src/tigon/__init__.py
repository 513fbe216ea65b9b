"""tigon: fused Triton kernels for fine-tuning decoder-only LLMs."""

from tigon import functional, nn
from tigon.patch import AutoModelForCausalLM, patch, unpatch

__version__ = "0.1.0"
__all__ = ["AutoModelForCausalLM", "functional", "nn", "patch", "unpatch", "__version__"]
