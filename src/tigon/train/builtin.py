"""The built-in tiny model after `tigon sft`: the policy (`tigon rlhf`; the vision-language one for
`tigon rlhf --modality vision`), the reward model (`--method rm`) or the teacher (`--method gkd`)
of the commands' embedded defaults, which run with no model and no data. It is this run's own sft
stage (OUTPUT_DIR/sft/final) when there is one, else `make demo`'s demo-out/final when that is the
built-in model, else `tigon sft`'s default run, trained first into OUTPUT_DIR/sft."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tigon.train import tiny
from tigon.train.config import SFTConfig
from tigon.train.data import load_samples
from tigon.train.run import FINAL_DIR, finished, run_sft
from tigon.train.template import ensure_chat_template

log = logging.getLogger("tigon.train")

DEMO_SFT = Path("demo-out") / FINAL_DIR  # where `make demo` leaves the built-in model after sft
SFT_DIR = "sft"  # the embedded default's sft stage, inside the output directory
SFT_STAGE_STEPS = -1  # the sft stage's --max-steps (-1: its epochs); tests shorten it


def builtin_tokenizer() -> Any:
    """The built-in model's tokenizer, as its sft stage trains it (on the bundled instructions)."""
    tokenizer = tiny.build_tokenizer(load_samples([str(tiny.BUNDLED_DATASET)], seed=0))
    ensure_chat_template(tokenizer)
    return tokenizer


def is_builtin_sft(path: Path, tokenizer: Any) -> bool:
    """Whether `path` holds the built-in model (its shape, its tokenizer) as `tigon sft` saved it."""
    from transformers import AutoConfig, AutoTokenizer

    if not (path / "model.safetensors").is_file() or (path / "adapter_config.json").exists():
        return False
    try:
        config, saved = AutoConfig.from_pretrained(str(path)), AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError):
        return False
    shape = tiny.build_model(tokenizer, 0, num_hidden_layers=1).config
    keys = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
    return all(getattr(config, k, None) == getattr(shape, k) for k in keys) and saved.get_vocab() == tokenizer.get_vocab()


def builtin_after_sft(cfg: SFTConfig, tokenizer: Any, role: str = "policy", vision: bool = False) -> Path:
    """The built-in model after sft for the run of `cfg` (its `role` in it, for the log): this
    run's own sft stage (OUTPUT_DIR/sft/final) when it has one, so that a resumed run keeps it;
    else `make demo`'s demo-out/final when that is the built-in model; else the sft stage, trained
    first (resumed with --resume, trained again with --overwrite). With `vision`, the built-in
    vision-language model after `tigon sft --modality vision` (which `make demo` does not train;
    `tokenizer` is not read)."""
    stage = Path(cfg.output_dir) / SFT_DIR
    if not cfg.overwrite and finished(stage):  # else its run says what is wrong with its final/, or completes it
        log.info("%s: the built-in model after sft, from %s", role, stage / FINAL_DIR)
        return (stage / FINAL_DIR).resolve()
    if not vision and is_builtin_sft(DEMO_SFT, tokenizer):
        log.info("%s: the built-in model after sft, from %s (make demo)", role, DEMO_SFT)
        return DEMO_SFT.resolve()
    task = "the shapes task's answers" if vision else "the bundled instructions"
    log.info("%s: the built-in model, fine-tuned first on %s by tigon sft into %s", role, task, stage)
    sft = SFTConfig(output_dir=str(stage), seed=cfg.seed, kernels=cfg.kernels, kernels_off=cfg.kernels_off,
                    max_steps=SFT_STAGE_STEPS, samples=0, resume="latest" if cfg.resume else None,
                    overwrite=cfg.overwrite, modality="vision" if vision else None)
    return run_sft(sft).resolve()
