"""``tigon.AutoModelForCausalLM``: transformers' auto class, with the family patched first."""

from __future__ import annotations

from typing import Any

import torch

from tigon.patch.apply import patch
from tigon.patch.switches import SWITCHES, covering


# from_pretrained arguments that locate the config as well as the weights.
_HUB_ARGUMENTS = ("cache_dir", "local_files_only", "revision", "subfolder", "token", "trust_remote_code")


def _split(kwargs: dict[str, Any]) -> dict[str, bool]:
    """Pop tigon's switches (and op names, which :func:`tigon.patch` refuses, naming the switch
    that covers each) out of `kwargs`, leaving transformers' arguments."""
    return {name: kwargs.pop(name) for name in list(kwargs) if name in SWITCHES or covering(name)}


class AutoModelForCausalLM:
    """Build or load a causal LM with its family's classes patched (:func:`tigon.patch`) first.

    Takes transformers' arguments plus tigon's switches (``rms_norm=False``, ...). The patch is
    on the family's classes, so it also holds for other models of that family in the process
    until ``tigon.unpatch(model_type)``. ``from_pretrained`` loads without transformers' hub
    kernels unless ``use_kernels=True`` is given (transformers >= 5.25 turns them on by default,
    and they would take the patched layers' place).
    """

    def __init__(self) -> None:
        raise TypeError("use AutoModelForCausalLM.from_pretrained(...) or .from_config(...)")

    @staticmethod
    def from_pretrained(pretrained_model_name_or_path: str, *args: Any, **kwargs: Any) -> torch.nn.Module:
        from transformers import AutoConfig
        from transformers import AutoModelForCausalLM as HFAuto

        switches = _split(kwargs)
        config = kwargs.get("config")
        if config is None:
            hub = {key: kwargs[key] for key in _HUB_ARGUMENTS if key in kwargs}
            config = AutoConfig.from_pretrained(pretrained_model_name_or_path, **hub)
        patch(config.model_type, **switches)
        kwargs.setdefault("use_kernels", False)
        return HFAuto.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    @staticmethod
    def from_config(config: Any, **kwargs: Any) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM as HFAuto

        patch(config.model_type, **_split(kwargs))
        return HFAuto.from_config(config, **kwargs)
