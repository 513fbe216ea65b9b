"""`tigon rlhf --method gkd` on CPU: the fused loss against TRL's GKDTrainer's own loss on the same
student, teacher and batch (forward KL, JSD, reverse KL; with and without the Trainer's token
count), the embedded default (a fresh built-in student, the built-in model after sft as teacher),
and bad input as one line.

The fused loss runs its PyTorch reference here (TIGON_DISABLE); its kernels are checked against
that reference in tests/ops/test_linear_distill.py."""

import json
import logging
import random
import re

import pytest
import torch

from tests.train.fused_helpers import one_thread_and_references, save_tiny
from tigon.cli import main
from tigon.train import builtin, tiny
from tigon.train.config import RLHFConfig, resolve_rlhf
from tigon.train.data import load_samples
from tigon.train.template import ensure_chat_template

trl = pytest.importorskip("trl")
gkd = pytest.importorskip("tigon.train.gkd")


@pytest.fixture(scope="module", autouse=True)
def quick():
    with one_thread_and_references("linear_distill_loss"):
        yield


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A saved tiny student and a wider teacher with the same vocabulary, and their tokenizer."""
    root = tmp_path_factory.mktemp("gkd")
    tokenizer = tiny.build_tokenizer(load_samples([str(tiny.BUNDLED_DATASET)], seed=0))
    save_tiny(root / "student", tokenizer, 32)
    save_tiny(root / "teacher", tokenizer, 48)
    ensure_chat_template(tokenizer)
    return root, tokenizer


@pytest.mark.parametrize("beta, counted", [(0.0, False), (0.5, True), (1.0, False), (0.3, False)])
def test_fused_loss_and_gradients_equal_trls_gkd_loss(pair, tmp_path, beta, counted):
    """One chat batch (answers only scored, one row padded), two losses: TRL's
    `GKDTrainer.compute_loss` (both models' logits) and tigon's (hidden states and heads into
    `linear_distill_loss`): equal loss and student gradients, the teacher untouched."""
    compare_compute_loss(pair, tmp_path, beta, counted, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_gpu_fused_kernels_equal_trls_gkd_loss(pair, tmp_path, monkeypatch, beta):
    """The same on the GPU with `linear_distill_loss`'s Triton kernels (fp32; TF32-level tolerance)."""
    monkeypatch.delenv("TIGON_DISABLE")
    compare_compute_loss(pair, tmp_path, beta, True, 2e-3)


def compare_compute_loss(pair, tmp_path, beta, counted, rtol):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    root, tokenizer = pair
    cfg = resolve_rlhf(RLHFConfig(method="gkd", model=str(root / "student"), teacher=str(root / "teacher"),
                                  beta=beta, kernels=False, tuner="full", output_dir=str(tmp_path)))
    args = gkd.trl_arguments(cfg, torch.float32, False)
    student = AutoModelForCausalLM.from_pretrained(root / "student", dtype=torch.float32)
    teacher = gkd._teacher(cfg, str(root / "teacher"), torch.float32)
    samples = load_samples([str(tiny.BUNDLED_DATASET)], seed=0)
    chats = [s.messages for s in random.sample(samples, 3)]
    trainer = gkd.TigonGKDTrainer(model=student, teacher_model=teacher, args=args,
                                  train_dataset=Dataset.from_list([{"messages": list(m)} for m in chats]),
                                  processing_class=tokenizer)
    batch = trainer.data_collator([{"messages": list(m)} for m in chats])
    while not (batch["attention_mask"] == 0).any():  # three chats of one length (a few draws in 100): others
        batch = trainer.data_collator([{"messages": list(s.messages)} for s in random.sample(samples, 3)])
    assert (batch["labels"] == -100).any()
    items = (batch["labels"][:, 1:] != -100).sum() + 3 if counted else None
    batch = {k: v.to(trainer.model.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    items = items.to(trainer.model.device) if counted else None
    trainer.model.train()

    def loss_and_grads(compute):
        trainer.model.zero_grad()
        loss = compute(trainer, trainer.model, dict(batch), num_items_in_batch=items)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    theirs, their_grads = loss_and_grads(trl.experimental.gkd.GKDTrainer.compute_loss)
    ours, our_grads = loss_and_grads(gkd.TigonGKDTrainer.compute_loss)
    assert ours.item() == pytest.approx(theirs.item(), rel=rtol / 10, abs=1e-7)
    assert our_grads.keys() == their_grads.keys()
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=rtol, atol=1e-6, msg=name)
    assert all(p.grad is None for p in trainer.teacher_model.parameters())
    assert trainer._averages("train")["divergence"] == pytest.approx(ours.item(), rel=1e-5)


def test_builtin_default_distils_the_sft_model_into_a_fresh_one(tmp_path, monkeypatch, caplog, capfd, recwarn):
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(builtin, "SFT_STAGE_STEPS", 2)
    monkeypatch.setattr(builtin, "DEMO_SFT", tmp_path / "no-demo" / "final")
    out = tmp_path / "run"
    argv = ["--method", "gkd", "--max-steps", "3", "--batch-size", "4", "--max-completion-length", "4",
            "--lmbda", "0.5", "--samples", "0", "--no-kernels"]
    assert main(["rlhf", "--output-dir", str(out), *argv]) == 0
    assert f"teacher: the built-in model, fine-tuned first on the bundled instructions by tigon sft into " \
           f"{out / 'sft'}" in caplog.text
    # Every bundled chat counted with its rendered tokens (not the 2 keys of a BatchEncoding each).
    counted = re.search(r"tokens: (\d+) training chats, (\d+) tokens", caplog.text)
    assert counted and int(counted[2]) > 20 * int(counted[1]), caplog.text
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["divergence"] > 0 and r["loss"] == pytest.approx(r["divergence"], rel=1e-5) and r["tokens_per_s"] > 0
    assert (out / "final" / "model.safetensors").is_file()
    # No library's deprecation notice in the middle of the progress bar (TRL's generation each step).
    assert "deprecated" not in capfd.readouterr().err
    assert not [w for w in recwarn if "deprecated" in str(w.message)], [str(w.message) for w in recwarn]


@pytest.mark.parametrize("argv, message", [
    (["--model", "{root}/student"], "--method gkd needs --teacher MODEL"),
    (["--model", "{root}/student", "--teacher", "{root}/nowhere"], "--teacher {root}/nowhere: not a model directory"),
    (["--lmbda", "1.5"], "--lmbda must be in [0, 1]"),
    (["--beta", "2"], "--beta must be in [0, 1] for gkd"),
    (["--dataset", "{root}/text.jsonl"], "{root}/text.jsonl line 1: --method gkd distils chats"),
])
def test_bad_gkd_input_is_one_line_and_writes_nothing(pair, tmp_path, capsys, argv, message):
    root, _ = pair
    (root / "text.jsonl").write_text(json.dumps({"text": "plain words"}) + "\n")
    argv = [a.format(root=root) for a in argv]
    assert main(["rlhf", "--method", "gkd", "--output-dir", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tigon rlhf: error: {message.format(root=root)}"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_teacher_is_only_for_gkd(tmp_path, capsys):
    assert main(["rlhf", "--teacher", "x", "--output-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("tigon rlhf: error: --teacher: only for --method gkd, not dpo")
