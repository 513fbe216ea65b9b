"""`tigon rlhf` end to end on CPU: the built-in default, each method's losses against TRL's own
trainer on the same tiny model, data order and seed (fp32, unpatched), the reference by disabled
adapter / frozen copy against precomputed log-probs, resume and Ctrl-C, and bad input.

The fused loss runs its PyTorch reference here (TIGON_DISABLE): in Triton's interpreter one step
of it takes ~25 s. The kernels are checked against that reference in tests/ops; what these tests
check is everything around the op (hidden states, targets, reference, metrics, the trainers)."""

import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tigon
from tests.train.fused_helpers import argv_of, one_thread_and_references, save_tiny
from tests.train.fused_helpers import plain_model as plain
from tests.train.test_sft import losses, no_staging_left, same_run
from tigon.cli import main
from tigon.train import builtin, preference, rlhf, tiny
from tigon.train.config import RLHFConfig, resolve_rlhf
from tigon.train.data import load_samples
from tigon.train.template import ensure_chat_template

trl = pytest.importorskip("trl")


@pytest.fixture(scope="module", autouse=True)
def quick():
    with one_thread_and_references("linear_preference_loss,linear_log_probs"):
        yield


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A saved tiny model (a user's --model), its tokenizer, and 48 of the bundled pairs."""
    root = tmp_path_factory.mktemp("rlhf")
    tokenizer = tiny.build_tokenizer(load_samples([str(tiny.BUNDLED_DATASET)], seed=0))
    save_tiny(root / "m", tokenizer)
    ensure_chat_template(tokenizer)
    rows = [json.loads(line) for line in rlhf.BUNDLED_PREFERENCES.read_text().splitlines()]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in random.sample(rows, 48)))
    return root, tokenizer


def settings(root, **extra):
    """The runs' settings, as RLHFConfig fields and as the matching command line."""
    values = dict(model=str(root / "m"), dataset=[str(root / "pairs.jsonl")], kernels=False, batch_size=2, lr=1e-3,
                  save_steps=0, samples=0, tuner="full")
    values.update(extra)
    return values, argv_of(values)


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def trl_arguments(out, values):
    """TRL's config with the very arguments `tigon rlhf` gives its trainer."""
    cfg = resolve_rlhf(RLHFConfig(output_dir=str(out), **values))
    args = rlhf.trl_arguments(cfg, torch.float32, False)
    args.precompute_ref_log_probs = False
    return cfg, args


def plain_model(root):
    return plain(root / "m")


def with_callbacks(trainer, *extra):
    """`trainer` (a class) with the callbacks `extra` added to the ones it is made with."""

    class Trainer(trainer):
        def __init__(self, *args, callbacks=(), **kwargs):
            super().__init__(*args, callbacks=[*callbacks, *extra], **kwargs)

    return Trainer


def assert_same_losses(ours, theirs, steps):
    assert [r["step"] for r in ours] == list(range(1, steps + 1)) and len(theirs) == steps
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), a["step"]
        assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], rel=1e-4, abs=1e-5), a["step"]


