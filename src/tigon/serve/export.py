"""`tigon export`: a model or LoRA adapter as one standalone Hugging Face model (merged
safetensors) or as a GGUF file that llama.cpp and Ollama load, with an Ollama `Modelfile`.

The GGUF is written with the `gguf` package's `GGUFWriter`; tensor names come from its
`TensorNameMap` and metadata keys from its writer methods, laid out as llama.cpp's
convert_hf_to_gguf lays out these families: Llama and Mistral as `llama` (q/k rows reordered from
Hugging Face's half-split RoPE to llama.cpp's interleaved one), Qwen2 and Qwen3 under their own
names (NeoX RoPE, rows as they are). The tokenizer (vocabulary, token types, merges or scores,
special ids) and the chat template are embedded.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger("tigon.serve")

GGUF_FILE = "model.gguf"
MODELFILE = "Modelfile"


@dataclass(frozen=True)
class Family:
    arch: str  # the gguf package's MODEL_ARCH member name
    interleave_rope: bool  # llama.cpp's LLAMA rope ("normal") pairs adjacent dims; HF pairs i with i + d/2


FAMILIES = {
    "llama": Family("LLAMA", True),
    "mistral": Family("LLAMA", True),
    "qwen2": Family("QWEN2", False),
    "qwen3": Family("QWEN3", False),
}
_MERGED_DTYPES = {"auto": "auto", "bf16": "bf16", "f16": "fp16", "f32": "fp32"}
# Split patterns of the byte-level BPE pre-tokenizers llama.cpp knows by these names.
_PRE_TOKENIZERS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
}


def export(path: str, to: str, output: str, dtype: str = "auto", base: str | None = None,
           overwrite: bool = False) -> Path:
    """`tigon export PATH --to merged|gguf --output OUT [--overwrite]`."""
    if to == "merged":
        return export_merged(path, output, dtype, base, overwrite)
    if to == "gguf":
        return export_gguf(path, output, dtype, base, overwrite)
    raise ValueError(f"--to {to}: expected merged or gguf")


def export_merged(path: str, output: str, dtype: str = "auto", base: str | None = None,
                  overwrite: bool = False) -> Path:
    """A standalone HF model (safetensors, config, tokenizer) in `output`: a LoRA adapter folded
    into its base (in fp32, as `tigon merge` does), any other model re-saved in `dtype`. An
    existing `output` is replaced only with `overwrite` (see `check_output`)."""
    if dtype not in _MERGED_DTYPES:
        raise ValueError(f"--dtype {dtype} is for --to gguf; merged models take {', '.join(_MERGED_DTYPES)}")
    if _is_gguf_file(output):
        raise ValueError(f"--output {output}: --to merged writes a directory; a .gguf file is what --to gguf writes")
    from tigon.train.checkpoint import check_output, written_atomically
    from tigon.train.infer import is_adapter, merge
    from tigon.train.modeling import DTYPES, load_model, load_tokenizer

    if is_adapter(path):
        return merge(path, output, base=base, dtype=_MERGED_DTYPES[dtype], overwrite=overwrite)
    if base is not None:
        raise ValueError(f"--base only applies to a LoRA adapter, and {path} is not one (no adapter_config.json)")
    out = Path(output)
    check_output(out, overwrite, [path])
    from tigon.train.vision import is_vision_config, load_processor, load_vision_model, model_config

    config = model_config(path)
    weights = DTYPES[_MERGED_DTYPES[dtype]] if dtype != "auto" else "auto"
    if is_vision_config(config):  # a vision-language model, saved whole with its processor
        model, processor = load_vision_model(path, weights), load_processor(path, config)
    else:
        model, processor = load_model(path, weights), load_tokenizer(path)
    with written_atomically(out) as staging:
        model.save_pretrained(staging)
        processor.save_pretrained(staging)
    log.info("tigon export: %s -> %s (%s)", path, out, str(model.dtype).replace("torch.", ""))
    return out


def _load_merged(path: str, base: str | None) -> tuple[Any, Any]:
    """The model (an adapter merged on its base) on the CPU in its own dtype, and its tokenizer."""
    from transformers import AutoConfig

    from tigon.serve.loading import load_model_for_serving

    saved = getattr(AutoConfig.from_pretrained(_config_source(path, base)), "dtype", None)
    saved = getattr(torch, saved) if isinstance(saved, str) else saved
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(saved, "fp32")
    model, tokenizer = load_model_for_serving(path, name, base)
    return model.cpu(), tokenizer


def _is_gguf_file(output: str) -> bool:
    """Whether `--output` names a GGUF file rather than a directory."""
    return Path(output).suffix.lower() == ".gguf"


def _config_source(path: str, base: str | None) -> str:
    """Where the model's config is: the directory, or an adapter's base model."""
    from tigon.train.infer import is_adapter

    if not is_adapter(path):
        return path
    if base is not None:
        return base
    from peft import PeftConfig

    return PeftConfig.from_pretrained(path).base_model_name_or_path


def interleave_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k projection rows (or biases) reordered per head from HF's RoPE layout, which rotates
    dim i with i + d/2, to llama.cpp's LLAMA layout, which rotates 2i with 2i + 1."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _tensor_types(dtype: str) -> tuple[Any, Any]:
    """(the GGUF file type, the storage type of its matrices) for --dtype."""
    import gguf

    q, f = gguf.GGMLQuantizationType, gguf.LlamaFileType
    return {"f32": (f.ALL_F32, q.F32), "f16": (f.MOSTLY_F16, q.F16), "bf16": (f.MOSTLY_BF16, q.BF16),
            "q8_0": (f.MOSTLY_Q8_0, q.Q8_0)}[dtype]


def _encode(weight: np.ndarray, qtype: Any) -> tuple[np.ndarray, Any]:
    """A tensor in the storage type: 1-D tensors (norms, biases) stay F32 as llama.cpp keeps them,
    and a matrix whose rows do not split into quantization blocks falls back to F16."""
    import gguf

    q = gguf.GGMLQuantizationType
    if weight.ndim == 1 or qtype == q.F32:
        return weight.astype(np.float32), q.F32
    if qtype == q.Q8_0 and weight.shape[-1] % gguf.GGML_QUANT_SIZES[q.Q8_0][0]:
        qtype = q.F16
    return gguf.quants.quantize(weight.astype(np.float32), qtype), qtype


def _write_config(writer: Any, config: Any, family: Family, name: str, file_type: Any) -> None:
    import gguf

    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_name(name)
    writer.add_file_type(file_type)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // heads or family.arch == "QWEN3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif kind not in ("default", "llama3"):  # llama3's scaling is the rope_freqs tensor (below)
        raise ValueError(f"rope scaling {kind!r} cannot be written to GGUF by tigon export; "
                         "supported: none, linear, yarn, llama3")


def llama3_rope_factors(config: Any) -> np.ndarray | None:
    """Llama 3.1's RoPE frequency divisors (`rope_freqs.weight`, one per rotated pair), or None
    for models without that scaling: high frequencies kept, low ones divided by `factor`, and a
    smooth blend between the two wavelength thresholds."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_context = float(rope["original_max_position_embeddings"])
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < old_context / high:
            factors.append(1.0)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _write_tokenizer(writer: Any, tokenizer: Any, vocab_size: int) -> None:
    import gguf

    with tempfile.TemporaryDirectory(prefix="tigon-gguf-") as tmp:
        tokenizer.save_pretrained(tmp)
        spec = json.loads((Path(tmp) / "tokenizer.json").read_text(encoding="utf-8"))
        model = spec.get("model", {})
        if model.get("type") == "BPE" and model.get("byte_fallback"):  # SentencePiece-style (Llama 2, Mistral)
            vocab = gguf.LlamaHfVocab(Path(tmp))
            tokens, scores, types = zip(*vocab.all_tokens())
            writer.add_tokenizer_model("llama")
            writer.add_tokenizer_pre("default")
            writer.add_token_list(list(tokens))
            writer.add_token_scores(list(scores))
            writer.add_token_types(list(types))
            merges = False
        elif model.get("type") == "BPE" and (spec.get("decoder") or {}).get("type") == "ByteLevel":
            tokens, types = _byte_level_vocab(tokenizer, vocab_size)
            writer.add_tokenizer_model("gpt2")
            writer.add_tokenizer_pre(_pre_tokenizer_name(spec.get("pre_tokenizer")))
            writer.add_token_list(tokens)
            writer.add_token_types(types)
            merges = True
        else:
            raise ValueError(f"tokenizer {model.get('type')!r} cannot be written to GGUF by tigon export; "
                             "supported: byte-level BPE (GPT-2, Llama 3, Qwen) and SentencePiece-style BPE")
        gguf.SpecialVocab(Path(tmp), load_merges=merges, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)


