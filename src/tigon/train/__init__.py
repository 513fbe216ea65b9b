"""`tigon sft`: supervised fine-tuning on the transformers Trainer (and PEFT for LoRA) with tigon's
kernels patched in; `tigon rlhf`: preference training on TRL's trainers with tigon's fused
preference loss.

The names below load on first use, so that the `tigon` command line (which reads the sft options
from `tigon.train.config`) does not import transformers and peft until a training command runs,
and nothing but `tigon rlhf` imports TRL.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SFTConfig": "config", "SFTError": "config", "add_sft_arguments": "config",
    "config_from_args": "config", "resolve": "config", "RLHFConfig": "config", "resolve_rlhf": "config",
    "chat": "infer", "generate": "infer", "load_for_inference": "infer", "merge": "infer",
    "run_sft": "run", "run_rlhf": "rlhf",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tigon.train' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tigon.train.{_EXPORTS[name]}"), name)
