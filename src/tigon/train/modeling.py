"""Models for `tigon sft`: load a tokenizer and model (or build the tiny default), wrap it with
LoRA, and switch on tigon's kernels. Loading failures become one-line SFTErrors."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import warnings
from pathlib import Path
from typing import Any, Iterator

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


def source_kwargs(model_id: str) -> dict[str, Any]:
    """The `from_pretrained` keywords that load `model_id` from where it is: a local directory as
    it is; a hub id from the hub, or from the local hub cache when the hub cannot be reached (or
    HF_HUB_OFFLINE is set). Where it can come from nowhere, one SFTError now, instead of the
    hub client's retries (about a minute without network)."""
    from huggingface_hub import constants, try_to_load_from_cache

    path = Path(model_id).expanduser()
    if path.exists():
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

    kwargs = source_kwargs(model_id)
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
    the CPU, about a run that does not use it."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    deepspeed = logging.getLogger("DeepSpeed")  # DeepSpeed's own logger, kept across its import
    if not any(isinstance(f, _DropLine) for f in deepspeed.filters):
        deepspeed.addFilter(_DropLine("Setting accelerator to CPU"))


def load_model(model_id: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    kwargs = source_kwargs(model_id)
    try:
        return AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype, attn_implementation="sdpa", **kwargs)
    except (OSError, ValueError) as err:
        raise _not_found(model_id, err) from None


@contextlib.contextmanager
def peft_quiet() -> Iterator[None]:
    """peft asks newer transformers a question under its old, deprecated name; that warning is
    theirs to fix and says nothing to a tigon user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        yield


def add_lora(model: torch.nn.Module, cfg: SFTConfig) -> torch.nn.Module:
    """`model` wrapped by PEFT with LoRA adapters on `cfg.target_modules`; adapters stay fp32."""
    from peft import LoraConfig, get_peft_model

    targets: str | list[str] = cfg.target_modules
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets, task_type="CAUSAL_LM")
    try:
        with peft_quiet():
            return get_peft_model(model, lora)
    except ValueError as err:
        raise SFTError(f"--target-modules {cfg.target_modules}: {str(err).splitlines()[0]}") from None


def kernel_switches(kernels_off: list[str]) -> dict[str, bool]:
    """The `tigon.patch` keyword switches for ``--kernels-off`` (names checked by `resolve`).
    Turning off the fused linear+cross-entropy leaves the (logits-materialising) fused
    cross-entropy on, unless that is listed too."""
    switches = {name: False for name in kernels_off}
    if "linear_cross_entropy" in kernels_off and "cross_entropy" not in kernels_off:
        switches["cross_entropy"] = True
    return switches


def apply_kernels(model: torch.nn.Module, cfg: SFTConfig) -> str:
    """Patch `model` in place with tigon's kernels (or not, with ``--no-kernels``); logs and
    returns the line saying what was applied. A model tigon.patch cannot handle (an unsupported
    family) trains unpatched, with a warning: the run is still worth having."""
    if not cfg.kernels:
        line = "tigon: kernels off (--no-kernels): plain PyTorch / transformers code"
        log.info("%s", line)
        return line
    import tigon

    try:
        switches = dict(kernel_switches(cfg.kernels_off), offload_activations=cfg.offload_activations,
                        tiled_mlp=cfg.tiled_mlp)
        return str(tigon.patch(model, **switches))  # patch logs the line itself
    except ValueError as err:
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
