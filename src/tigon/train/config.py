"""`tigon sft` and `tigon rlhf` settings: one dataclass per command (rlhf's extends sft's), read
from a YAML/JSON file and the command line (the command line wins), then checked and completed
with defaults in one place, before anything is loaded."""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import importlib.util
import json
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar



class SFTError(ValueError):
    """A problem with the user's settings, data or files: `tigon sft` prints it as one line."""


class Interrupted(Exception):
    """A run stopped by a signal (see `tigon.train.stop`). ``str()`` is the one line to show;
    `exit_code` is what a shell expects of a process ended by it: 128 + its number (130: Ctrl-C)."""

    def __init__(self, message: str, signum: int = signal.SIGINT):
        super().__init__(message)
        self.exit_code = 128 + int(signum)


def utf8_text(raw: bytes, path: Path, offset: int = 0, line: int = 1) -> str:
    """`raw`, the bytes of `path` from byte `offset` (line `line`) on, as text, less the byte-order
    mark that spreadsheet exports put first; a byte that is not UTF-8 is an SFTError naming it."""
    if offset == 0 and raw.startswith(codecs.BOM_UTF8):
        raw, offset = raw[len(codecs.BOM_UTF8):], len(codecs.BOM_UTF8)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line += raw.count(b"\n", 0, err.start)
        raise SFTError(f"{path}: not UTF-8 text at byte {offset + err.start} (line {line}): save it as UTF-8") from None


TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}


def _opt(default: Any, help: str, **argparse_kwargs: Any) -> Any:
    metadata = {"help": help, **argparse_kwargs}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class SFTConfig:
    """Every `tigon sft` setting. ``None`` means "the default for this run" (see `resolve`): the
    built-in tiny model (no ``model``) trains from scratch and so wants other defaults than a real
    model being fine-tuned."""

    model: str | None = _opt(None, "local model directory or hub id (default: the built-in tiny Llama)",
                             metavar="MODEL")
    dataset: list[str] | None = _opt(
        None, "data files (.jsonl .json .csv .parquet); PATH#N takes N random rows (default: bundled "
        "instructions)", nargs="+", metavar="PATH")
    eval_dataset: list[str] | None = _opt(None, "evaluation files, same formats (default: none)", nargs="+",
                                          metavar="PATH")
    eval_split: float = _opt(0.0, "hold out this fraction of the training rows for evaluation")
    tuner: str | None = _opt(None, "lora (default) or full (default for the built-in model)",
                             choices=["lora", "full"])
    lora_rank: int = _opt(16, "LoRA rank")
    lora_alpha: float | None = _opt(None, "LoRA alpha (default: 2 x rank)")
    lora_dropout: float = _opt(0.0, "LoRA dropout")
    target_modules: str = _opt("all-linear", "modules LoRA adapts: all-linear, or names such as q_proj,v_proj",
                               metavar="NAMES")
    quant: str | None = _opt(None, "load the base quantised by bitsandbytes (QLoRA; --tuner lora): nf4 or fp4 "
                             "(4-bit, double quantisation, computing in --dtype) or int8 (LLM.int8); or fp8 "
                             "(e4m3 base, FP8 GEMMs; GPU of compute capability 8.9+; an FP8 checkpoint's own "
                             "weights) (default: not quantised). A 4-bit base's GEMMs (forward and input gradient) "
                             "dequantise the weight into a reused buffer and run cuBLAS for training batches; "
                             "with few tokens (up to 64-128 by Llama-3 8B/70B shape and pass: generation, evaluation) "
                             "the fused 4-bit GEMM multiplies the packed weight directly "
                             "(tigon.ops.gemm_4bit.FUSED_TOKENS_UP_TO)", choices=["nf4", "fp4", "int8", "fp8"])
    lora_variant: str = _opt("lora", "lora, or dora (weight-decomposed: a learned magnitude per output feature)",
                             choices=["lora", "dora"])
    use_rslora: bool = _opt(False, "rank-stabilised LoRA: scale the adapters by alpha / sqrt(rank), not alpha / rank")
    loraplus_lr_ratio: float | None = _opt(None, "LoRA+: train the B matrices at --lr times this (default: off; "
                                           "the paper suggests 16)")
    init_lora_weights: str | None = _opt(
        None, "adapter initialisation: gaussian, pissa / olora (from the base weights' SVD / QR, which rewrites "
        "them), loftq (fitted to the 4-bit base's quantisation error; needs --quant nf4 or fp4) (default: "
        "PEFT's, A random and B zero)", choices=["gaussian", "pissa", "olora", "loftq"])
    neftune_alpha: float | None = _opt(None, "NEFTune: add uniform noise of this scale to the input embeddings "
                                       "while training (default: off; the paper uses 5)")
    max_length: int | None = _opt(None, "truncate each sample (or packed row) to this many tokens "
                                  "(default 2048; 128 for the built-in model)")
    packing: bool = _opt(False, "pack several samples per row; position ids restart per sample and "
                         "attention never crosses samples")
    epochs: float | None = _opt(None, "passes over the data (default 1; 30 for the built-in model)")
    max_steps: int = _opt(-1, "stop after this many optimizer steps, overriding --epochs (default -1: --epochs "
                          "decides)")
    lr: float | None = _opt(None, "peak learning rate (default: 2e-4 LoRA, 2e-5 full, 3e-3 built-in)")
    warmup: float = _opt(0.05, "linear warm-up: a fraction of all steps if < 1, else a step count")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    batch_size: int | None = _opt(None, "samples (or packed rows) per device per step (default 4; 16 built-in)")
    grad_accum: int = _opt(1, "gradient accumulation steps")
    dtype: str = _opt("auto", "weight dtype; auto = bf16 on a GPU that has it, else (and for the built-in model) fp32",
                      choices=["auto", "bf16", "fp16", "fp32"])
    gradient_checkpointing: bool = _opt(False, "recompute activations in the backward pass to save memory")
    offload_activations: bool = _opt(False, "long context: keep the hidden states gradient checkpointing saves "
                                     "in host memory (needs --gradient-checkpointing)")
    tiled_mlp: bool = _opt(False, "long context: run the MLP over chunks of tokens so its intermediates "
                           "never exist whole")
    recompute_mlp: bool = _opt(False, "keep only the MLPs' inputs for backward, which forms gate and up again: "
                               "about half of a layer's activations for two more GEMMs per layer (for runs "
                               "without --gradient-checkpointing)")
    output_dir: str = _opt("tigon-out", "where checkpoints, metrics.jsonl and loss.png go", metavar="DIR")
    save_steps: int = _opt(500, "write a checkpoint every N steps and at the end (0: none, only final/)")
    save_limit: int | None = _opt(None, "keep only the newest N step checkpoints (default: keep all)")
    resume: str | None = _opt(None, "continue from the newest checkpoint in --output-dir (a new run if it has none "
                              "yet), or from CKPT (default: a new run)", nargs="?", const="latest", metavar="CKPT")
    overwrite: bool = _opt(False, "replace the run (checkpoints, final/, metrics) already in --output-dir")
    seed: int = _opt(42, "seed for weights, data order, sampling and dropout")
    kernels: bool = _opt(True, "swap in tigon's fused kernels (tigon.patch)")
    kernels_off: list[str] = _opt([], "kernels to leave out, e.g. rope,swiglu (see tigon.patch)",
                                  metavar="OP,OP")
    logging_steps: int = _opt(1, "log loss/lr/speed every N steps (each log waits for the GPU to catch up)")
    samples: int = _opt(3, "prompts from the data answered before and after training (0: none)")
    max_new_tokens: int = _opt(48, "length of those sample answers")
    cuda_graphs: bool = _opt(False, "capture each micro-step's forward and backward, and the optimizer's update, "
                             "as CUDA graphs and replay them, so a small batch does not leave the GPU waiting "
                             "for Python; every batch is padded to --max-length (one shape); needs a CUDA GPU")
    fp8: str | None = _opt(None, "run the decoder's linears' GEMMs in FP8 (torchao float8 training, scales per "
                           "tensor or per row; bf16 weights; --tuner full; needs a GPU of compute capability >= 8.9 "
                           "and pip install 'tigon[fp8]'; its compiled FP8 linears cost host time that "
                           "--cuda-graphs takes away) (default: off)", choices=["tensorwise", "rowwise"])
    sequence_parallel: int = _opt(1, "split each sequence over N processes (DeepSpeed Ulysses; launch with torchrun, "
                                  "processes a multiple of N; rows padded to a multiple of N tokens)", metavar="N")
    task: str = _opt("causal_lm", "what to train: causal_lm (next tokens), or classification (a sequence "
                     "classifier on rows {text, label})", choices=["causal_lm", "classification"])
    labels: list[str] | None = _opt(None, "classification: the labels, in id order; a row with another is refused "
                                    "(default: the data's, sorted)", metavar="A,B")
    report_to: str = _opt("none", "experiment tracking through the Trainer's integration (tensorboard: event files "
                          "in OUTPUT_DIR/runs)", choices=["none", *TRACKERS])
    # Vision-language models (tigon.train.vision_run).
    modality: str | None = _opt(None, "vision: train a vision-language model on image + text rows; without --model, "
                                "the built-in tiny Qwen2-VL on a synthetic shapes task (default: vision for a --model "
                                "whose config has a vision_config, else text)", choices=["text", "vision"])
    max_pixels: int | None = _opt(None, "scale larger images down to this many pixels (and Qwen-VL's dynamic "
                                  "resolution up to it) (default: the processor's)")
    min_pixels: int | None = _opt(None, "Qwen-VL: scale smaller images up to this many pixels (default: the "
                                  "processor's)")
    image_size: int | None = _opt(None, "scale images down to at most this many pixels on their longer side "
                                  "(default: as they are)")
    freeze_vision: bool | None = _opt(None, "keep the vision encoder's weights as they are (default: on with --tuner "
                                      "lora, off with full; off: LoRA adapts its linears too)")
    freeze_projector: bool | None = _opt(None, "keep the projector (vision to language) as it is (default: on with "
                                         "--tuner lora, off with full)")


    # Fields of this class that its command does not take (no option, unknown in a config file).
    LEFT_OUT: ClassVar[tuple[str, ...]] = ()


