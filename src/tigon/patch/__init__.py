"""Patch Hugging Face decoder models to run tigon's kernels: ``tigon.patch(model)``."""

from tigon.patch.apply import Patched, patch, unpatch
from tigon.patch.auto import AutoModelForCausalLM
from tigon.patch.families import FAMILIES
from tigon.patch.switches import SWITCHES, check_switch_names, covering

__all__ = ["FAMILIES", "SWITCHES", "AutoModelForCausalLM", "Patched", "check_switch_names", "covering", "patch", "unpatch"]