def test_builtin_default_runs_dpo_after_an_sft_stage(tmp_path, monkeypatch, caplog):
    """No model, no data: sft of the built-in model into OUTPUT_DIR/sft, then DPO on the bundled
    pairs, reporting reward margin and accuracy; a second run takes `make demo`'s model instead."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(builtin, "SFT_STAGE_STEPS", 3)
    monkeypatch.setattr(builtin, "DEMO_SFT", tmp_path / "no-demo" / "final")
    out = tmp_path / "run"
    short = ["--max-steps", "4", "--batch-size", "4", "--save-steps", "4", "--samples", "1", "--max-new-tokens", "4",
             "--no-kernels"]
    assert main(["rlhf", "--output-dir", str(out), *short]) == 0
    assert f"fine-tuned first on the bundled instructions by tigon sft into {out / 'sft'}" in caplog.text
    assert (out / "sft" / "final" / "model.safetensors").is_file() and losses(out / "sft").keys() == {1, 2, 3}
    steps = records(out)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert {"loss", "rewards/margins", "rewards/accuracies", "rewards/chosen", "nll_loss"} <= set(r)
        assert 0 <= r["rewards/accuracies"] <= 1 and r["tokens_per_s"] > 0
    assert steps[0]["loss"] == pytest.approx(0.6931, abs=1e-4)  # the policy starts as its reference
    assert (out / "loss.png").stat().st_size > 1000 and no_staging_left(out)
    for d in ("checkpoint-4", "final"):
        assert (out / d / "model.safetensors").is_file() and (out / d / "tokenizer_config.json").is_file()
    (sample,) = json.loads((out / "samples.json").read_text())
    assert {"prompt", "before", "after"} <= set(sample)

    monkeypatch.setattr(builtin, "DEMO_SFT", out / "sft" / "final")
    again = tmp_path / "again"
    assert main(["rlhf", "--output-dir", str(again), *short]) == 0
    assert f"from {out / 'sft' / 'final'} (make demo)" in caplog.text and not (again / "sft").exists()
    assert [r["loss"] for r in records(again)] == pytest.approx([r["loss"] for r in steps], rel=1e-6)


@pytest.mark.parametrize("method, steps", [("dpo", 20), ("ipo", 3)])
def test_dpo_and_ipo_equal_trls_dpo_trainer(tiny_run, tmp_path, method, steps):
    """The fused path computes TRL's DPO (and IPO) loss: same model, data (TRL tokenizing it
    itself), order and seed, equal losses, reward margins and accuracies at every step."""
    root, tokenizer = tiny_run
    values, argv = settings(root, method=method, max_steps=steps)
    assert main(["rlhf", *argv, "--output-dir", str(tmp_path / "tigon")]) == 0
    theirs = _trl_dpo_history(root, tokenizer, tmp_path, values)
    assert_same_losses(records(tmp_path / "tigon"), theirs, steps)
    assert [r["rewards/accuracies"] for r in records(tmp_path / "tigon")] == [r["rewards/accuracies"] for r in theirs]


def test_dpo_on_tigons_kernels_follows_trl_in_float32_step_after_step(tiny_run, tmp_path, caplog):
    """In float32 the fused kernels' DPO stays on TRL's DPOTrainer step after step (16 steps, each
    starting from the weights the last left): a drift between the two in bf16 is rounding, which
    the steps then carry apart, not a different loss."""
    root, tokenizer = tiny_run
    values, argv = settings(root, method="dpo", max_steps=16, kernels=True)
    caplog.set_level(logging.INFO, logger="tigon")
    assert main(["rlhf", *argv, "--output-dir", str(tmp_path / "tigon")]) == 0
    assert "tigon: applied rms_norm" in caplog.text  # the policy ran on the kernels
    theirs = _trl_dpo_history(root, tokenizer, tmp_path, values)
    assert_same_losses(records(tmp_path / "tigon"), theirs, 16)


def _trl_dpo_history(root, tokenizer, tmp_path, values, **trl_args):
    """TRL's DPOTrainer's logged steps on the pairs, tokenizing them itself, with tigon's arguments
    for `values` and then `trl_args`."""
    from datasets import Dataset
    from transformers import set_seed

    cfg, args = trl_arguments(tmp_path / "trl", values)
    for key, value in trl_args.items():
        setattr(args, key, value)
    rows = [json.loads(line) for line in (root / "pairs.jsonl").read_text().splitlines()]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                               "chosen": [{"role": "assistant", "content": r["chosen"]}],
                               "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows])
    set_seed(cfg.seed)
    trainer = trl.DPOTrainer(model=plain_model(root), args=args, train_dataset=data, processing_class=tokenizer)
    items = preference.load_preferences(cfg.dataset, cfg.seed, cfg.method)
    assert [preference.encode(tokenizer, item, cfg.max_length)[0] for item in items] == \
        [{k: row[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for row in trainer.train_dataset]
    trainer.train()
    return [r for r in trainer.state.log_history if "loss" in r]


@pytest.mark.parametrize("loss_type, options, trl_loss_type", [
    ("apo_zero", {}, "apo_zero"),
    ("apo_down", {}, "apo_down"),
    ("sppo_hard", {}, "sppo_hard"),
    ("nca_pair", {}, "nca_pair"),
    ("bco_pair", {}, "bco_pair"),
    ("exo_pair", {"label_smoothing": 0.01}, "exo_pair"),
    ("discopop", {"discopop_tau": 0.2}, "discopop"),
    ("sigmoid", {"average_log_probs": True}, "sigmoid_norm"),  # TRL's per-token-mean DPO
])
def test_dpo_loss_types_equal_trls_dpo_trainer(tiny_run, tmp_path, loss_type, options, trl_loss_type):
    """`tigon rlhf --method dpo --loss-type X` trains as TRL's DPOTrainer with loss_type X: equal
    losses, reward margins and mean chosen / rejected logits at every step."""
    root, tokenizer = tiny_run
    values, argv = settings(root, method="dpo", loss_type=loss_type, max_steps=3, **options)
    assert main(["rlhf", *argv, "--output-dir", str(tmp_path / "tigon")]) == 0
    theirs = _trl_dpo_history(root, tokenizer, tmp_path, values, loss_type=[trl_loss_type],
                              discopop_tau=options.get("discopop_tau", 0.05))
    ours = records(tmp_path / "tigon")
    if trl_loss_type == "sigmoid_norm":  # whose rewards TRL still logs from the sums, tigon from the means
        assert [a["loss"] for a in ours] == pytest.approx([b["loss"] for b in theirs], rel=1e-5, abs=1e-6)
    else:
        assert_same_losses(ours, theirs, 3)
    for a, b in zip(ours, theirs):
        for key in ("logits/chosen", "logits/rejected"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["step"], key)


def test_kto_equals_trls_kto_trainer(tiny_run, tmp_path):
    """KTO, with its KL baseline from the batch's mismatched answers, against TRL's KTOTrainer
    fed the same answers in the order tigon trains on them; 22 answers in batches of 4, the last
    batch of the epoch (step 6) short."""
    from datasets import Dataset
    from transformers import set_seed

    root, tokenizer = tiny_run
    rng = random.Random()
    pairs = [json.loads(line) for line in (root / "pairs.jsonl").read_text().splitlines()][:22]
    judged = [{"prompt": p["prompt"], "completion": p[key], "label": key == "chosen"}
              for p in pairs for key in [rng.choice(["chosen", "rejected"])]]
    (tmp_path / "kto.jsonl").write_text("".join(json.dumps(r) + "\n" for r in judged))
    values, argv = settings(root, method="kto", max_steps=6, batch_size=4, dataset=[str(tmp_path / "kto.jsonl")])
    assert main(["rlhf", *argv, "--output-dir", str(tmp_path / "tigon")]) == 0
    cfg, args = trl_arguments(tmp_path / "trl", values)
    items = preference.load_preferences(cfg.dataset, cfg.seed, "kto")
    items = preference.shuffled(items, cfg.seed)  # tigon's order, which KTO's sequential sampler keeps
    data = Dataset.from_list([{"prompt": list(i.prompt), "completion": list(i.completion), "label": i.desirable}
                              for i in items])
    set_seed(cfg.seed)
    trainer = trl.KTOTrainer(model=plain_model(root), args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    ours, theirs = records(tmp_path / "tigon"), [r for r in trainer.state.log_history if "loss" in r]
    assert [r["step"] for r in ours] == [1, 2, 3, 4, 5, 6] and len(theirs) == 6
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-4, abs=1e-5)
        assert ("rewards/margins" in a) == ("rewards/margins" in b)  # none for a batch of one kind of answer
        if "rewards/margins" in b:
            assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], rel=1e-4, abs=1e-5)


def _tokenized_trainer(base):
    """TRL's experimental CPO/ORPO trainer fed tigon's token rows (they tokenize raw text their own,
    older way), for comparing losses on the same tokens."""

    class Tokenized(base):
        def tokenize_row(self, feature, model=None):
            prompt = feature["prompt_ids"]
            row = {"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
            for key in ("chosen", "rejected"):
                answer = feature[f"{key}_ids"]
                row.update({f"{key}_input_ids": prompt + answer, f"{key}_attention_mask": [1] * (len(prompt) + len(answer)),
                            f"{key}_labels": [-100] * len(prompt) + answer})
            return row

    return Tokenized


def _trl_experimental(root, tokenizer, tmp_path, values, base, config, **options):
    from datasets import Dataset
    from transformers import set_seed

    from tigon.train.run import training_arguments

    cfg = resolve_rlhf(RLHFConfig(output_dir=str(tmp_path / "trl"), **values))
    args = training_arguments(cfg, torch.float32, False, cls=config, max_length=cfg.max_length, beta=cfg.beta,
                              gradient_checkpointing=False, **options)
    items = preference.load_preferences(cfg.dataset, cfg.seed, cfg.method)
    data = Dataset.from_list([preference.encode(tokenizer, item, cfg.max_length)[0] for item in items])
    set_seed(cfg.seed)
    trainer = _tokenized_trainer(base)(model=plain_model(root), args=args, train_dataset=data,
                                       processing_class=tokenizer)
    trainer.train()
    return [r for r in trainer.state.log_history if "loss" in r]


@pytest.mark.parametrize("method, options", [("simpo", ["--beta", "2.5", "--simpo-gamma", "0.7"]),
                                             ("cpo", ["--beta", "0.2", "--label-smoothing", "0.1"])])
def test_simpo_and_cpo_equal_trls_cpo_trainer(tiny_run, tmp_path, method, options):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    root, tokenizer = tiny_run
    values, argv = settings(root, method=method, max_steps=3)
    assert main(["rlhf", *argv, *options, "--output-dir", str(tmp_path / "tigon")]) == 0
    values.update(beta=float(options[1]), **({"simpo_gamma": 0.7} if method == "simpo" else {"label_smoothing": 0.1}))
    trl_options = ({"loss_type": "simpo", "simpo_gamma": 0.7, "cpo_alpha": 0.0} if method == "simpo"
                   else {"loss_type": "sigmoid", "cpo_alpha": 1.0, "label_smoothing": 0.1})
    theirs = _trl_experimental(root, tokenizer, tmp_path, values, CPOTrainer, CPOConfig, **trl_options)
    assert_same_losses(records(tmp_path / "tigon"), theirs, 3)
    if method == "cpo":
        assert [r["nll_loss"] for r in records(tmp_path / "tigon")] == pytest.approx([r["nll_loss"] for r in theirs],
                                                                                       rel=1e-5)


def test_orpos_odds_ratio_term_equals_trls(tiny_run, tmp_path):
    """ORPO's odds-ratio term is TRL's. Its NLL is the paper's, over the chosen answer (checked
    against cross-entropy in tests/ops/test_linear_preference.py); TRL's ORPOTrainer scores prompt
    and answer, so only the odds-ratio term and the rewards are compared here: on a random tiny
    model every token's NLL is near log(vocab), so the two NLLs need not differ measurably."""
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    root, tokenizer = tiny_run
    values, argv = settings(root, method="orpo", max_steps=1, beta=0.3)
    assert main(["rlhf", *argv, "--output-dir", str(tmp_path / "tigon")]) == 0
    (ours,) = records(tmp_path / "tigon")
    (theirs,) = _trl_experimental(root, tokenizer, tmp_path, values, ORPOTrainer, ORPOConfig)
    assert ours["loss"] - ours["nll_loss"] == pytest.approx(theirs["loss"] - theirs["nll_loss"], rel=1e-5)
    # A margin is a difference of two rewards near -2: fp32 rounding of each is ~2e-7.
    assert ours["rewards/margins"] == pytest.approx(theirs["rewards/margins"], rel=1e-5, abs=1e-6)


