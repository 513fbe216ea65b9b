"""Patch Hugging Face decoder models to run tigon's kernels: ``tigon.patch(model)``."""

from tigon.patch.apply import SWITCHES, Patched, patch, unpatch
from tigon.patch.auto import AutoModelForCausalLM
from tigon.patch.families import FAMILIES

__all__ = ["FAMILIES", "SWITCHES", "AutoModelForCausalLM", "Patched", "patch", "unpatch"]
