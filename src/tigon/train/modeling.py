"""Models for `tigon sft`: load a tokenizer and model (or build the tiny default), quantised by
bitsandbytes (QLoRA) or to FP8 if asked, wrap it with LoRA (or a PEFT variant of it), and switch on tigon's
kernels. Loading failures become one-line SFTErrors."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from tigon.train.config import SFTConfig, SFTError

log = logging.getLogger("tigon.train")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def pick_dtype(name: str) -> torch.dtype:
    """`--dtype` as a torch dtype; auto is bf16 on a GPU that supports it, fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    if name == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise SFTError("--dtype bf16: this GPU has no bfloat16 support; use fp16 (LoRA) or fp32")
    return DTYPES[name]


def _not_found(model_id: str, err: Exception) -> SFTError:
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return SFTError(f"model not found: {model_id} ({reason})")


_PROBE_SECONDS = 3.0


@functools.lru_cache(maxsize=None)
def _hub_reachable(endpoint: str) -> bool:
    """Whether `endpoint` answers at all (any HTTP status), within a few seconds. Run in a thread
    so that a name lookup that hangs (which no socket timeout bounds) cannot hold the run."""
    import urllib.error
    import urllib.request

    answered = threading.Event()

    def probe() -> None:
        try:
            with urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=_PROBE_SECONDS):
                answered.set()
        except urllib.error.HTTPError:
            answered.set()
        except (OSError, ValueError):
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(_PROBE_SECONDS + 1)
    return answered.is_set()


def _offline() -> bool:
    from huggingface_hub import constants

    # Read now as well as at import: the variable may have been set since huggingface_hub was imported.
    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


# What a model directory holds, as save_pretrained writes it (said where a path is not one).
MODEL_DIRECTORY = "config.json, the weights (*.safetensors) and the tokenizer's files"


def source_kwargs(model_id: str, marks: tuple[str, ...] = ("config.json",)) -> dict[str, Any]:
    """The `from_pretrained` keywords that load `model_id` from where it is: a local directory as
    it is (one holding any of the files `marks`); a hub id from the hub, or from the local hub
    cache when the hub cannot be reached (or HF_HUB_OFFLINE is set). Where it can come from
    nowhere, one SFTError now, instead of the hub client's retries (about a minute without
    network) or its guess at what a file or an empty directory was meant to be."""
    from huggingface_hub import constants, try_to_load_from_cache

    path = Path(model_id).expanduser()
    if path.exists():
        if not path.is_dir():
            raise SFTError(f"{model_id}: a file, not a model directory (a model directory holds {MODEL_DIRECTORY})")
        if not any((path / name).is_file() for name in marks):
            raise SFTError(f"{model_id}: no {' or '.join(marks)} in this directory: not a model directory (a model "
                           f"directory holds {MODEL_DIRECTORY})")
        return {}
    if model_id.startswith((".", "/", "~")) or model_id.count("/") > 1:
        raise SFTError(f"model not found: {model_id} (no such directory)")
    offline = _offline()
    if not offline and _hub_reachable(constants.ENDPOINT):
        return {}
    if isinstance(try_to_load_from_cache(model_id, "config.json"), str):
        return {"local_files_only": True}
    if offline:
        raise SFTError(f"model not found: {model_id}: not a local directory, and not in the Hugging Face cache "
                       "while HF_HUB_OFFLINE is set: pass a model directory, or unset HF_HUB_OFFLINE to download it")
    raise SFTError(f"model not found: {model_id}: not a local directory, and the Hugging Face hub "
                   f"({constants.ENDPOINT}) cannot be reached: pass a model directory, or check the network "
                   "(and proxy settings)")


def load_tokenizer(model_id: str) -> Any:
    from transformers import AutoTokenizer

    kwargs = source_kwargs(model_id, marks=("tokenizer_config.json", "tokenizer.json"))
    try:
        return AutoTokenizer.from_pretrained(model_id, **kwargs)
    except (OSError, ValueError) as err:
        raise _not_found(model_id, err) from None