def test_orpo_with_its_nll_on_the_prompt_equals_trls(tiny_run, tmp_path):
    """--nll-on-prompt: ORPO's NLL over prompt and answer, as TRL's ORPOTrainer takes it: the whole
    loss, the NLL and the log odds metrics equal."""
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    root, tokenizer = tiny_run
    values, argv = settings(root, method="orpo", max_steps=2, beta=0.3, nll_on_prompt=True)
    assert main(["rlhf", *argv, "--output-dir", str(tmp_path / "tigon")]) == 0
    ours = records(tmp_path / "tigon")
    theirs = _trl_experimental(root, tokenizer, tmp_path, values, ORPOTrainer, ORPOConfig)
    assert len(ours) == len(theirs) == 2
    for a, b in zip(ours, theirs):
        for key in ("loss", "nll_loss", "log_odds_ratio", "log_odds_chosen"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)


def test_builtin_model_trains_with_a_dpo_loss_type(tmp_path, monkeypatch):
    monkeypatch.setattr(builtin, "SFT_STAGE_STEPS", 2)
    monkeypatch.setattr(builtin, "DEMO_SFT", tmp_path / "no-demo" / "final")
    out = tmp_path / "run"
    assert main(["rlhf", "--loss-type", "discopop", "--max-steps", "2", "--batch-size", "4", "--save-steps", "0",
                 "--samples", "0", "--no-kernels", "--output-dir", str(out)]) == 0
    steps = records(out)
    assert [r["step"] for r in steps] == [1, 2]
    # DiscoPOP at z = 0 (the policy is its reference): (1 - 1/2) log 2 + 1/2
    assert steps[0]["loss"] == pytest.approx(0.5 * math.log(2) + 0.5, abs=1e-4)
    assert {"logits/chosen", "logits/rejected", "rewards/margins"} <= set(steps[0])


