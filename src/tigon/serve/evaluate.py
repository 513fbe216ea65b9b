"""`tigon eval`: loss and perplexity of a model on data files, scored exactly as `tigon sft`
trains on them (its readers, chat template and label masks: only assistant turns, or every token
of plain text), and benchmark tasks through lm-evaluation-harness."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("tigon.serve")


@dataclass
class EvalSettings:
    datasets: list[str] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)
    max_length: int = 2048
    batch_size: int = 8
    dtype: str = "auto"
    base: str | None = None
    output: str | None = None
    limit: int | None = None
    seed: int = 42


@torch.no_grad()
def dataset_loss(model: Any, tokenizer: Any, spec: str, max_length: int, batch_size: int, seed: int = 42) -> dict:
    """{rows, tokens, loss, perplexity} of `model` on one data file (``PATH#N`` as in sft): the
    mean negative log-likelihood per trained token, over the whole file, and its exp."""
    from tigon.train.batching import NUM_TOKENS, Collator
    from tigon.train.data import read_file
    from tigon.train.template import IGNORE, encode_all, ensure_chat_template

    ensure_chat_template(tokenizer)
    samples, _ = read_file(spec, seed)
    rows = encode_all(tokenizer, samples, max_length, spec)
    collate = Collator(tokenizer.pad_token_id)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = collate(rows[start:start + batch_size])
        batch.pop(NUM_TOKENS)
        labels = batch.pop("labels").to(device)
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
        for row_logits, row_labels in zip(logits, labels):  # one row of fp32 logits at a time
            targets = row_labels[1:]
            total += float(torch.nn.functional.cross_entropy(row_logits[:-1].float(), targets,
                                                               ignore_index=IGNORE, reduction="sum"))
            count += int((targets != IGNORE).sum())
    loss = total / count
    return {"dataset": spec, "rows": len(rows), "tokens": count, "loss": loss, "perplexity": math.exp(loss)}


def _lm_eval(model: Any, tokenizer: Any, settings: EvalSettings) -> dict[str, dict[str, float]]:
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size, max_length=settings.max_length)
    out = simple_evaluate(model=lm, tasks=settings.tasks, limit=settings.limit)
    return {task: {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            for task, metrics in out["results"].items()}


def run_eval(path: str, settings: EvalSettings) -> dict[str, Any]:
    """Score `path` on the settings' data files and tasks; prints a table and writes the JSON."""
    if not settings.datasets and not settings.tasks:
        raise ValueError("tigon eval needs --dataset FILE... and/or --tasks T1,T2")
    if settings.max_length < 2 or settings.batch_size < 1:
        raise ValueError("--max-length must be >= 2 and --batch-size >= 1")
    if settings.tasks and importlib.util.find_spec("lm_eval") is None:
        raise ValueError("--tasks needs lm-evaluation-harness, which is not installed (pip install lm-eval)")
    from tigon.serve.loading import load_model_for_serving

    model, tokenizer = load_model_for_serving(path, settings.dtype, settings.base)
    result: dict[str, Any] = {"model": path, "settings": asdict(settings),
                              "datasets": [dataset_loss(model, tokenizer, spec, settings.max_length,
                                                        settings.batch_size, settings.seed)
                                           for spec in settings.datasets]}
    if settings.tasks:
        result["tasks"] = _lm_eval(model, tokenizer, settings)
    out = Path(settings.output or "eval.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(format_table(result))
    print(f"tigon eval: results in {out}")
    return result


def format_table(result: dict[str, Any]) -> str:
    lines = []
    if result["datasets"]:
        width = max(len("dataset"), *(len(d["dataset"]) for d in result["datasets"]))
        lines.append(f"{'dataset':<{width}}  {'rows':>6}  {'tokens':>9}  {'loss':>8}  {'perplexity':>11}")
        lines += [f"{d['dataset']:<{width}}  {d['rows']:>6}  {d['tokens']:>9}  {d['loss']:>8.4f}  "
                  f"{d['perplexity']:>11.4f}" for d in result["datasets"]]
    for task, metrics in result.get("tasks", {}).items():
        lines += [f"{task:<24} {name:<24} {value:.4f}" for name, value in metrics.items()]
    return "\n".join(lines)
