"""Patch Hugging Face decoder models to run tigon's kernels: ``tigon.patch(model)``."""

from tigon.patch.apply import HIDDEN, Patched, add_hidden_output, patch, token_accuracy, unpatch
from tigon.patch.auto import AutoModelForCausalLM
from tigon.patch.families import FAMILIES, VLM_FAMILIES, VLM_OVER_TEXT
from tigon.patch.switches import SWITCHES, check_switch_names, covering

__all__ = [
    "FAMILIES", "HIDDEN", "SWITCHES", "AutoModelForCausalLM", "Patched", "add_hidden_output", "check_switch_names",
    "VLM_FAMILIES", "VLM_OVER_TEXT", "covering", "patch", "token_accuracy", "unpatch",
]
