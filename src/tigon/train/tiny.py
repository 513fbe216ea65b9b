"""The built-in default: a tiny Llama-style model made from a config (random weights) and a
byte-level BPE tokenizer trained on the run's own data, so `tigon sft` runs with nothing to
download. Small enough to learn the bundled instructions on a CPU in a few minutes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tigon.train.data import Sample

BUNDLED_DATASET = Path(__file__).parent / "data" / "instructions.jsonl"

SPECIAL_TOKENS = {"pad_token": "<|pad|>", "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 1024


def build_tokenizer(samples: list[Sample]) -> Any:
    """A byte-level BPE tokenizer (any text encodes) trained on the samples' text, with ChatML
    special tokens and template. Training is deterministic, so a resumed run rebuilds the same one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [s.text for s in samples if s.text is not None]
    texts += [m["content"] for s in samples if s.messages for m in s.messages]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = [*SPECIAL_TOKENS.values(), "<|im_start|>"]
    core.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, **SPECIAL_TOKENS,
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def random_model(config: Any, seed: int, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, auto: Any = None) -> torch.nn.Module:
    """The causal LM of `config` (any family's config) with weights drawn from `seed`, made
    directly on `device` in `dtype`: the one factory behind the built-in model, the benchmarks'
    models and the tests' tiny models. `auto` is the Auto class to build it with (default
    AutoModelForCausalLM; AutoModelForImageTextToText for a vision-language config). The caller's
    random state is left as it was."""
    from transformers import AutoModelForCausalLM

    auto = auto or AutoModelForCausalLM
    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        return auto.from_config(config, dtype=dtype) if dtype else auto.from_config(config)


def build_model(tokenizer: Any, seed: int, classifier: dict[str, Any] | None = None, **sizes: Any) -> torch.nn.Module:
    """A ~1M-parameter Llama (4 layers, hidden 128, grouped-query attention) with seeded weights.
    `sizes` override LlamaConfig fields, e.g. to build a benchmark-sized model from nothing.
    With `classifier` (its config keywords: labels) a sequence classifier of that backbone."""
    from transformers import LlamaConfig

    config = LlamaConfig(**{
        "vocab_size": len(tokenizer), "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
        "tie_word_embeddings": True, "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "attn_implementation": "sdpa", **(classifier or {}), **sizes,
    })
    if classifier is None:
        return random_model(config, seed)
    from transformers import AutoModelForSequenceClassification

    return random_model(config, seed, auto=AutoModelForSequenceClassification)