def test_the_frozen_references_patch_line_says_whose_it_is(tiny_run, tmp_path, caplog):
    """Full DPO patches the policy and its frozen reference alike: two lines, the second naming
    the reference (it read as the same line printed twice)."""
    caplog.set_level(logging.INFO)
    root, _ = tiny_run
    _, argv = settings(root, max_steps=1, kernels=True)
    assert main(["rlhf", *argv, "--output-dir", str(tmp_path / "o")]) == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tigon: applied")]
    assert len(lines) == 2 and lines[1] == f"{lines[0]} (the frozen reference)", lines


def test_kernels_and_the_fused_losss_triton_path_train_alike(tiny_run, tmp_path, monkeypatch, caplog):
    """The patched model (its kernels and the fused loss's in Triton's interpreter) takes the
    steps of the unpatched one scored by the loss's reference, LoRA, a few pairs."""
    caplog.set_level(logging.INFO)
    root, _ = tiny_run
    rows = (root / "pairs.jsonl").read_text().splitlines()[:6]
    (tmp_path / "few.jsonl").write_text("\n".join(rows) + "\n")
    _, argv = settings(root, tuner="lora", max_steps=3, batch_size=1, lr=1e-2, warmup=0.0,
                       dataset=[str(tmp_path / "few.jsonl")])
    argv = [a for a in argv if a != "--no-kernels"]
    assert main(["rlhf", *argv, "--no-kernels", "--output-dir", str(tmp_path / "off")]) == 0
    monkeypatch.delenv("TIGON_DISABLE")
    caplog.clear()
    assert main(["rlhf", *argv, "--output-dir", str(tmp_path / "on")]) == 0
    assert "tigon: applied rms_norm" in caplog.text and "linear_preference_loss runs its PyTorch" not in caplog.text
    off, on = records(tmp_path / "off"), records(tmp_path / "on")
    assert [r["step"] for r in on] == [1, 2, 3] and on[1]["loss"] != pytest.approx(on[0]["loss"], abs=1e-4)
    for a, b in zip(on, off):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], rel=1e-3, abs=1e-5)