class _DropLine(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


def quiet_transformers() -> None:
    """No per-file load/save progress bars: they would break tigon's own progress bar. And none of
    DeepSpeed's accelerator warning: where it is installed, accelerate imports it on every run
    (its unwrap_model checks for a DeepSpeed engine), and on a CPU it warns that it fell back to
    the CPU, about a run that does not use it. Nor transformers' warning, when `tigon merge`
    dequantises a QLoRA base, that the weights were cast to the dtype tigon asked for. Nor the
    deprecation notices that tigon, PEFT and TRL trigger in newer transformers (gradient
    checkpointing under its old names; passing a generation config and generation arguments both,
    as TRL's on-policy trainers do every step): theirs to fix, and nothing a tigon user can act on, in the middle of
    the progress bar. Nor the gguf writer's account of the files it writes, at INFO where tigon
    logs its own lines (`tigon export` says what it wrote, once)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    logging.getLogger("gguf").setLevel(logging.WARNING)
    # transformers 5.2x renames gradient checkpointing to activation checkpointing; the 5.17 that
    # GPU images carry knows the old names alone, which tigon, PEFT and TRL call.
    warnings.filterwarnings("ignore", r"`(is_)?gradient_checkpointing(_enable|_kwargs)?` is deprecated", FutureWarning)
    for name, start in (("DeepSpeed", "Setting accelerator to CPU"),  # DeepSpeed's own logger, kept across its import
                        ("transformers.integrations.bitsandbytes", "The modules are dequantized"),
                        ("transformers.generation.utils", "Passing `generation_config` together with")):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLine) for f in logger.filters):
            logger.addFilter(_DropLine(start))


# Written beside a LoRA adapter trained on a quantised base: how the base was quantised, so that
# `tigon merge` (and chat, serve, export) rebuild the weights it was trained on.
QUANT_FILE = "tigon_quantization.json"


def quantization_config(quant: str, dtype: torch.dtype) -> Any:
    """transformers' BitsAndBytesConfig for ``--quant``: 4-bit with double quantisation (the
    absmaxes quantised too: ~0.4 bits per weight less) computing in `dtype`, or LLM.int8; or
    tigon's :class:`Fp8Quantization`."""
    if quant == "fp8":
        return Fp8Quantization(dtype)
    from transformers import BitsAndBytesConfig

    if quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant, bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype)


class Fp8Quantization:
    """``--quant fp8``: the base's linears (all but the LM head) in e4m3 under tigon's FP8 ops
    (:class:`tigon.nn.Fp8Linear`): quantised per output row as they load, or an FP8 checkpoint's
    block-scaled weights as they are (:func:`load_fp8_checkpoint`)."""

    name = "fp8"

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        self.dtype = dtype  # what the weights were loaded in before they were quantised

    def to_dict(self) -> dict[str, str]:
        return {"quant_method": "fp8", "dtype": str(self.dtype).replace("torch.", "")}


# Lets `tigon sft --quant fp8` run the FP8 ops' reference (dequantise + matmul) where no FP8 GPU is:
# for tests and trying the flow on a CPU, never chosen for a user who asked for FP8 on a GPU.
FP8_EMULATE = "TIGON_FP8_EMULATE"


