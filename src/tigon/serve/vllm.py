"""`tigon serve --backend vllm`: the same model handed to vLLM's OpenAI server (a LoRA adapter is
merged first, into a temporary directory, so vLLM loads one plain model). vLLM's server is then
the front: it checks the API key itself (on its /v1 routes), and its own request limits apply,
not those of tigon's server."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def vllm_command(model_dir: str, name: str, host: str, port: int, dtype: str, max_model_len: int | None,
                 chat_template: str | None) -> list[str]:
    """The command line of vLLM's OpenAI-compatible server for these settings."""
    dtypes = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", name, "--host", host, "--port", str(port), "--dtype", dtypes[dtype]]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if chat_template is not None:
        cmd += ["--chat-template", chat_template]
    return cmd


def serve_with_vllm(path: str, name: str, host: str, port: int, dtype: str, base: str | None,
                    max_model_len: int | None, api_key: str | None = None) -> int:
    """Run vLLM's server on `path` until it exits; its exit status. An `api_key` reaches vLLM
    through its environment (VLLM_API_KEY), where other users cannot read it, unlike a
    command line."""
    if importlib.util.find_spec("vllm") is None:
        raise ValueError("--backend vllm: vLLM is not installed (pip install vllm); "
                         "the default --backend transformers needs nothing more")
    from tigon.train.infer import is_adapter, merge
    from tigon.train.modeling import load_tokenizer
    from tigon.train.template import DEFAULT_CHAT_TEMPLATE

    with tempfile.TemporaryDirectory(prefix="tigon-vllm-") as tmp:
        model_dir = path
        if is_adapter(path):
            model_dir = str(merge(path, str(Path(tmp) / "merged"), base=base))
        template = None
        if not getattr(load_tokenizer(model_dir), "chat_template", None):
            # the template tigon sft trains such models with (tigon.train.template)
            template = str(Path(tmp) / "chat_template.jinja")
            Path(template).write_text(DEFAULT_CHAT_TEMPLATE)
        cmd = vllm_command(model_dir, name, host, port, dtype, max_model_len, template)
        env = None
        if api_key is not None:
            env = dict(os.environ, VLLM_API_KEY=api_key)
            print("tigon serve: --backend vllm: vLLM's server checks the API key on its /v1 routes only, and has "
                  "none of tigon's request limits (--max-body-mb, --max-inflight-mb, --max-choices)",
                  file=sys.stderr, flush=True)
        return subprocess.call(cmd, env=env)  # Ctrl-C reaches vLLM too (same process group): it shuts itself down