@pytest.mark.parametrize("method, tuner", [("dpo", "lora"), ("kto", "full")])
def test_reference_forward_equals_precomputed_log_probs(tiny_run, tmp_path, method, tuner):
    """The reference as scored every step (LoRA: the adapter switched off; full: a frozen copy)
    gives the losses of the reference scored once before training."""
    root, _ = tiny_run
    _, argv = settings(root, method=method, tuner=tuner, max_steps=4, batch_size=4)
    if tuner == "lora":
        argv += ["--lora-rank", "4", "--lr", "2e-2"]
    for name, extra in (("forward", []), ("precomputed", ["--precompute-ref-log-probs"])):
        assert main(["rlhf", *argv, *extra, "--output-dir", str(tmp_path / name)]) == 0
    forward, precomputed = losses(tmp_path / "forward"), losses(tmp_path / "precomputed")
    assert sorted(forward) == [1, 2, 3, 4]
    assert [forward[s] for s in forward] == pytest.approx([precomputed[s] for s in forward], rel=1e-5, abs=1e-6)
    assert max(forward.values()) - min(forward.values()) > 1e-4  # the policy moved away from its reference


def test_reference_switches_the_adapter_off_as_peft_does_without_its_status_walk(tiny_run, monkeypatch):
    """The LoRA reference is the model with its adapter off, as under PEFT's disable_adapter():
    the same logits, the adapter's trainable flags back afterwards, and no walk of every module
    for PEFT's adapter status (host time a LoRA step pays in full) in any step."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from types import SimpleNamespace

    root, _ = tiny_run
    model = get_peft_model(plain_model(root), LoraConfig(r=4, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()  # an adapter that has trained: on and off differ
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    with model.disable_adapter(), torch.no_grad():
        peft_reference = model(input_ids=ids).logits
    adapted = model(input_ids=ids).logits.detach()
    trainer = SimpleNamespace(accelerator=SimpleNamespace(unwrap_model=lambda m: m), ref_model=None,
                              _adapter_layers=None)
    monkeypatch.setattr(PeftModel, "get_model_status", lambda self: pytest.fail("walked the adapter status"))
    for _ in range(2):  # the second step reuses the layers found in the first
        with rlhf._FusedPreference._as_reference(trainer, model):
            reference = model(input_ids=ids).logits
        torch.testing.assert_close(reference, peft_reference, rtol=0, atol=0)
        assert not torch.equal(reference, adapted) and not reference.requires_grad
        assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
        torch.testing.assert_close(model(input_ids=ids).logits, adapted, rtol=0, atol=0)
    assert len(trainer._adapter_layers) == 2 * 7  # q k v o gate up down in each of the two layers


def test_eval_split_records_the_eval_metrics(tiny_run, tmp_path):
    root, _ = tiny_run
    _, argv = settings(root, max_steps=2, eval_split=0.25, save_steps=1)
    assert main(["rlhf", *argv, "--output-dir", str(tmp_path / "out")]) == 0
    evals = [r for r in records(tmp_path / "out") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [1, 2]
    assert all({"eval_rewards/margins", "eval_rewards/accuracies"} <= set(r) for r in evals)


RESUMABLE = ["--tuner", "lora", "--lora-rank", "4", "--lr", "2e-2", "--max-steps", "6"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_run, tmp_path_factory):
    """A LoRA DPO run never interrupted, checkpointed at steps 3 and 6."""
    root, _ = tiny_run
    full = tmp_path_factory.mktemp("resume") / "full"
    _, argv = settings(root)
    assert main(["rlhf", *argv, *RESUMABLE, "--save-steps", "3", "--output-dir", str(full)]) == 0
    return full


def test_resume_continues_exactly(tiny_run, uninterrupted, tmp_path):
    import shutil

    root, _ = tiny_run
    _, argv = settings(root)
    cut = tmp_path / "cut"
    shutil.copytree(uninterrupted, cut)
    for d in ("checkpoint-6", "final"):
        shutil.rmtree(cut / d)
    assert main(["rlhf", *argv, *RESUMABLE, "--save-steps", "3", "--output-dir", str(cut), "--resume"]) == 0
    same_run(uninterrupted, cut)


def test_ctrl_c_saves_a_checkpoint_that_resumes_exactly(tiny_run, uninterrupted, tmp_path, monkeypatch, capsys):
    """A real SIGINT during step 3 of a run with no checkpoint due: the step finishes, a complete
    checkpoint is written, one line says so, exit 130; --resume ends where the run never
    interrupted ended."""
    from transformers import TrainerCallback

    class CtrlC(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:
                os.kill(os.getpid(), signal.SIGINT)

    root, _ = tiny_run
    _, argv = settings(root)
    cut = tmp_path / "cut"
    with monkeypatch.context() as patched:
        patched.setattr(rlhf, "TigonDPOTrainer", with_callbacks(rlhf.TigonDPOTrainer, CtrlC()))
        assert main(["rlhf", *argv, *RESUMABLE, "--save-steps", "0", "--output-dir", str(cut)]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"tigon rlhf: stopped by Ctrl-C at step 3 of 6: saved {cut / 'checkpoint-3'}; rerun the same command with "
        "--resume to continue")
    assert [p.name for p in cut.iterdir() if p.name.startswith(("checkpoint-", ".tmp-", "final"))] == ["checkpoint-3"]
    assert main(["rlhf", *argv, *RESUMABLE, "--save-steps", "0", "--output-dir", str(cut), "--resume"]) == 0
    same_run(uninterrupted, cut)


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "{tmp}/bad.jsonl"], "{tmp}/bad.jsonl line 2: chosen is empty"),
    (["--dataset", "{tmp}/kto.jsonl"], "{tmp}/kto.jsonl line 1: prompt/completion/label rows are unpaired"),
    (["--dataset", "{tmp}/sft.jsonl"], "{tmp}/sft.jsonl line 1: unknown data format (keys ['messages'])"),
    (["--method", "kto", "--batch-size", "1"], "--method kto estimates its KL baseline"),
    (["--simpo-gamma", "2"], "--simpo-gamma: only for --method simpo, not dpo"),
    (["--method", "orpo", "--precompute-ref-log-probs"],
     "--precompute-ref-log-probs: only for --method dpo / ipo / kto, not orpo"),
    (["--max-prompt-length", "200", "--max-length", "100"], "--max-prompt-length must be in [1, --max-length 100)"),
    (["--tuner", "lora", "--lora-dropout", "0.1"], "--lora-dropout: preference training switches dropout off"),
    (["--beta", "0"], "--beta must be > 0, got 0.0"),
    (["--loss-type", "dapo"], "--loss-type dapo is not a dpo loss type; --method dpo takes sigmoid, hinge"),
    (["--method", "kto", "--loss-type", "apo_zero"], "--loss-type: only for --method grpo / dpo, not kto"),
    (["--loss-type", "apo_zero", "--label-smoothing", "0.1"], "--label-smoothing: only for --loss-type sigmoid"),
    (["--loss-type", "exo_pair"], "--loss-type exo_pair needs --label-smoothing > 0"),
    (["--discopop-tau", "0.1"], "--discopop-tau: only for --loss-type discopop, not sigmoid"),
    (["--method", "ipo", "--average-log-probs"], "--average-log-probs: only for --method dpo / kto / cpo, not ipo"),
    (["--nll-on-prompt"], "--nll-on-prompt: --method dpo adds no NLL (--nll-weight 0)"),
    (["--model", "./no/such/model"], "model not found: ./no/such/model"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, argv, message):
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    (tmp_path / "bad.jsonl").write_text(json.dumps(good) + "\n" + json.dumps({**good, "chosen": " "}) + "\n")
    (tmp_path / "kto.jsonl").write_text(json.dumps({"prompt": "q", "completion": "a", "label": True}) + "\n")
    (tmp_path / "sft.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["rlhf", "--output-dir", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tigon rlhf: error: {message.format(tmp=tmp_path)}")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def _sequence_log_probs(model, batch):
    """Each sequence's summed log-prob of its answer tokens, from the model's logits."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits[:, :-1]
    target = rlhf._targets(batch["input_ids"], batch["completion_mask"])
    picked = logits.log_softmax(-1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
    return (picked * (target != -100)).sum(-1)


@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_cuda_graphs_batches_have_one_shape_and_score_the_same(tiny_run, method):
    """--cuda-graphs pads every batch to one shape (KTO's KL sequences to the longest a prompt
    with another row's answer makes, as its trainer pairs them), on the right and without a mask:
    the answers' log-probs are those of the unpadded, masked batch, and a row wider than the width
    is one clear error."""
    root, tokenizer = tiny_run
    cfg = resolve_rlhf(RLHFConfig(model=str(root / "m"), method=method, max_length=48, batch_size=4))
    items = preference.load_preferences([str(root / "pairs.jsonl")], cfg.seed, method)
    rows = preference.encode_all(tokenizer, items, cfg.max_length, None, "training data")
    kto = method == "kto"
    if kto:
        rows = [{**row, "KL_completion_ids": answer}
                for row, answer in zip(rows, rlhf.kl_answers([r["completion_ids"] for r in rows], cfg.batch_size))]
    widths = rlhf.graph_widths(cfg, [rows])
    plain_collate = rlhf.PreferenceCollator(tokenizer.pad_token_id, kto)
    padded_collate = rlhf.PreferenceCollator(tokenizer.pad_token_id, kto, widths)
    model = plain_model(root).eval()
    natural_kl, masked = [], []
    for start in range(0, len(rows), cfg.batch_size):
        features = rows[start:start + cfg.batch_size]
        plain, padded = plain_collate(features), padded_collate(features)
        masked.append("attention_mask" in plain)
        assert padded[rlhf.NUM_TOKENS] == plain[rlhf.NUM_TOKENS]
        assert padded["input_ids"].shape[1] == cfg.max_length and "attention_mask" not in padded
        assert torch.equal(padded["input_ids"][:, :plain["input_ids"].shape[1]], plain["input_ids"])
        torch.testing.assert_close(_sequence_log_probs(model, padded), _sequence_log_probs(model, plain),
                                   rtol=1e-5, atol=1e-5)
        if kto:
            assert padded["KL_input_ids"].shape[1] == widths["KL_"] and "KL_attention_mask" not in padded
            natural_kl.append(plain["KL_input_ids"].shape[1])
            kl = {k[3:]: v for k, v in padded.items() if k.startswith("KL_")}
            plain_kl = {k[3:]: v for k, v in plain.items() if k.startswith("KL_")}
            torch.testing.assert_close(_sequence_log_probs(model, kl), _sequence_log_probs(model, plain_kl),
                                       rtol=1e-5, atol=1e-5)
    assert any(masked)  # some plain batches were padded, and masked
    assert not kto or max(natural_kl) == widths["KL_"]  # the width is the longest KL sequence, no wider
    narrow = rlhf.PreferenceCollator(tokenizer.pad_token_id, kto, {"": 8})
    with pytest.raises(ValueError, match="^input_ids: a row of [0-9]+ tokens does not fit the collator's width 8$"):
        narrow(rows[:cfg.batch_size])


def test_an_unknown_loss_type_is_one_line(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["rlhf", "--loss-type", "nope"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1
    assert err.startswith("tigon rlhf: error: argument --loss-type: invalid choice: 'nope'")


def test_packing_is_no_rlhf_option():
    with pytest.raises(SystemExit):
        main(["rlhf", "--packing"])


def test_sft_and_the_command_line_never_import_trl():
    """The GPU machines carry TRL only for `tigon rlhf`: nothing else may need it."""
    code = ("import sys, tigon.cli, tigon.train.run, tigon.train.config; tigon.cli.build_parser(); "
            "import tigon.train; tigon.train.RLHFConfig; "
            "assert 'trl' not in sys.modules, sorted(m for m in sys.modules if m.startswith('trl'))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(tigon.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("tuner", ["full", "lora"])
def test_gpu_bf16_kernels_and_fused_loss_train_like_trl(tmp_path, monkeypatch, tuner):
    """On the GPU, in bf16: `tigon rlhf --method dpo` with tigon's kernels and the fused loss's
    Triton path takes the steps of TRL's DPOTrainer on the unpatched model (bf16 tolerance)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, set_seed

    monkeypatch.delenv("TIGON_DISABLE")  # the Triton paths, compiled
    tokenizer = tiny.build_tokenizer(load_samples([str(tiny.BUNDLED_DATASET)], seed=0))
    tiny.build_model(tokenizer, 0, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2, vocab_size=32003).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    ensure_chat_template(tokenizer)
    values = dict(model=str(tmp_path / "m"), tuner=tuner, dtype="bf16", lr=1e-4 if tuner == "lora" else 1e-5,
                  batch_size=8, max_steps=8, save_steps=0, samples=0)
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in values.items()]
    assert main(["rlhf", *argv, "--output-dir", str(tmp_path / "tigon")]) == 0
    cfg = resolve_rlhf(RLHFConfig(output_dir=str(tmp_path / "trl"), **values))
    args = rlhf.trl_arguments(cfg, torch.bfloat16, False)
    args.precompute_ref_log_probs = False
    rows = [json.loads(line) for line in rlhf.BUNDLED_PREFERENCES.read_text().splitlines()]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                               "chosen": [{"role": "assistant", "content": r["chosen"]}],
                               "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows])
    set_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16)
    model.config.use_cache = False
    peft_config = None
    if tuner == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                             peft_config=peft_config)
    trainer.train()
    theirs = [r for r in trainer.state.log_history if "loss" in r]
    ours = records(tmp_path / "tigon")
    assert len(ours) == len(theirs) == 8
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=3e-2, abs=3e-3), a["step"]
    assert all(r["gpu_mem_gib"] > 0 for r in ours)


@pytest.mark.gpu
@pytest.mark.parametrize("method, tuner", [("dpo", "lora"), ("dpo", "full"), ("kto", "lora")])
def test_gpu_steps_never_wait_for_the_device(tmp_path, monkeypatch, method, tuner):
    """Between logs nothing in a `tigon rlhf` step (the policy and reference forwards, the fused
    loss, the metrics, the token count) reads the GPU back. Every sequence is cut to --max-length,
    so the batches (KTO's KL batch too) are unpadded and carry no attention mask, as in the benchmark."""
    from transformers import TrainerCallback

    monkeypatch.delenv("TIGON_DISABLE")  # the Triton paths, compiled
    tokenizer = tiny.build_tokenizer(load_samples([str(tiny.BUNDLED_DATASET)], seed=0))
    tiny.build_model(tokenizer, 0, hidden_size=256, intermediate_size=704, num_hidden_layers=2).save_pretrained(
        tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    words = rlhf.BUNDLED_PREFERENCES.read_text().split()
    rng = random.Random(0)
    # One prompt for all: KTO's KL batch pairs each answer with another row's prompt, and prompts of
    # different lengths would pad it (HF's SDPA mask code then reads the mask back to see if it may skip it).
    prompt = " ".join(rng.choices(words, k=20))
    (tmp_path / "pairs.jsonl").write_text("".join(
        json.dumps({"prompt": prompt, "chosen": " ".join(rng.choices(words, k=200)),
                    "rejected": " ".join(rng.choices(words, k=200))}) + "\n" for _ in range(64)))

    class StrictSteps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:  # after the warm-up steps (compilation, first allocations)
                torch.cuda.set_sync_debug_mode("error")

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == args.max_steps:  # before the final log reads the loss
                torch.cuda.set_sync_debug_mode("default")

    name = "TigonKTOTrainer" if method == "kto" else "TigonDPOTrainer"
    monkeypatch.setattr(rlhf, name, with_callbacks(getattr(rlhf, name), StrictSteps()))
    try:
        assert main(["rlhf", "--model", str(tmp_path / "m"), "--dataset", str(tmp_path / "pairs.jsonl"),
                     "--method", method, "--tuner", tuner, "--dtype", "bf16", "--max-length", "128",
                     "--batch-size", "4", "--max-steps", "6", "--logging-steps", "100", "--save-steps", "0",
                     "--samples", "0", "--output-dir", str(tmp_path / "out")]) == 0
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("method, tuner", [("dpo", "lora"), ("dpo", "full"), ("kto", "lora")])
def test_gpu_cuda_graphs_train_like_without(tmp_path, caplog, monkeypatch, method, tuner):
    """`tigon rlhf --cuda-graphs` (the policy's and the reference's forwards and the backward
    replayed as CUDA graphs, batches padded to one shape) takes the steps of the same run without
    it, with gradient accumulation."""
    monkeypatch.delenv("TIGON_DISABLE")  # the Triton paths, compiled
    tokenizer = tiny.build_tokenizer(load_samples([str(tiny.BUNDLED_DATASET)], seed=0))
    tiny.build_model(tokenizer, 0, hidden_size=256, intermediate_size=704, num_hidden_layers=2).save_pretrained(
        tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    argv = ["--model", str(tmp_path / "m"), "--method", method, "--tuner", tuner, "--dtype", "bf16",
            "--max-length", "96", "--batch-size", "4", "--grad-accum", "2", "--max-steps", "5", "--save-steps", "0",
            "--samples", "0", "--lr", "1e-4"]
    assert main(["rlhf", *argv, "--output-dir", str(tmp_path / "plain")]) == 0
    assert main(["rlhf", *argv, "--output-dir", str(tmp_path / "graphs"), "--cuda-graphs"]) == 0
    assert not [r for r in caplog.records if "cannot be captured" in r.getMessage()]  # it replayed
    plain, graphs = records(tmp_path / "plain"), records(tmp_path / "graphs")
    assert [r["step"] for r in graphs] == [r["step"] for r in plain] == [1, 2, 3, 4, 5]
    for a, b in zip(graphs, plain):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2, abs=2e-3), a["step"]