VISION_KEYS = ("modality", "max_pixels", "min_pixels", "image_size", "freeze_vision", "freeze_projector")
_LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "target_modules", "lora_variant", "use_rslora",
              "loraplus_lr_ratio", "init_lora_weights")


def _fields(cls: type[SFTConfig]) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.name not in cls.LEFT_OUT}


def _scalar_type(f: dataclasses.Field) -> type:
    annotation = str(f.type)
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if annotation.startswith(name):
            return kind
    return str


def add_sft_arguments(parser: argparse.ArgumentParser, cls: type[SFTConfig] = SFTConfig) -> None:
    """Add one option per field of `cls` (``--lora-rank``, ``--no-kernels`` ...) plus ``--config``.
    Options not given stay absent from the namespace, so a config file can fill them."""
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help="YAML or JSON file of settings (keys as below, - or _); options given here win")
    for name, f in _fields(cls).items():
        flag = "--" + name.replace("_", "-")
        kind = _scalar_type(f)
        kwargs = {**f.metadata, "help": help_with_default(f.metadata["help"], _shown_default(f))}
        if "choices" not in kwargs and kind is not bool:
            kwargs.setdefault("metavar", {int: "N", float: "X"}.get(kind, "STR"))
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, **kwargs)
        elif name in _COMMA_LISTS:
            parser.add_argument(flag, type=_comma_list, default=argparse.SUPPRESS, **kwargs)
        else:
            parser.add_argument(flag, type=kind, default=argparse.SUPPRESS, **kwargs)


def help_with_default(help: str, shown: str) -> str:
    """An option's help ending in "default: `shown`" (inside its closing parenthesis, if it has
    one), unless it already says what the default is."""
    if "default" in help:
        return help
    if help.endswith(")"):
        return f"{help[:-1]}; default: {shown})"
    return f"{help} (default: {shown})".lstrip()