def check_fp8(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> None:
    """One SFTError line where `device` has no FP8 tensor cores (a CPU, a GPU below compute
    capability 8.9), or the run's `dtype` is not the bfloat16 FP8 GEMMs write: ``--quant fp8``
    never trains on the dequantised weights unasked."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) >= (8, 9):
            if dtype != torch.bfloat16:
                raise SFTError(f"--quant fp8 computes in bfloat16 (what FP8 GEMMs write), not "
                               f"{str(dtype).replace('torch.', '')}: use --dtype bf16 (or auto)")
            return
        raise SFTError(f"--quant fp8: {torch.cuda.get_device_name(device)} has compute capability {major}.{minor}; "
                       "FP8 GEMMs need 8.9+ (Ada, Hopper or newer): use --quant nf4 (QLoRA) on this GPU")
    if os.environ.get(FP8_EMULATE, "") != "1":
        raise SFTError(f"--quant fp8: this run is on the {device.type}, which has no FP8 GEMMs: it needs a GPU of "
                       f"compute capability 8.9+ ({FP8_EMULATE}=1 runs the dequantised reference, for tests)")


def fp8_checkpoint(model_id: str) -> dict[str, Any] | None:
    """The ``quantization_config`` of `model_id` when it is an FP8 checkpoint (quant_method fp8,
    as transformers' FineGrainedFP8 writes and DeepSeek-V3, Qwen3 and others ship), else None."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_id, **source_kwargs(model_id))
    except (OSError, ValueError) as err:
        raise _not_found(model_id, err) from None
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None and not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    return quantization if quantization is not None and quantization.get("quant_method") == "fp8" else None


def _skipped(name: str, skip: list[str]) -> bool:
    return any(name == s or name.endswith("." + s) or name.startswith(s + ".") for s in skip)


def load_fp8_checkpoint(model_id: str, dtype: torch.dtype, device: torch.device,
                        classifier: dict[str, Any] | None = None) -> torch.nn.Module:
    """An FP8 checkpoint (:func:`fp8_checkpoint`) with its quantised linears as
    :class:`tigon.nn.Fp8Linear` holding the e4m3 weights and 128x128 block scales
    (``weight_scale_inv``) as stored, never dequantised; every other weight in `dtype`. The model
    is built without memory (meta parameters) and each tensor read once, onto `device`."""
    from accelerate import init_empty_weights
    from huggingface_hub import snapshot_download
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from tigon.nn import Fp8Linear

    quantization = fp8_checkpoint(model_id)
    block = quantization.get("weight_block_size")
    if not block or len(block) != 2:
        raise SFTError(f"{model_id}: an FP8 checkpoint without 2-D weight_block_size (got {block!r}); tigon loads "
                       "block-scaled ones (e.g. [128, 128])")
    if quantization.get("activation_scheme", "dynamic") != "dynamic":
        raise SFTError(f"{model_id}: FP8 activation_scheme {quantization['activation_scheme']!r}; tigon quantises "
                       "activations itself (dynamic) and has no use for static input scales")
    kwargs = source_kwargs(model_id)
    directory = Path(model_id) if Path(model_id).expanduser().is_dir() else Path(snapshot_download(
        model_id, allow_patterns=["*.json", "*.safetensors"], local_files_only=kwargs.get("local_files_only", False)))
    config = AutoConfig.from_pretrained(model_id, **kwargs)
    del config.quantization_config
    auto = AutoModelForCausalLM
    if classifier is not None or is_classifier(config):
        auto = AutoModelForSequenceClassification
        for key, value in (classifier or {}).items():
            setattr(config, key, value)
    skip = list(quantization.get("modules_to_not_convert") or []) + ["lm_head", "score"]
    with init_empty_weights(include_buffers=False):  # buffers (rotary frequencies) are computed, not loaded
        model = auto.from_config(config, dtype=dtype, attn_implementation="sdpa")
        for name, module in list(model.named_modules()):
            if type(module) is torch.nn.Linear and not _skipped(name, skip):
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, Fp8Linear(
                    module.in_features, module.out_features, module.bias is not None, tuple(block), dtype, "meta"))
    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                keep = tensor.dtype == torch.float8_e4m3fn or key.endswith("weight_scale_inv")
                state[key] = tensor if keep else tensor.to(dtype)
    missing, _ = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    unloaded = [name for name, p in model.named_parameters() if p.is_meta]
    if unloaded:
        raise SFTError(f"{model_id}: the checkpoint holds no {unloaded[0]} ({len(unloaded)} weights missing)")
    return model.to(device)


def quantize_to_fp8(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model` on `device` with its linears but the LM head in e4m3, one scale per output row
    (:func:`tigon.nn.fp8.quantize_linears`, quantised on the device)."""
    from tigon.nn.fp8 import quantize_linears

    model.to(device)
    quantize_linears(model, skip=("lm_head", "score"))
    return model


def dequantize_fp8_linears(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` with every :class:`tigon.nn.Fp8Linear` replaced by an nn.Linear of its dequantised
    weight in `dtype` (for merging an adapter trained on it)."""
    from tigon.nn import Fp8Linear

    for name, module in list(model.named_modules()):
        if type(module) is Fp8Linear:
            linear = torch.nn.Linear(module.in_features, module.out_features, module.bias is not None,
                                     device=module.weight.device, dtype=dtype)
            with torch.no_grad():
                linear.weight.copy_(module.dequantize(dtype))
                if module.bias is not None:
                    linear.bias.copy_(module.bias)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, linear)
    return model.to(dtype)


def check_bitsandbytes(quant: str, device: torch.device) -> None:
    """One SFTError line, before any weight is loaded, where bitsandbytes cannot quantise and
    dequantise on `device` (a build without this device's backend, a GPU it does not support)."""
    try:
        import bitsandbytes.functional as bnb_functional

        probe = torch.randn(4, 64, device=device)
        if quant == "int8":
            bnb_functional.int8_vectorwise_dequant(*bnb_functional.int8_vectorwise_quant(probe.half())[:2])
        else:
            bnb_functional.dequantize_4bit(*bnb_functional.quantize_4bit(probe, quant_type=quant, compress_statistics=True))
    except ImportError:
        raise SFTError(f"--quant {quant}: bitsandbytes is not installed (pip install bitsandbytes)") from None
    except Exception as err:  # whatever the backend raises: its message says why
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SFTError(f"--quant {quant}: bitsandbytes cannot run on this machine ({device.type}): {reason}") from None


# Written beside a LoRA adapter of a sequence classifier: its labels, which the base model (a
# causal LM, say) does not hold, so that loading the adapter builds the classification head again.
LABELS_FILE = "tigon_labels.json"


def is_classifier(model_or_config: Any) -> bool:
    """Whether a model (plain or PEFT's) or a saved config is a sequence classifier
    (``*ForSequenceClassification``)."""
    suffix = "ForSequenceClassification"
    if isinstance(model_or_config, torch.nn.Module):
        model = model_or_config
        return type(model.get_base_model() if hasattr(model, "get_base_model") else model).__name__.endswith(suffix)
    return any(a.endswith(suffix) for a in getattr(model_or_config, "architectures", None) or ())


def classifier_options(labels: list[str]) -> dict[str, Any]:
    """The config keywords of a sequence classifier of `labels` (in id order): one output per
    label, or one score for a single label (a reward model)."""
    return {"id2label": dict(enumerate(labels)), "label2id": {name: i for i, name in enumerate(labels)}}


@contextlib.contextmanager
def _only_errors(name: str) -> Any:
    """The logger `name` passing on errors alone, by a filter: a level set on transformers' loader
    makes it check a tensor-parallel plan and warn about that instead."""
    logger = logging.getLogger(name)
    errors = logging.Filter()
    errors.filter = lambda record: record.levelno >= logging.ERROR
    logger.addFilter(errors)
    try:
        yield
    finally:
        logger.removeFilter(errors)


def load_model(model_id: str, dtype: torch.dtype, quantization: Any = None,
               device: torch.device | None = None, classifier: dict[str, Any] | None = None) -> torch.nn.Module:
    """The model in `dtype`; with a BitsAndBytesConfig `quantization`, its linears quantised by
    bitsandbytes as they load onto `device` (the other weights in `dtype`). With `classifier`
    (:func:`classifier_options`) a sequence classifier on the model's backbone, its head new;
    a checkpoint saved as a sequence classifier loads as one without it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    quiet_transformers()
    kwargs = source_kwargs(model_id)
    auto = AutoModelForCausalLM
    quiet = contextlib.nullcontext()
    if classifier is not None:
        auto = AutoModelForSequenceClassification
        # A head of other labels (or none, on a causal LM) is made anew: transformers' report of
        # each weight it made or replaced would fill the screen with what is meant to happen.
        kwargs.update(classifier, num_labels=len(classifier["id2label"]), ignore_mismatched_sizes=True)
        quiet = _only_errors("transformers.modeling_utils")
    else:
        try:
            if is_classifier(AutoConfig.from_pretrained(model_id, **kwargs)):
                auto = AutoModelForSequenceClassification
        except (OSError, ValueError) as err:
            raise _not_found(model_id, err) from None
    if quantization is not None:
        device = torch.device(device or "cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if isinstance(quantization, Fp8Quantization):
            if fp8_checkpoint(model_id) is not None:
                return load_fp8_checkpoint(model_id, dtype, device, classifier)
            return quantize_to_fp8(load_model(model_id, dtype, classifier=classifier), device)
        kwargs.update(quantization_config=quantization, device_map={"": str(device)})
    try:
        with quiet:
            return auto.from_pretrained(model_id, dtype=dtype, attn_implementation="sdpa", **kwargs)
    except (OSError, ValueError) as err:
        raise _not_found(model_id, err) from None


def prepare_quantized(model: torch.nn.Module, gradient_checkpointing: bool) -> None:
    """PEFT's k-bit preparation (``prepare_model_for_kbit_training``: the base frozen; under
    gradient checkpointing, checkpointing switched on, non-reentrant, so frozen embeddings need no
    gradient hook) without its upcast of every other floating-point parameter to fp32. That upcast
    doubles the embeddings', LM head's and norms' memory (2 GB more for Llama-3-8B's vocabulary)
    and puts the LM head's GEMM in fp32, for nothing a bf16 compute dtype needs: they are put back
    in the dtype they were loaded in."""
    from peft import prepare_model_for_kbit_training

    loaded = {name: p.dtype for name, p in model.named_parameters() if p.is_floating_point()}
    prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing,
                                    gradient_checkpointing_kwargs={"use_reentrant": False})
    for name, param in model.named_parameters():
        if name in loaded and param.dtype != loaded[name]:
            param.data = param.data.to(loaded[name])


def quantization_record(quantization: Any) -> str:
    """The text of :data:`QUANT_FILE` for a BitsAndBytesConfig."""
    return json.dumps({"quantization_config": quantization.to_dict()}, indent=1) + "\n"


def recorded_quantization(adapter: str | Path) -> Any:
    """The BitsAndBytesConfig (or :class:`Fp8Quantization`) a LoRA adapter's base was trained
    quantised with, or None."""
    path = Path(adapter) / QUANT_FILE
    if not path.is_file():
        return None
    from transformers import BitsAndBytesConfig

    recorded = json.loads(path.read_text())["quantization_config"]
    if recorded.get("quant_method") == "fp8":
        return Fp8Quantization(getattr(torch, recorded.get("dtype", "bfloat16")))
    return BitsAndBytesConfig.from_dict(recorded)


def quantization_name(quantization: Any) -> str:
    """nf4, fp4, int8 or fp8."""
    if isinstance(quantization, Fp8Quantization):
        return quantization.name
    return "int8" if quantization.load_in_8bit else quantization.bnb_4bit_quant_type


def lora_config(cfg: SFTConfig, task_type: str = "CAUSAL_LM") -> Any:
    """PEFT's LoraConfig for `cfg`: rank, alpha, dropout, targets, --lora-variant (DoRA),
    --use-rslora and --init-lora-weights (loftq starts from PEFT's default and is applied after,
    by :func:`add_lora`). A ``SEQ_CLS`` `task_type` trains the classifier's new head whole."""
    from peft import LoraConfig

    targets: str | list[str] = cfg.target_modules
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    init = cfg.init_lora_weights
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets, task_type=task_type, use_dora=cfg.lora_variant == "dora",
                      use_rslora=cfg.use_rslora, init_lora_weights=True if init in (None, "loftq") else init)


