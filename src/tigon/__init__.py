"""tigon: fused Triton kernels for fine-tuning decoder-only LLMs.

Its public names load on first use, so that ``tigon --help`` and a bad command-line argument answer
without importing torch and Triton.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__version__ = "0.1.0"
__all__ = ["AutoModelForCausalLM", "functional", "nn", "patch", "unpatch", "__version__"]

# public name -> the module that defines it (a submodule's own name: the submodule itself)
_HOMES = {"AutoModelForCausalLM": "tigon.patch", "functional": "tigon.functional", "nn": "tigon.nn",
          "patch": "tigon.patch", "unpatch": "tigon.patch"}


class _Package(types.ModuleType):
    """The package, whose ``tigon.patch`` is the function: the import system binds every
    subpackage to its parent's attribute of the same name when it first loads it, which here
    would replace the function by the ``tigon.patch`` subpackage."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "patch" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        home = _HOMES.get(name)
        if home is None:
            raise AttributeError(f"module 'tigon' has no attribute {name!r}")
        module = importlib.import_module(home)
        value = module if home == f"tigon.{name}" and name != "patch" else getattr(module, name)
        super().__setattr__(name, value)
        return value


sys.modules[__name__].__class__ = _Package