def _shown_default(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ",".join(value) or "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


_COMMA_LISTS = ("kernels_off", "labels")


def _comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _coerce(f: dataclasses.Field, value: Any, source: str) -> Any:
    """A config-file value converted to the field's type, or an SFTError naming the key."""
    name = f.name
    kind = _scalar_type(f)
    if value is None:
        if f.default is not None:
            raise SFTError(f"{source}: {name} needs a value")
        return None
    if name == "resume" and isinstance(value, bool):
        return "latest" if value else None
    if name in _COMMA_LISTS:
        return _comma_list(value) if isinstance(value, str) else [str(v) for v in value]
    if f.metadata.get("nargs") == "+":
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise SFTError(f"{source}: {name} must be a path or a list of paths, got {value!r}")
        return values
    if kind is bool:
        if not isinstance(value, bool):
            raise SFTError(f"{source}: {name} must be true or false, got {value!r}")
        return value
    try:
        converted = kind(value)
    except (TypeError, ValueError):
        raise SFTError(f"{source}: {name} must be {kind.__name__}, got {value!r}") from None
    if kind is int and converted != value and not isinstance(value, str):
        raise SFTError(f"{source}: {name} must be an integer, got {value!r}")
    choices = f.metadata.get("choices")
    if choices and converted not in choices:
        raise SFTError(f"{source}: {name} must be one of {', '.join(choices)}, got {value!r}")
    return converted


def load_config_file(path: str | Path, cls: type[SFTConfig] = SFTConfig) -> dict[str, Any]:
    """The settings of `cls` in a YAML (.yaml/.yml) or JSON file, keys normalised to field names."""
    path = Path(path)
    if not path.is_file():
        raise SFTError(f"config file not found: {path}")
    text = utf8_text(path.read_bytes(), path)
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            raw = yaml.safe_load(text)
        else:
            raw = json.loads(text)
    except Exception as err:  # a YAML or JSON syntax error: report it on one line
        raise SFTError(f"{path}: not valid {'YAML' if path.suffix.lower() in ('.yaml', '.yml') else 'JSON'}: "
                       f"{str(err).splitlines()[0]}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise SFTError(f"{path}: expected a mapping of setting: value, got {type(raw).__name__}")
    fields = _fields(cls)
    settings = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise SFTError(f"{path}: unknown setting {key!r}")
        settings[name] = _coerce(fields[name], value, str(path))
    return settings


def config_from_args(args: argparse.Namespace, cls: type[SFTConfig] = SFTConfig) -> tuple[SFTConfig, set[str]]:
    """The `cls` config from ``--config`` overlaid with the options given on the command line, and
    the names of the settings the user chose (file or command line), for the checks in `resolve`."""
    settings = load_config_file(args.config, cls) if getattr(args, "config", None) else {}
    settings.update({name: getattr(args, name) for name in _fields(cls) if hasattr(args, name)})
    return cls(**settings), set(settings)


def check_cuda_graphs(cfg: SFTConfig) -> None:
    """Refuse, in one line, a --cuda-graphs run whose steps cannot be captured."""
    import os

    import torch

    if not torch.cuda.is_available():
        raise SFTError("--cuda-graphs needs a CUDA GPU and none is visible: train without --cuda-graphs")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SFTError("--cuda-graphs runs on one GPU, one process: launch without torchrun/accelerate (several "
                       "processes)")
    if cfg.offload_activations:
        raise SFTError("--cuda-graphs cannot capture --offload-activations (its copies to host memory wait on "
                       "the host): give one or the other")


_BUILTIN_VISION = {"epochs": 16.0, "lr": 5e-3}


def resolve(cfg: SFTConfig, given: set[str] = frozenset()) -> SFTConfig:
    """Fill the run-dependent defaults and reject bad or incompatible settings, one line each."""
    builtin = cfg.model is None
    # A quantised base cannot be trained itself: --quant means QLoRA, for the built-in model too.
    tuner = cfg.tuner or ("full" if builtin and cfg.quant is None else "lora")
    # The built-in vision-language model's shapes task: fewer epochs of more rows (see vision_run).
    own = _BUILTIN_VISION if builtin and cfg.modality == "vision" else {}
    cfg = dataclasses.replace(
        cfg,
        tuner=tuner,
        lora_alpha=cfg.lora_alpha if cfg.lora_alpha is not None else 2.0 * cfg.lora_rank,
        max_length=cfg.max_length if cfg.max_length is not None else (128 if builtin else 2048),
        epochs=cfg.epochs if cfg.epochs is not None else own.get("epochs", 30.0 if builtin else 1.0),
        lr=cfg.lr if cfg.lr is not None else own.get("lr", 3e-3 if builtin else 2e-4 if tuner == "lora" else 2e-5),
        batch_size=cfg.batch_size if cfg.batch_size is not None else (16 if builtin else 4),
    )
    for name in ("max_pixels", "min_pixels", "image_size"):
        if getattr(cfg, name) is not None and getattr(cfg, name) <= 0:
            raise SFTError(f"--{name.replace('_', '-')} must be > 0, got {getattr(cfg, name)}")
    positive = {"lora_rank": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "max_length": cfg.max_length,
                "lr": cfg.lr, "batch_size": cfg.batch_size, "grad_accum": cfg.grad_accum,
                "logging_steps": cfg.logging_steps}
    for name, value in positive.items():
        if value <= 0:
            raise SFTError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    nonnegative = {"save_steps": cfg.save_steps, "samples": cfg.samples, "warmup": cfg.warmup,
                   "weight_decay": cfg.weight_decay, "max_new_tokens": cfg.max_new_tokens}
    for name, value in nonnegative.items():
        if value < 0:
            raise SFTError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if cfg.max_steps <= 0 and cfg.epochs <= 0:
        raise SFTError(f"--epochs must be > 0 (or give --max-steps), got {cfg.epochs}")
    if cfg.save_limit is not None and cfg.save_limit < 1:
        raise SFTError(f"--save-limit must be >= 1, got {cfg.save_limit}")
    if not 0.0 <= cfg.lora_dropout < 1.0:
        raise SFTError(f"--lora-dropout must be in [0, 1), got {cfg.lora_dropout}")
    if not 0.0 <= cfg.eval_split < 1.0:
        raise SFTError(f"--eval-split must be in [0, 1), got {cfg.eval_split}")
    if cfg.eval_split and cfg.eval_dataset:
        raise SFTError("--eval-split and --eval-dataset are incompatible: choose one")
    if tuner == "full" and cfg.quant is not None:
        raise SFTError(f"--quant {cfg.quant} with --tuner full: quantised weights cannot be trained; use --tuner "
                       "lora (QLoRA: adapters on the quantised base)")
    if tuner == "full" and given & set(_LORA_KEYS):
        names = ", ".join("--" + k.replace("_", "-") for k in _LORA_KEYS if k in given)
        raise SFTError(f"{names}: only for --tuner lora, not --tuner full")
    _check_lora_options(cfg)
    if tuner == "full" and cfg.dtype == "fp16":
        raise SFTError("--dtype fp16 cannot be used with --tuner full (fp16 weights cannot be updated "
                       "through a loss scaler): use bf16 or fp32")
    if cfg.resume and cfg.overwrite:
        raise SFTError("--resume and --overwrite are incompatible: resuming keeps the output dir")
    if cfg.offload_activations and not cfg.gradient_checkpointing:
        raise SFTError("--offload-activations offloads what gradient checkpointing keeps: add "
                       "--gradient-checkpointing")
    memory = [f"--{name.replace('_', '-')}" for name in ("offload_activations", "tiled_mlp", "recompute_mlp")
              if getattr(cfg, name)]
    if memory and not cfg.kernels:
        raise SFTError(f"{', '.join(memory)}: applied by tigon.patch, which --no-kernels turns off "
                       "(leave out single kernels with --kernels-off)")
    check_sequence_parallel(cfg)  # before --cuda-graphs' own checks: its line names the conflict
    if cfg.cuda_graphs:
        check_cuda_graphs(cfg)
    if cfg.kernels_off and not cfg.kernels:
        raise SFTError("--kernels-off has no effect with --no-kernels: give one or the other")
    if cfg.fp8 is not None:
        cfg = check_fp8(cfg)
    package = TRACKERS.get(cfg.report_to)
    if package and importlib.util.find_spec(package) is None:
        raise SFTError(f"--report-to {cfg.report_to}: the {package} package is not installed (pip install {package})")
    from tigon.patch import check_switch_names  # the kernels' floor, imported by a run, not by --help

    try:
        check_switch_names(cfg.kernels_off, "--kernels-off")
    except ValueError as err:
        raise SFTError(str(err)) from None
    return cfg


def check_fp8(cfg: SFTConfig) -> SFTConfig:
    """Refuse, in one line, an --fp8 run that would not train in FP8; `cfg` with --dtype auto as
    bf16, the weights FP8 training keeps."""
    flag = f"--fp8 {cfg.fp8}"
    if cfg.tuner != "full":
        raise SFTError(f"{flag}: FP8 linears train the full model's weights: add --tuner full (LoRA on an FP8 base is "
                       "--quant fp8)")
    if not cfg.kernels:
        raise SFTError(f"{flag}: applied by tigon.patch, which --no-kernels turns off (leave out single kernels with "
                       "--kernels-off)")
    if cfg.dtype not in ("auto", "bf16"):
        raise SFTError(f"{flag}: FP8 training keeps bf16 weights, not --dtype {cfg.dtype}: use --dtype bf16")
    from tigon.patch import fp8

    reason = fp8.unsupported()
    if reason is not None:
        raise SFTError(f"{flag}: {reason}: train without --fp8")
    try:
        fp8.torchao_float8()
    except ValueError as err:
        raise SFTError(f"{flag}: {err}") from None
    return dataclasses.replace(cfg, dtype="bf16")


def check_sequence_parallel(cfg: SFTConfig) -> None:
    """Refuse, in one line, a --sequence-parallel the run cannot split (also run once a model
    found to be vision-language has set `cfg.modality`)."""
    from tigon.train import seqpar

    seqpar.check_settings(cfg.sequence_parallel, cuda_graphs=cfg.cuda_graphs)
    if cfg.sequence_parallel > 1 and (cfg.task != "causal_lm" or cfg.modality == "vision"):
        what = "vision-language models" if cfg.modality == "vision" else f"--task {cfg.task}"
        raise SFTError(f"--sequence-parallel: not for {what} (text causal LM training only)")


def _check_lora_options(cfg: SFTConfig) -> None:
    """The quantisation and PEFT-variant settings, and their combinations, one line each."""
    for name in ("loraplus_lr_ratio", "neftune_alpha"):
        value = getattr(cfg, name)
        if value is not None and not value > 0:
            raise SFTError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    init, quant = cfg.init_lora_weights, cfg.quant
    if quant not in (None, "fp8") and importlib.util.find_spec("bitsandbytes") is None:
        raise SFTError(f"--quant {quant}: bitsandbytes is not installed (pip install bitsandbytes)")
    if init in ("pissa", "olora") and quant is not None:
        raise SFTError(f"--init-lora-weights {init} rewrites the base weights (less the adapters' start), which a "
                       f"quantised base would keep re-quantised: drop --quant {quant}, or use --init-lora-weights loftq")
    if init == "loftq" and quant not in ("nf4", "fp4"):
        raise SFTError("--init-lora-weights loftq fits the adapters to a 4-bit base's quantisation error: add "
                       "--quant nf4 (or fp4)")
    if init == "loftq" and cfg.lora_variant == "dora":
        raise SFTError("--init-lora-weights loftq with --lora-variant dora: DoRA's magnitudes are set from the "
                       "adapters PEFT starts with, before LoftQ replaces them; use one or the other")


# --- tigon rlhf ---------------------------------------------------------------------------------

PREFERENCE_METHODS = ("dpo", "ipo", "kto", "orpo", "simpo", "cpo")
METHODS = (*PREFERENCE_METHODS, "grpo", "ppo", "rloo", "gkd", "rm")
REFERENCE_METHODS = ("dpo", "ipo", "kto")  # the others score the policy alone
# linear_policy_loss's (gspo: grpo at sequence level)
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "gspo", "cispo", "sapo", "luspo", "vespo")
# dpo's: TRL's DPOTrainer loss types (sigmoid: DPO itself), each linear_preference_loss's method of that name
DPO_LOSS_TYPES = ("sigmoid", "hinge", "robust", "apo_zero", "apo_down", "sppo_hard", "nca_pair", "bco_pair",
                  "exo_pair", "discopop")
_LOSS_TYPES = {"grpo": LOSS_TYPES, "dpo": DPO_LOSS_TYPES}
# (ppo and rloo: the normalisation of their fused loss, which TRL's GRPOConfig is told too.)
_DEFAULT_LOSS_TYPE = {"grpo": "dapo", "dpo": "sigmoid", "ppo": "bnpo", "rloo": "dr_grpo"}
_SMOOTHED_LOSS_TYPES = ("sigmoid", "robust", "exo_pair")  # dpo's loss types that take --label-smoothing
# TRL's vllm_importance_sampling_mode, and none (no correction)
VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none")
_GRPO_VARIANT_KEYS = ("delta", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos",
                      "vespo_k_neg", "vespo_lambda_neg", "vllm_importance_sampling_mode",
                      "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max")
DISTILL_LOSSES = ("forward_kl", "reverse_kl", "jsd", "tvd")  # linear_distill_loss's
# beta: SimPO's scales average log-probs, not sums (its paper's range); GRPO's weighs the KL to
# the reference (TRL's default: none); GKD's interpolates its JSD (TRL's GKDConfig default).
# PPO and RLOO put their KL in the reward, at TRL PPOv2's and RLOOConfig's 0.05.
_DEFAULT_BETA = {"simpo": 2.0, "grpo": 0.0, "ppo": 0.05, "rloo": 0.05, "gkd": 0.5}
_DEFAULT_NLL_WEIGHT = {"cpo": 1.0, "orpo": 1.0}  # part of those methods' objectives
_DEFAULT_TEMPERATURE = {"grpo": 1.0, "gkd": 0.9}  # TRL's GRPOConfig and GKDConfig defaults
_SMOOTHED = ("dpo", "simpo", "cpo")
_REWARDED = ("grpo", "ppo", "rloo")  # online RL from reward functions
_ONLINE = (*_REWARDED, "gkd")
# Which method each method-specific setting belongs to.
_METHOD_KEYS = {"simpo_gamma": ("simpo",), "desirable_weight": ("kto",), "undesirable_weight": ("kto",),
                "label_smoothing": _SMOOTHED, "precompute_ref_log_probs": REFERENCE_METHODS,
                "nll_weight": PREFERENCE_METHODS, "max_prompt_length": (*PREFERENCE_METHODS, "rm"),
                "center_rewards": ("rm",), "reward_model": ("grpo", "ppo"),
                "reward_funcs": _REWARDED, "num_generations": _REWARDED, "loss_type": ("grpo", "dpo"), "epsilon": _REWARDED,
                "epsilon_high": ("grpo", "rloo"), "format_regex": _REWARDED, "use_vllm": ("grpo",),
                **{key: ("grpo",) for key in _GRPO_VARIANT_KEYS},
                "gamma": ("ppo",), "lam": ("ppo",), "vf_coef": ("ppo",),
                "cliprange_value": ("ppo",), "ppo_epochs": ("ppo",), "mini_batches": ("ppo",),
                "max_completion_length": _ONLINE, "temperature": _ONLINE,
                "teacher": ("gkd",), "lmbda": ("gkd",), "seq_kd": ("gkd",),
                "average_log_probs": ("dpo", "kto", "cpo"), "discopop_tau": ("dpo",),
                "nll_on_prompt": ("dpo", "ipo", "simpo", "cpo", "orpo")}


@dataclass
class RLHFConfig(SFTConfig):
    """Every `tigon rlhf` setting: sft's (less --packing), with preference training's defaults, and
    the method with its constants. ``None`` means "the default for this run and method"."""

    LEFT_OUT: ClassVar[tuple[str, ...]] = ("packing", "task", "labels")

    dataset: list[str] | None = _opt(
        None, "preference files (.jsonl .json .csv .parquet): prompt/chosen/rejected, messages + rejected_response "
        "or rejected_messages, chosen/rejected conversations, or (kto) prompt/completion/label; grpo, ppo, rloo: "
        "prompt (or question, or messages ending in the answer) with any other columns for the reward functions; "
        "gkd: sft's formats; PATH#N takes N random rows (default: bundled preference pairs; grpo, ppo, rloo: bundled "
        "arithmetic prompts; gkd: bundled instructions)", nargs="+", metavar="PATH")
    tuner: str | None = _opt(None, "lora (default; its reference is the model with the adapter switched off) or "
                             "full (a frozen copy; default for the built-in model)", choices=["lora", "full"])
    max_length: int | None = _opt(None, "truncate each prompt + answer to this many tokens, cutting the answer; a "
                                  "prompt this long drops its row (default 1024; 128 for the built-in model)")
    epochs: float | None = _opt(None, "passes over the data (default 1; 3 for the built-in model)")
    lr: float | None = _opt(None, "peak learning rate (default: 5e-6 LoRA, 5e-7 full, 1e-4 built-in; 3e-4 built-in ppo)")
    batch_size: int | None = _opt(None, "pairs (kto: answers) per device per step (default 4; 16 built-in)")
    output_dir: str = _opt("tigon-rlhf-out", "where checkpoints, metrics.jsonl and loss.png go", metavar="DIR")

    method: str = _opt("dpo", "the objective: a preference method, grpo, ppo or rloo (online RL from reward "
                       "functions), gkd (on-policy distillation from --teacher) or rm (a Bradley-Terry reward model "
                       "from the pairs)", choices=list(METHODS))
    beta: float | None = _opt(None, "the method's beta: how far from the reference (dpo, ipo, kto), the reward "
                              "scale (simpo, cpo), the odds-ratio weight (orpo), the KL weight (grpo; ppo, rloo: of "
                              "the KL penalty in the reward), the JSD's interpolation, 0 forward KL to 1 reverse KL "
                              "(gkd) (default 0.1; 2 simpo, 0 grpo, 0.05 ppo and rloo, 0.5 gkd)")
    label_smoothing: float = _opt(0.0, "dpo (conservative DPO), simpo, cpo: the assumed chance that a pair's "
                                  "preference is flipped, < 0.5")
    simpo_gamma: float = _opt(1.0, "simpo: the target reward margin")
    nll_weight: float | None = _opt(None, "weight of the chosen answers' NLL added to the loss (default 1 for cpo "
                                    "and orpo, part of those methods; 0 for the others)")
    desirable_weight: float = _opt(1.0, "kto: weight of the desirable answers' loss")
    undesirable_weight: float = _opt(1.0, "kto: weight of the undesirable answers' loss")
    precompute_ref_log_probs: bool = _opt(False, "score the data with the reference once before training, instead "
                                          "of a reference forward per step (a full fine-tune then keeps no copy)")
    max_prompt_length: int | None = _opt(None, "keep only the last N tokens of each prompt (default: no limit "
                                         "but --max-length)")

    reward_funcs: list[str] | None = _opt(
        None, "grpo, ppo, rloo: reward functions, FILE.py:fn1,fn2 (TRL's signature: fn(prompts, completions, "
        "**kwargs) -> list of floats, the data's other columns as keywords) and built-ins: builtin:exact_answer (1 "
        "when the completion's last number, or its text, equals the answer column), builtin:format (1 when it "
        "matches --format-regex), builtin:length (minus its share of --max-completion-length) (default: "
        "builtin:exact_answer,builtin:format; ppo with --reward-model: none)", nargs="+", metavar="SPEC")
    num_generations: int = _opt(8, "grpo, ppo, rloo: completions sampled per prompt (the group grpo and rloo "
                                "compare)")
    max_completion_length: int | None = _opt(None, "grpo, ppo, rloo, gkd: most tokens sampled per completion "
                                             "(default 256; 16 for the built-in model)")
    temperature: float | None = _opt(None, "grpo, ppo, rloo, gkd: sampling temperature (the loss divides the logits "
                                     "by it too) (default 1.0; 0.9 gkd)")
    loss_type: str | None = _opt(None, "grpo: the loss and its normalisation (TRL's loss_type; gspo: grpo with a "
                                 "sequence-level importance ratio; luspo: at sequence level) (default dapo); dpo: TRL's DPO loss type "
                                 "(default sigmoid, DPO itself)", choices=[*LOSS_TYPES, *DPO_LOSS_TYPES])
    average_log_probs: bool = _opt(False, "dpo, kto, cpo: score each answer by its per-token mean log-prob "
                                   "instead of the sum (TRL's average_log_prob)")
    discopop_tau: float = _opt(0.05, "dpo --loss-type discopop: the temperature of DiscoPOP's blend")
    nll_on_prompt: bool = _opt(False, "the chosen answers' NLL (--nll-weight) covers their prompts' tokens too, as "
                               "TRL's ORPOTrainer's does (default: the answers' alone)")
    epsilon: float = _opt(0.2, "grpo, ppo, rloo: the clip range of the importance ratio, [1 - epsilon, 1 + "
                          "epsilon-high]")
    epsilon_high: float | None = _opt(None, "grpo, rloo: the clip range's upper side (default: --epsilon; DAPO uses "
                                      "0.28); cispo: the cap on the ratio itself (ScaleRL uses 5)")
    delta: float | None = _opt(None, "grpo: two-sided clipping (INTELLECT-2): the ratio is also capped at this, "
                               "which binds for negative advantages (the clipped losses; > 1, INTELLECT-2 takes it above "
                               "1 + --epsilon-high) (default: none)")
    sapo_temperature_pos: float = _opt(1.0, "grpo, sapo: the gate's temperature for positive advantages")
    sapo_temperature_neg: float = _opt(1.05, "grpo, sapo: the gate's temperature for the other advantages")
    vespo_k_pos: float = _opt(2.0, "grpo, vespo: the gamma weight's power for advantages >= 0")
    vespo_lambda_pos: float = _opt(3.0, "grpo, vespo: the gamma weight's decay for advantages >= 0")
    vespo_k_neg: float = _opt(3.0, "grpo, vespo: the gamma weight's power for negative advantages")
    vespo_lambda_neg: float = _opt(2.0, "grpo, vespo: the gamma weight's decay for negative advantages")
    vllm_importance_sampling_mode: str | None = _opt(
        None, "grpo --use-vllm: the importance-sampling correction of vLLM's sampling log-probs against the "
        "trainer's, per token or per completion, truncated to or masked outside [clip-min, clip-max] (TRL's; "
        "default sequence_mask, token_truncate for vespo)", choices=list(VLLM_IS_MODES))
    vllm_importance_sampling_clip_min: float | None = _opt(None, "grpo --use-vllm: the correction's lower bound "
                                                           "(default none)")
    vllm_importance_sampling_clip_max: float | None = _opt(3.0, "grpo --use-vllm: the correction's upper bound")
    format_regex: str = _opt(r"^[^\n]*\S[^\n]*\.$", "grpo, ppo, rloo: what builtin:format rewards: a completion "
                             "matching this regex whole (default: one line ending in a period)", metavar="REGEX")
    use_vllm: bool = _opt(False, "grpo: sample with vLLM (colocated; needs vllm installed) instead of transformers' "
                          "generate")
    gamma: float = _opt(1.0, "ppo: the discount of GAE")
    lam: float = _opt(0.95, "ppo: GAE's lambda (0: one-step TD advantages, 1: Monte Carlo returns)")
    vf_coef: float = _opt(0.1, "ppo: the value loss's weight in the loss")
    cliprange_value: float = _opt(0.2, "ppo: how far the value head's predictions may move from the rollout's before "
                                  "the clipped value loss takes over")
    ppo_epochs: int | None = _opt(None, "ppo: passes over each rollout batch (default 4; 2 for the built-in model)")
    mini_batches: int = _opt(1, "ppo: optimizer steps per pass over a rollout batch (a rollout batch is --batch-size "
                             "x --grad-accum x this many completions)")
    teacher: str | None = _opt(None, "gkd: the teacher model, frozen (default, for the built-in student only: the "
                               "built-in model after sft)", metavar="MODEL")
    lmbda: float = _opt(0.5, "gkd: the share of steps trained on the student's own samples (on-policy); the others "
                        "on the dataset's answers")
    seq_kd: bool = _opt(False, "gkd: the off-policy steps train on the teacher's samples instead of the dataset's "
                        "answers")
    center_rewards: float = _opt(0.0, "rm: weight of the mean squared sum of each pair's rewards added to the loss, "
                                 "which keeps them centred on 0 (TRL's center_rewards_coefficient; 0: none)")
    reward_model: str | None = _opt(None, "grpo, ppo: a reward model (tigon rlhf --method rm's final/, or a "
                                    "sequence-classification model of one output) whose score of each prompt + "
                                    "completion is a reward beside --reward-funcs' (ppo: alone when none is given) "
                                    "(default: none)", metavar="PATH")


# The built-in model's defaults per method where they differ from the preference methods' (one
# epoch of GRPO over the bundled prompts is many steps: --max-steps ends the run instead).
_BUILTIN = {"grpo": {"lr": 1e-4, "batch_size": 32, "max_steps": 80},
            "ppo": {"lr": 3e-4, "batch_size": 32, "max_steps": 80, "ppo_epochs": 2},
            "rloo": {"lr": 1e-4, "batch_size": 32, "max_steps": 80}, "gkd": {"lr": 3e-3, "epochs": 10.0},
            "rm": {"lr": 1e-3, "epochs": 3.0}}
# The built-in VLM: the preference methods' policy is it after its sft stage (vision_rlhf), grpo's
# it from random weights.
_BUILTIN_VISION = {"grpo": {"lr": 2e-3, "epochs": 8.0}}
_BUILTIN_VISION_PREFERENCE = {"lr": 3e-4, "epochs": 3.0}


def resolve_rlhf(cfg: RLHFConfig, given: set[str] = frozenset()) -> RLHFConfig:
    """`resolve` for `tigon rlhf`: its own defaults first, then sft's checks, then the method's."""
    builtin = cfg.model is None
    lora = (cfg.tuner or ("full" if builtin and cfg.quant is None else "lora")) == "lora"
    method = cfg.method
    if method not in METHODS:
        raise SFTError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    if cfg.sequence_parallel > 1:
        from tigon.train.seqpar import method_refusal

        raise method_refusal(method)
    if not builtin:
        own = {}
    elif cfg.modality == "vision":
        own = _BUILTIN_VISION.get(method, _BUILTIN_VISION_PREFERENCE)
    else:
        own = _BUILTIN.get(method, {})
    cfg = dataclasses.replace(
        cfg,
        max_length=cfg.max_length if cfg.max_length is not None else (128 if builtin else 1024),
        epochs=cfg.epochs if cfg.epochs is not None else own.get("epochs", 3.0 if builtin else 1.0),
        max_steps=cfg.max_steps if cfg.max_steps > 0 or "max_steps" in given else own.get("max_steps", cfg.max_steps),
        lr=cfg.lr if cfg.lr is not None else own.get("lr", 1e-4 if builtin else 5e-6 if lora else 5e-7),
        batch_size=cfg.batch_size if cfg.batch_size is not None else own.get("batch_size", 16 if builtin else 4),
        # The built-in model is tiny: fp32, where bf16 would only lose the small updates.
        dtype="fp32" if builtin and cfg.dtype == "auto" and cfg.fp8 is None else cfg.dtype,
        beta=cfg.beta if cfg.beta is not None else _DEFAULT_BETA.get(method, 0.1),
        nll_weight=cfg.nll_weight if cfg.nll_weight is not None else _DEFAULT_NLL_WEIGHT.get(method, 0.0),
        max_completion_length=(cfg.max_completion_length if cfg.max_completion_length is not None
                               else 16 if builtin else 256),
        temperature=cfg.temperature if cfg.temperature is not None else _DEFAULT_TEMPERATURE.get(method, 1.0),
        loss_type=cfg.loss_type if cfg.loss_type is not None else _DEFAULT_LOSS_TYPE.get(method),
        ppo_epochs=cfg.ppo_epochs if cfg.ppo_epochs is not None else own.get("ppo_epochs", 4),
    )
    if method == "rm" and builtin and cfg.dataset is None and not cfg.eval_dataset and "eval_split" not in given:
        cfg = dataclasses.replace(cfg, eval_split=0.1)  # the embedded default shows its accuracy rise
    if cfg.cuda_graphs and method in _ONLINE:
        raise SFTError(f"--cuda-graphs: --method {method} generates completions in every step, of lengths no "
                       f"captured graph can fix; it takes the offline methods ({', '.join(PREFERENCE_METHODS)})")
    cfg = resolve(cfg, given)
    for key, methods in _METHOD_KEYS.items():
        if key in given and method not in methods and getattr(cfg, key) != getattr(RLHFConfig, key, None):
            raise SFTError(f"--{key.replace('_', '-')}: only for --method {' / '.join(methods)}, not {method}")
    _check_loss_type(cfg, given)
    if method in _REWARDED:
        _check_grpo(cfg)
    elif method == "rm":
        if cfg.cuda_graphs:
            raise SFTError("--cuda-graphs: not for --method rm (its batches are padded to their longest pair, not to "
                           "one shape)")
        if cfg.center_rewards < 0:
            raise SFTError(f"--center-rewards must be >= 0, got {cfg.center_rewards}")
    elif method == "gkd":
        _check_gkd(cfg)
    elif not cfg.beta > 0:
        raise SFTError(f"--beta must be > 0, got {cfg.beta}")
    if not 0.0 <= cfg.label_smoothing < 0.5:
        raise SFTError(f"--label-smoothing must be in [0, 0.5), got {cfg.label_smoothing}")
    if cfg.nll_weight < 0:
        raise SFTError(f"--nll-weight must be >= 0, got {cfg.nll_weight}")
    if cfg.nll_on_prompt and not cfg.nll_weight:
        raise SFTError(f"--nll-on-prompt: --method {method} adds no NLL (--nll-weight 0); give --nll-weight > 0")
    for key in ("desirable_weight", "undesirable_weight"):
        if not getattr(cfg, key) > 0:
            raise SFTError(f"--{key.replace('_', '-')} must be > 0, got {getattr(cfg, key)}")
    if cfg.max_prompt_length is not None and not 0 < cfg.max_prompt_length < cfg.max_length:
        raise SFTError(f"--max-prompt-length must be in [1, --max-length {cfg.max_length}), got "
                       f"{cfg.max_prompt_length} (it leaves the answer the rest)")
    if method == "kto" and cfg.batch_size < 2:
        raise SFTError("--method kto estimates its KL baseline from the other answers of a batch: --batch-size "
                       f"must be >= 2, got {cfg.batch_size}")
    if cfg.lora_dropout:
        raise SFTError("--lora-dropout: preference training switches dropout off, so that the policy and its "
                       "reference score an answer alike")
    return cfg


def _check_loss_type(cfg: RLHFConfig, given: set[str]) -> None:
    """--loss-type belongs to the method, and the settings that go with one loss type to it."""
    method, loss_type = cfg.method, cfg.loss_type
    if method in _LOSS_TYPES and loss_type not in _LOSS_TYPES[method]:
        raise SFTError(f"--loss-type {loss_type} is not a {method} loss type; --method {method} takes "
                       f"{', '.join(_LOSS_TYPES[method])}")
    if method != "dpo":
        return
    if cfg.label_smoothing and loss_type not in _SMOOTHED_LOSS_TYPES:
        raise SFTError(f"--label-smoothing: only for --loss-type {' / '.join(_SMOOTHED_LOSS_TYPES)}, not {loss_type}")
    if loss_type == "exo_pair" and not cfg.label_smoothing > 0:
        raise SFTError("--loss-type exo_pair needs --label-smoothing > 0 (EXO's epsilon; its paper uses 1e-3)")
    if "discopop_tau" in given and loss_type != "discopop":
        raise SFTError(f"--discopop-tau: only for --loss-type discopop, not {loss_type}")
    if not cfg.discopop_tau > 0:
        raise SFTError(f"--discopop-tau must be > 0, got {cfg.discopop_tau}")


def _check_online(cfg: RLHFConfig) -> None:
    if cfg.max_completion_length <= 0:
        raise SFTError(f"--max-completion-length must be > 0, got {cfg.max_completion_length}")
    if not cfg.temperature > 0:
        raise SFTError(f"--temperature must be > 0, got {cfg.temperature}")


def _check_grpo(cfg: RLHFConfig) -> None:
    _check_online(cfg)
    if cfg.beta < 0:
        raise SFTError(f"--beta must be >= 0, got {cfg.beta}")
    if cfg.num_generations < 2:
        raise SFTError(f"--num-generations must be >= 2 (a group's advantages compare its completions), got "
                       f"{cfg.num_generations}")
    if cfg.batch_size * cfg.grad_accum % cfg.num_generations:
        raise SFTError(f"--batch-size ({cfg.batch_size} completions) x --grad-accum ({cfg.grad_accum}) must be a "
                       f"multiple of --num-generations ({cfg.num_generations}): each prompt's group is sampled whole")
    for name in ("epsilon", "epsilon_high"):
        value = getattr(cfg, name)
        if value is not None and value < 0:
            raise SFTError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    _check_grpo_variant(cfg)
    if cfg.method == "ppo":
        _check_ppo(cfg)
    reward_model = Path(cfg.reward_model).expanduser() if cfg.reward_model is not None else None
    if reward_model is not None and not any((reward_model / name).is_file() for name in ("config.json", "adapter_config.json")):
        raise SFTError(f"--reward-model {cfg.reward_model}: not a model directory (no config.json or adapter_config.json "
                       "in it)")
    if cfg.use_vllm and importlib.util.find_spec("vllm") is None:
        raise SFTError("--use-vllm: vLLM is not installed (pip install vllm), or leave the flag out to sample "
                       "with transformers")


def _check_grpo_variant(cfg: RLHFConfig) -> None:
    """Two-sided clipping's, SAPO's, VESPO's and the vLLM correction's constants."""
    if cfg.delta is not None:
        if cfg.loss_type in ("cispo", "sapo", "vespo"):
            raise SFTError(f"--delta caps the clipped ratio, which --loss-type {cfg.loss_type} has not")
        if not cfg.delta > 1:
            raise SFTError(f"--delta must be > 1 (INTELLECT-2 takes it above 1 + --epsilon-high), got {cfg.delta}")
    for key in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
        if not getattr(cfg, key) > 0:
            raise SFTError(f"--{key.replace('_', '-')} must be > 0, got {getattr(cfg, key)}")
    for key in ("vespo_k_pos", "vespo_k_neg", "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max"):
        value = getattr(cfg, key)
        if value is not None and not value >= 0:
            raise SFTError(f"--{key.replace('_', '-')} must be >= 0, got {value}")
    low, high = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    if low is not None and high is not None and low > high:
        raise SFTError(f"--vllm-importance-sampling-clip-min ({low}) must not exceed "
                       f"--vllm-importance-sampling-clip-max ({high})")
    mode = cfg.vllm_importance_sampling_mode or ""
    if cfg.loss_type == "vespo" and mode.startswith("sequence"):
        raise SFTError(f"--vllm-importance-sampling-mode {mode}: vespo folds the correction into its per-token "
                       "weights: token_truncate, token_mask or none")


def _check_ppo(cfg: RLHFConfig) -> None:
    for name in ("gamma", "lam"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            raise SFTError(f"--{name} must be in [0, 1], got {getattr(cfg, name)}")
    if cfg.vf_coef < 0:
        raise SFTError(f"--vf-coef must be >= 0, got {cfg.vf_coef}")
    if not cfg.cliprange_value > 0:
        raise SFTError(f"--cliprange-value must be > 0, got {cfg.cliprange_value}")
    for name in ("ppo_epochs", "mini_batches"):
        if getattr(cfg, name) < 1:
            raise SFTError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")


def _check_gkd(cfg: RLHFConfig) -> None:
    _check_online(cfg)
    if not 0.0 <= cfg.beta <= 1.0:
        raise SFTError(f"--beta must be in [0, 1] for gkd (0: forward KL, 1: reverse KL), got {cfg.beta}")
    if not 0.0 <= cfg.lmbda <= 1.0:
        raise SFTError(f"--lmbda must be in [0, 1] (the share of on-policy steps), got {cfg.lmbda}")
    if cfg.model is not None and cfg.teacher is None:
        raise SFTError("--method gkd needs --teacher MODEL (only the built-in student has a default teacher)")
