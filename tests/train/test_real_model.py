"""`tigon sft` and `tigon merge` on real pretrained weights: the first two decoder layers of
SmolLM2-135M-Instruct (with its embeddings, final norm and head; tests/real.py), its real
tokenizer and chat template, on a slice of the bundled instructions.

On the CPU the patched run computes every op on its PyTorch reference (TIGON_DISABLE=all): steps
of a real model through Triton's interpreter would take minutes, and the kernels themselves are held
against those references by the op tests. There the runs are also shorter (8 steps of one row of at
most 48 tokens: the 49152-token head makes each step cost about a second); on a GPU they are the
twenty steps of two 64-token rows. What runs here is everything tigon.patch puts
in the model (the family's forwards, the fused LoRA paths, the loss from the hidden states) against
transformers' and PEFT's own code. On a GPU the kernels run compiled."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tigon.cli import main
from tigon.train import tiny

pytest.importorskip("peft")

GPU = torch.cuda.is_available()
STEPS = 20 if GPU else 8
ARGS = ["--dataset", f"{tiny.BUNDLED_DATASET}#16", "--max-steps", str(STEPS), "--batch-size", "2" if GPU else "1",
        "--max-length", "64" if GPU else "48", "--dtype", "fp32", "--lr", "1e-3", "--samples", "0",
        "--save-steps", "0", "--logging-steps", "1", "--seed", "0"]


def losses(out):
    rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def runs(smollm2_two_layers, tmp_path_factory):
    """LoRA runs of `tigon sft` on the real model with tigon's kernels and without: their output dirs
    and the log of the run with them."""
    root = tmp_path_factory.mktemp("real")
    model = ["--model", str(smollm2_two_layers)]
    assert main(["sft", *ARGS, *model, "--output-dir", str(root / "off"), "--no-kernels"]) == 0
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger, level = logging.getLogger("tigon"), logging.getLogger("tigon").level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        with pytest.MonkeyPatch.context() as patch:
            if not GPU:
                patch.setenv("TIGON_DISABLE", "all")
            assert main(["sft", *ARGS, *model, "--output-dir", str(root / "on")]) == 0
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return root / "off", root / "on", [r.getMessage() for r in records]


def test_sft_steps_with_kernels_match_without(runs):
    off, on, log = runs
    assert any(line.startswith("tigon: applied rms_norm") and "lora" in line for line in log)
    assert any(line.startswith("tigon: fused LoRA on") for line in log)
    want, got = losses(off), losses(on)
    assert sorted(want) == sorted(got) == list(range(1, STEPS + 1))
    # The runs learn (equal losses of a model that does not would say little).
    assert sum(want[s] for s in range(STEPS - 2, STEPS + 1)) < 0.9 * sum(want[s] for s in (1, 2, 3))
    for step_, loss in want.items():
        assert got[step_] == pytest.approx(loss, rel=1e-4), f"step {step_}"


def test_merge_and_reload_generates_what_the_adapter_does(runs, smollm2_two_layers, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = runs[1] / "final"
    assert main(["merge", str(adapter), "--output", str(tmp_path / "merged")]) == 0
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)

    def greedy(model):
        with torch.no_grad():
            return model.eval().generate(**prompt, max_new_tokens=8, do_sample=False)[0]

    base = AutoModelForCausalLM.from_pretrained(smollm2_two_layers, dtype=torch.float32)
    want = greedy(PeftModel.from_pretrained(base, adapter))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert torch.equal(greedy(merged), want)
    fresh = AutoModelForCausalLM.from_pretrained(smollm2_two_layers, dtype=torch.float32)
    assert not torch.equal(greedy(fresh), want), "the adapter changed nothing: the comparison would be empty"
