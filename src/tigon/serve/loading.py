"""What `tigon serve` and `tigon eval` load: a tigon output directory (`final/`, `checkpoint-N/`,
a LoRA adapter, merged on its base in memory) or any Hugging Face model directory; with no path,
the built-in demo model (`make demo`'s output, trained first if it is not there)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("tigon.serve")

DEMO_DIR = Path("demo-out")
VISION_DEMO_DIR = Path("demo-vision-out")


def resolve_model_path(path: str | None, modality: str | None = None) -> str:
    """`path`, or the demo model's final directory, training it (the run `tigon sft --output-dir
    demo-out` makes, as `make demo` does; with `modality` "vision", `tigon sft --modality vision
    --output-dir demo-vision-out`) when it does not exist yet."""
    if path is not None:
        return path
    from tigon.train import SFTConfig, run_sft
    from tigon.train.run import FINAL_DIR

    folder = VISION_DEMO_DIR if modality == "vision" else DEMO_DIR
    final = folder / FINAL_DIR
    if not final.is_dir():
        given = {"output_dir"} | ({"modality"} if modality else set())
        log.info("tigon: no demo model in %s yet: training it first, as `tigon sft %s--output-dir %s` does",
                 final, f"--modality {modality} " if modality else "", folder)
        run_sft(SFTConfig(output_dir=str(folder), modality=modality), given)
    return str(final)


def load_model_for_serving(path: str, dtype: str = "auto", base: str | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) in eval mode on the GPU if there is one. A LoRA adapter is merged into
    its base here (served models gain nothing from keeping the adapter apart); a QLoRA adapter
    into its dequantised base, as `tigon merge` does, not into weights quantised again."""
    from tigon.train import load_for_inference
    from tigon.train.modeling import pick_dtype

    model, tokenizer = load_for_inference(path, pick_dtype(dtype), base=base, dequantize=True)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{path}: tigon serve needs a fast (Rust) tokenizer; {type(tokenizer).__name__} is not one")
    return model.eval(), tokenizer


def context_length(model: Any, limit: int | None = None) -> int:
    """The longest prompt + completion served: the model's context, or `limit` if smaller."""
    config = model.config
    # a vision-language model's context is its language model's
    native = getattr(config, "max_position_embeddings", None) or getattr(
        getattr(config, "get_text_config", lambda: None)(), "max_position_embeddings", None)
    if limit is not None and limit < 1:
        raise ValueError(f"--max-model-len must be >= 1, got {limit}")
    if native is None and limit is None:
        raise ValueError("the model's config has no max_position_embeddings: pass --max-model-len")
    return min(x for x in (native, limit) if x is not None)