def add_lora(model: torch.nn.Module, cfg: SFTConfig, weights_file: str | None = None) -> torch.nn.Module:
    """`model` wrapped by PEFT with LoRA adapters as `cfg` says (:func:`lora_config`); adapters
    stay fp32. For --init-lora-weights loftq the adapters are then fitted to each 4-bit weight's
    quantisation error against the unquantised weights, read from `weights_file` (a safetensors
    file; default: the model's own, from its directory or the hub cache)."""
    from peft import get_peft_model

    try:
        model = get_peft_model(model, lora_config(cfg, "SEQ_CLS" if is_classifier(model) else "CAUSAL_LM"))
    except ValueError as err:
        raise SFTError(f"--target-modules {cfg.target_modules}: {str(err).splitlines()[0]}") from None
    if cfg.init_lora_weights == "loftq":
        from peft import replace_lora_weights_loftq

        device = next(model.parameters()).device
        if device.type != "cuda":  # PEFT's LoftQ takes its SVDs on a CUDA device, whatever the model's
            raise SFTError(f"--init-lora-weights loftq needs a CUDA GPU (PEFT's LoftQ runs there); the model is on "
                           f"{device.type}")
        try:
            replace_lora_weights_loftq(model, model_path=weights_file)
        except (OSError, ValueError) as err:
            raise SFTError(f"--init-lora-weights loftq: {str(err).splitlines()[0]}") from None
    return model


