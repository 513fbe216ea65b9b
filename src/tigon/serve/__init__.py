"""From checkpoint to service: `tigon serve` (an OpenAI-compatible API on transformers' continuous
batching, or vLLM), `tigon export` (merged safetensors, GGUF + Ollama Modelfile) and `tigon eval`
(loss / perplexity as `tigon sft` scores data, and lm-evaluation-harness tasks).

The names below load on first use, so that building the `tigon` command line stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "engine", "Sampling": "engine",
    "ServedModel": "server", "build_app": "server", "serve_forever": "server",
    "load_model_for_serving": "loading", "resolve_model_path": "loading",
    "export": "export", "export_gguf": "export", "export_merged": "export",
    "EvalSettings": "evaluate", "run_eval": "evaluate", "dataset_loss": "evaluate",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tigon.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tigon.serve.{_EXPORTS[name]}"), name)