def _byte_level_vocab(tokenizer: Any, vocab_size: int) -> tuple[list[str], list[int]]:
    """Each id's token as the vocabulary spells it, and its type: added special tokens are
    CONTROL, other added tokens USER_DEFINED; ids past the tokenizer (a padded embedding) UNUSED."""
    import gguf

    added = {tok.content: tok for tok in tokenizer.added_tokens_decoder.values()}
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif token in added:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if added[token].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def _pre_tokenizer_name(pre: dict | None) -> str:
    """llama.cpp's name for this byte-level pre-tokenizer (how text is split before the merges)."""
    pre = pre or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    splits = [s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"]
    if not splits and any(s.get("type") == "ByteLevel" and s.get("use_regex", True) for s in steps):
        return "gpt-2"
    if len(splits) == 1 and splits[0] in _PRE_TOKENIZERS:
        return _PRE_TOKENIZERS[splits[0]]
    log.warning("tigon export: this tokenizer's pre-tokenizer is not one llama.cpp names (GPT-2, Llama 3, "
                "Qwen2); written as 'default', which may split some text differently from transformers")
    return "default"


def export_gguf(path: str, output: str, dtype: str = "auto", base: str | None = None,
                overwrite: bool = False) -> Path:
    """`output`/model.gguf and `output`/Modelfile for `path` (an adapter merged on its base), or,
    for an `output` that ends in .gguf, that one file. An existing `output` is replaced only with
    `overwrite` (see `check_output`). Returns the GGUF file's path."""
    import gguf

    if dtype not in ("auto", "bf16", "f16", "f32", "q8_0"):
        raise ValueError(f"--dtype {dtype}: GGUF takes auto, bf16, f16, f32 or q8_0")
    from transformers import AutoConfig

    from tigon.train.checkpoint import check_output, written_atomically

    out = Path(output)
    config_source = _config_source(path, base)
    check_output(out, overwrite, [path, config_source])
    from tigon.train.modeling import source_kwargs

    # Where the config can come from (a missing directory is said as one, not as a bad hub id).
    config = AutoConfig.from_pretrained(config_source, **source_kwargs(config_source))
    family_name = config.model_type
    family = FAMILIES.get(family_name)
    if family is None and getattr(config, "vision_config", None) is not None:
        raise ValueError(f"{path}: GGUF is not available for {family_name}, a vision-language model (its image "
                         "encoder goes in a separate mmproj file, which tigon export does not write); "
                         "export it with --to merged")
    if family is None:
        raise ValueError(f"{path}: model family {family_name!r} cannot be exported to GGUF; "
                         f"supported: {', '.join(FAMILIES)}")
    model, tokenizer = _load_merged(path, base)
    if dtype == "auto":
        dtype = {torch.bfloat16: "bf16", torch.float16: "f16"}.get(model.dtype, "f32")
    file_type, qtype = _tensor_types(dtype)
    arch = getattr(gguf.MODEL_ARCH, family.arch)
    single_file = _is_gguf_file(output)
    with written_atomically(out, directory=not single_file) as staging:
        writer = gguf.GGUFWriter(staging if single_file else staging / GGUF_FILE, gguf.MODEL_ARCH_NAMES[arch])
        try:
            _write_gguf(writer, model, tokenizer, family, path, file_type, qtype)
        finally:
            writer.close()
        if not single_file:
            (staging / MODELFILE).write_text(modelfile(tokenizer, GGUF_FILE))
    if single_file:
        log.info("tigon export: %s -> %s (%s, %s)", path, out, family_name, dtype)
        return out
    log.info("tigon export: %s -> %s (%s, %s) and %s", path, out / GGUF_FILE, family_name, dtype, out / MODELFILE)
    return out / GGUF_FILE


def _write_gguf(writer: Any, model: Any, tokenizer: Any, family: Family, path: str, file_type: Any,
                qtype: Any) -> None:
    """The model's settings, tokenizer and tensors (named and laid out as llama.cpp reads them)."""
    import gguf

    config = model.config
    arch = getattr(gguf.MODEL_ARCH, family.arch)
    _write_config(writer, config, family, Path(path).resolve().name, file_type)
    _write_tokenizer(writer, tokenizer, config.vocab_size)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    factors = llama3_rope_factors(config)
    if factors is not None:
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp reads a tied head from token_embd
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"{path}: tensor {hf_name} has no GGUF name for {config.model_type}")
        tensor = tensor.detach().float()
        if family.interleave_rope and ".self_attn.q_proj." in hf_name:
            tensor = interleave_rope_rows(tensor, heads)
        elif family.interleave_rope and ".self_attn.k_proj." in hf_name:
            tensor = interleave_rope_rows(tensor, kv_heads)
        data, stored = _encode(tensor.numpy(), qtype)
        writer.add_tensor(name, data, raw_dtype=stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()


def modelfile(tokenizer: Any, gguf_name: str) -> str:
    """An Ollama Modelfile for the GGUF: its chat template translated to Ollama's Go template
    where the Jinja template is one fixed prefix per role and one suffix per message (ChatML,
    Llama 3 and tigon's own templates are), and the end-of-turn markers as stop sequences."""
    lines = [f"FROM ./{gguf_name}"]
    pieces = _template_pieces(tokenizer)
    stops = [tokenizer.eos_token] if tokenizer.eos_token else []
    if pieces is None:
        lines.append("# no TEMPLATE: this chat template does not reduce to per-role prefixes; Ollama falls back "
                     "to the template embedded in the GGUF")
    else:
        prefixes, suffix = pieces
        roles = "".join(f'{{{{ {"if" if i == 0 else "else if"} eq .Role "{role}" }}}}{pre}{{{{ .Content }}}}{suffix}'
                        for i, (role, pre) in enumerate(prefixes.items()))
        lines.append(f'TEMPLATE """{{{{ range .Messages }}}}{roles}{{{{ end }}}}{{{{ end }}}}{prefixes["assistant"]}"""')
        if suffix.strip() and suffix.strip() not in stops:
            stops.append(suffix.strip())
    lines += [f"PARAMETER stop {json.dumps(stop)}" for stop in stops]
    return "\n".join(lines) + "\n"


def _template_pieces(tokenizer: Any) -> tuple[dict[str, str], str] | None:
    """({role: prefix}, suffix) such that the chat template renders every message as prefix +
    content + suffix and asks for a reply with the assistant prefix, checked on a four-turn chat;
    None if it does not."""
    from tigon.train.template import render

    marks = {"system": "\x01S\x01", "user": "\x01U\x01", "assistant": "\x01A\x01"}
    for roles in (("system", "user", "assistant"), ("user", "assistant")):
        try:
            text = render(tokenizer, [{"role": r, "content": marks[r]} for r in roles], False)
            parts, rest = [], text
            for r in roles:
                head, sep, rest = rest.partition(marks[r])
                if not sep:
                    raise ValueError(r)
                parts.append(head)
            suffix = rest
            if not all(p.startswith(suffix) for p in parts[1:]):
                continue
            prefixes = dict(zip(roles, [parts[0]] + [p[len(suffix):] for p in parts[1:]]))
            chat = [{"role": r, "content": f"({r} {i})"} for i, r in enumerate(roles + ("user",))]
            ours = "".join(prefixes[m["role"]] + m["content"] + suffix for m in chat) + prefixes["assistant"]
            if ours == render(tokenizer, chat, True):
                return prefixes, suffix
        except Exception:  # a template may refuse a role or an order: try the next shape, else give up
            continue
    return None