def loraplus_optimizer(model: torch.nn.Module, args: Any, ratio: float) -> torch.optim.Optimizer:
    """LoRA+ (PEFT's ``create_loraplus_optimizer``): the optimizer the Trainer would make from
    `args`, with the B matrices (and DoRA's magnitudes) in groups at `ratio` times the rate."""
    from peft.optimizers import create_loraplus_optimizer
    from transformers import Trainer

    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    kwargs = {k: v for k, v in kwargs.items() if k != "lr"}
    return create_loraplus_optimizer(model, optimizer_cls, lr=args.learning_rate, loraplus_lr_ratio=ratio,
                                     loraplus_weight_decay=args.weight_decay, **kwargs)


def kernel_switches(kernels_off: list[str]) -> dict[str, bool]:
    """The `tigon.patch` keyword switches for ``--kernels-off`` (names checked by `resolve`).
    Turning off the fused linear+cross-entropy leaves the (logits-materialising) fused
    cross-entropy on, unless that is listed too."""
    switches = {name: False for name in kernels_off}
    if "linear_cross_entropy" in kernels_off and "cross_entropy" not in kernels_off:
        switches["cross_entropy"] = True
    return switches


def apply_kernels(model: torch.nn.Module, cfg: SFTConfig, role: str | None = None, fp8_all_gather: bool = False) -> str:
    """Patch `model` in place with tigon's kernels (or not, with ``--no-kernels``); logs and
    returns the line saying what was applied (naming `role`, for a run's second model, which is
    frozen: ``--fp8`` is for the trained one, with `fp8_all_gather` under FSDP2). A model
    tigon.patch cannot handle (an unsupported family) trains unpatched, with a warning: the run
    is still worth having; not under ``--fp8``, which is then refused."""
    import tigon
    from tigon.patch.apply import holds_shared_functions

    if not cfg.kernels:
        # A model of its family that this process patched and dropped leaves the family's module
        # functions (its RoPE) swapped until it is collected and the next patch or unpatch call
        # comes: both now, before this model's first forward (a full collection only when
        # something is still swapped: it costs a large process a good part of a second).
        if holds_shared_functions():
            gc.collect()
        tigon.unpatch(model)
        line = "tigon: kernels off (--no-kernels): plain PyTorch / transformers code"
        log.info("%s", line)
        return line

    try:
        switches = dict(kernel_switches(cfg.kernels_off), offload_activations=cfg.offload_activations,
                        tiled_mlp=cfg.tiled_mlp, recompute_mlp=cfg.recompute_mlp)
        fp8 = cfg.fp8 if role is None else None
        # patch logs the line itself
        return str(tigon.patch(model, role=role, fp8=fp8, fp8_all_gather=fp8_all_gather and fp8 is not None, **switches))
    except ValueError as err:
        if cfg.fp8 is not None and role is None:
            raise SFTError(f"--fp8 {cfg.fp8}: {err}") from None
        line = f"tigon: kernels off: {err}"
        log.warning("%s", line)
        return line


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; tied weights count once."""
    seen: dict[int, torch.nn.Parameter] = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in seen.values())
    trainable = sum(p.numel() for p in seen.values() if p.requires_grad)
    return trainable, total


def flops_per_token(model: torch.nn.Module, seq_len: float, backward: bool = True) -> float:
    """Model FLOPs per trained token: 2 per weight for the forward, 2 for the input gradients and
    2 more for the weight gradients of trainable weights (so LoRA skips the frozen ones'), plus
    causal attention scores and values (6 * layers * seq * width). Recomputation is not counted.
    Without `backward`, those of a forward alone (2 per weight, 2 * layers * seq * width)."""
    forward = trainable = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            forward += module.weight.numel()
            trainable += module.weight.numel() if module.weight.requires_grad else 0
    config = getattr(model, "config", None)
    attention = 0.0
    if config is not None and getattr(config, "num_hidden_layers", None):
        heads = getattr(config, "num_attention_heads", 0) or 0
        head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0)
        attention = 2.0 * config.num_hidden_layers * seq_len * heads * head_dim
    if not backward:
        return 2.0 * forward + attention
    return 4.0 * forward + 2.0 * trainable + 3.0 * attention
