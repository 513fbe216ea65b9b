"""`tigon rlhf --method grpo` on CPU: the fused loss against TRL's own `_compute_loss` on the same
model and rollout (every loss type, with and without a reference and an old policy), a few steps
of the command against TRL's unpatched GRPOTrainer with the same model, data and seed, the
built-in rewards, the embedded default, and bad input (reward functions and flags) as one line.

The fused loss runs its PyTorch reference here (TIGON_DISABLE); its kernels are checked against
that reference in tests/ops/test_linear_policy.py."""

import json
import logging
import random

import pytest
import torch

from tests.train.fused_helpers import argv_of, assert_same_steps, one_thread_and_references, plain_model, save_tiny
from tigon.bench.ops.rl import trl_sampling_ratio
from tigon.cli import main
from tigon.train import builtin, grpo, rewards, tiny
from tigon.train.config import RLHFConfig, resolve_rlhf
from tigon.train.data import load_samples
from tigon.train.template import ensure_chat_template

trl = pytest.importorskip("trl")


@pytest.fixture(scope="module", autouse=True)
def quick():
    with one_thread_and_references("linear_policy_loss,linear_log_probs"):
        yield


@pytest.fixture(scope="module")
def tiny_grpo(tmp_path_factory):
    """A saved tiny model (a user's --model), its tokenizer, and 12 of the bundled prompts."""
    root = tmp_path_factory.mktemp("grpo")
    tokenizer = tiny.build_tokenizer(load_samples([str(tiny.BUNDLED_DATASET)], seed=0))
    save_tiny(root / "m", tokenizer)
    ensure_chat_template(tokenizer)
    rows = grpo.BUNDLED_PROMPTS.read_text().splitlines()
    (root / "prompts.jsonl").write_text("".join(line + "\n" for line in random.sample(rows, 12)))
    return root, tokenizer


def grpo_values(root, **extra):
    values = dict(method="grpo", model=str(root / "m"), dataset=[str(root / "prompts.jsonl")], kernels=False,
                  batch_size=4, num_generations=4, max_completion_length=6, lr=1e-3, save_steps=0, samples=0,
                  tuner="full")
    values.update(extra)
    return values


def trainer_for(root, tokenizer, tmp_path, **extra):
    """tigon's GRPO trainer as `tigon rlhf --method grpo` makes it (the arguments it gives TRL)."""
    from datasets import Dataset

    cfg = resolve_rlhf(RLHFConfig(output_dir=str(tmp_path), **grpo_values(root, **extra)))
    rows, _ = grpo.prompt_rows(tokenizer, grpo.load_prompts(cfg.dataset, cfg.seed), cfg.max_length, "data")
    fns = [r.fn for r in rewards.load_rewards(None, cfg.format_regex, cfg.max_completion_length)]
    return grpo.TigonGRPOTrainer(model=plain_model(root / "m"), reward_funcs=fns, args=grpo.trl_arguments(cfg, torch.float32, False),
                                 train_dataset=Dataset.from_list(rows), processing_class=tokenizer)


def rollout(trainer, completions=4, prompt_len=5, completion_len=7, old=True, ref=True):
    """A generation batch as TRL's `_generate_and_score_completions` hands it to the loss: left-padded
    prompts, completions cut at different lengths, group advantages, the old policy's and the
    reference's per-token log-probs near the policy's."""
    vocab = trainer.model.config.vocab_size
    g = torch.Generator().manual_seed(random.randrange(2**31))
    prompt_ids = torch.randint(3, vocab, (completions, prompt_len), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :2] = 0
    completion_ids = torch.randint(3, vocab, (completions, completion_len), generator=g)
    lengths = torch.tensor([completion_len, 3, 1, completion_len - 2][:completions])
    completion_mask = (torch.arange(completion_len) < lengths[:, None]).long()
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": torch.randn(completions, generator=g),
              "num_items_in_batch": completion_mask.sum().float()}
    inputs = {k: v.to(trainer.model.device) for k, v in inputs.items()}
    prompt_ids, prompt_mask, completion_ids, completion_mask = (
        inputs[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"))
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.cat([prompt_ids, completion_ids], 1),
                               attention_mask=torch.cat([prompt_mask, completion_mask], 1)).logits
        logps = torch.log_softmax(logits[:, prompt_len - 1:-1] / trainer.temperature, -1)
        logps = logps.gather(-1, completion_ids[..., None])[..., 0]
    if old:
        inputs["old_per_token_logps"] = logps + 0.3 * torch.randn(logps.shape, generator=g).to(logps.device)
    if ref:
        inputs["ref_per_token_logps"] = logps + 0.2 * torch.randn(logps.shape, generator=g).to(logps.device)
    return inputs


@pytest.mark.parametrize("loss_type, beta, old, extra", [
    ("grpo", 0.04, True, {}), ("dapo", 0.0, True, {}), ("dr_grpo", 0.1, False, {}), ("bnpo", 0.04, True, {}),
    ("gspo", 0.04, True, {}), ("cispo", 0.04, True, dict(epsilon_high=1.2)), ("sapo", 0.04, True, {}),
    ("luspo", 0.04, True, {}), ("vespo", 0.04, True, dict(vespo_k_neg=2.0)), ("dapo", 0.04, True, dict(delta=1.2)),
])
def test_fused_loss_and_gradients_equal_trls_compute_loss(tiny_grpo, tmp_path, loss_type, beta, old, extra):
    """One rollout, two losses: TRL 1.16's `GRPOTrainer._compute_loss` (its logits, unpatched model)
    and tigon's (hidden states and head into `linear_policy_loss`): equal loss, gradient of every
    parameter, and KL / clip-fraction metrics, with accumulation over 2 steps and a clip range
    that some ratios leave."""
    compare_compute_loss(tiny_grpo, tmp_path, loss_type, beta, old, 1e-4, **extra)


@pytest.mark.parametrize("loss_type, mode, low", [("dapo", "token_truncate", None), ("grpo", "sequence_mask", 0.5),
                                                  ("vespo", "token_mask", 0.5), ("gspo", "sequence_truncate", 0.5)])
def test_vllm_importance_sampling_equals_trls(tiny_grpo, tmp_path, loss_type, mode, low):
    """--use-vllm: tigon hands vLLM's sampling log-probs to the fused loss, which forms TRL's
    importance-sampling weight itself; TRL's loss reads the ratio its generation step formed."""
    def vllm(trainer, inputs):
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
        trainer.vllm_importance_sampling_mode = mode
        trainer.vllm_importance_sampling_clip_min = low
        old, mask = inputs["old_per_token_logps"], inputs["completion_mask"]
        g = torch.Generator().manual_seed(1)
        sampling = old + 0.8 * torch.randn(old.shape, generator=g).to(old.device)
        sampling[0, 0] = float("nan")
        inputs["sampling_per_token_logps"] = sampling
        inputs["importance_sampling_ratio"] = trl_sampling_ratio(old, sampling, mask, mode, low)
        assert ((inputs["importance_sampling_ratio"] - 1).abs() > 0.1).any()

    compare_compute_loss(tiny_grpo, tmp_path, loss_type, 0.04, True, 1e-4, prepare=vllm)


@pytest.mark.gpu
@pytest.mark.parametrize("loss_type, beta, old", [("grpo", 0.04, True), ("dapo", 0.0, True), ("gspo", 0.04, True),
                                                  ("sapo", 0.04, True), ("vespo", 0.04, True), ("luspo", 0.0, True)])
def test_gpu_fused_kernels_equal_trls_compute_loss(tiny_grpo, tmp_path, monkeypatch, loss_type, beta, old):
    """The same on the GPU with `linear_policy_loss`'s Triton kernels (fp32; TF32-level tolerance)."""
    monkeypatch.delenv("TIGON_DISABLE")
    compare_compute_loss(tiny_grpo, tmp_path, loss_type, beta, old, 2e-3)


def compare_compute_loss(tiny_grpo, tmp_path, loss_type, beta, old, rtol, prepare=None, **extra):
    root, tokenizer = tiny_grpo
    extra = {"epsilon_high": 0.15, **extra}
    trainer = trainer_for(root, tokenizer, tmp_path, loss_type=loss_type, beta=beta, epsilon=0.1, grad_accum=2,
                          **extra)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    inputs = rollout(trainer, old=old, ref=beta > 0)
    if prepare is not None:
        prepare(trainer, inputs)

    def loss_and_grads(compute):
        trainer.model.zero_grad()
        trainer._metrics["train"].clear()
        loss = compute(trainer, trainer.model, inputs)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}

    theirs, their_grads = loss_and_grads(trl.GRPOTrainer._compute_loss)
    their_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    ours, our_grads = loss_and_grads(grpo.TigonGRPOTrainer._compute_loss)
    assert ours.item() == pytest.approx(theirs.item(), rel=rtol / 10, abs=1e-7)
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=rtol, atol=1e-6, msg=name)
    our_metrics = trainer._averages("train")
    for key in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio",
                "vespo/phi_seq_mean"):
        assert (key in our_metrics) == (key in their_metrics), key
        if key in their_metrics:
            assert our_metrics[key] == pytest.approx(their_metrics[key], rel=rtol, abs=1e-6), key
    assert ("kl" in our_metrics) == (beta > 0)


def test_a_few_steps_equal_trls_grpo_trainer(tiny_grpo, tmp_path):
    """`tigon rlhf --method grpo` against TRL's GRPOTrainer on the unpatched model, fed the same
    prompts (tigon's rows), arguments and seed: the same completions are sampled (equal rewards and
    lengths) and the losses are equal at every step. The reward (a random model's completions'
    letters) differs within each group, so the policy moves: a KL to the reference at step 3."""
    from datasets import Dataset
    from transformers import set_seed

    root, tokenizer = tiny_grpo
    (tmp_path / "letters.py").write_text(
        "def letters(prompts, completions, **kwargs):\n"
        "    return [float(sum(ch.isalpha() for ch in c[0]['content'])) for c in completions]\n")
    values = grpo_values(root, max_steps=3, beta=0.05, reward_funcs=[f"{tmp_path}/letters.py:letters"])
    out = tmp_path / "tigon"
    assert main(["rlhf", *argv_of(values), "--output-dir", str(out)]) == 0
    ours = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    cfg = resolve_rlhf(RLHFConfig(output_dir=str(tmp_path / "trl"), **values))
    rows, _ = grpo.prompt_rows(tokenizer, grpo.load_prompts(cfg.dataset, cfg.seed), cfg.max_length, "data")
    fns = [r.fn for r in rewards.load_rewards(cfg.reward_funcs, cfg.format_regex, cfg.max_completion_length)]
    set_seed(cfg.seed)
    trainer = trl.GRPOTrainer(model=plain_model(root / "m"), reward_funcs=fns, args=grpo.trl_arguments(cfg, torch.float32, False),
                              train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    trainer.train()
    assert_same_steps(ours, trainer, 3)
    assert ours[0]["reward_std"] > 0 and ours[-1]["kl"] > 1e-5


def test_builtin_rewards():
    completions = [[{"role": "assistant", "content": t}] for t in ("7 plus 5 is 12.", "It is 11", "twelve", "")]
    answers = ["12", "12", "Twelve.", None]
    assert rewards.exact_answer([None] * 4, completions, answers) == [1.0, 0.0, 1.0, None]
    fmt = rewards.format_reward(r"^[^\n]*\S[^\n]*\.$")
    assert fmt([None] * 4, completions) == [1.0, 0.0, 0.0, 0.0]
    length = rewards.length_penalty(8)
    assert length([None] * 3, completions[:3], completion_ids=[[1] * 2, [1] * 8, [1] * 12]) == [-0.25, -1.0, -1.0]
    names = [r.spec for r in rewards.load_rewards(["builtin:length,format", "builtin:exact_answer"], ".", 4)]
    assert names == ["builtin:length", "builtin:format", "builtin:exact_answer"]


def test_builtin_default_runs_grpo_after_an_sft_stage(tmp_path, monkeypatch, caplog):
    """No model, no data: the built-in model after a (shortened) sft stage, on the bundled
    arithmetic prompts with the default rewards, each logged by name."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(builtin, "SFT_STAGE_STEPS", 2)
    monkeypatch.setattr(builtin, "DEMO_SFT", tmp_path / "no-demo" / "final")
    out = tmp_path / "run"
    argv = ["--method", "grpo", "--max-steps", "2", "--batch-size", "8", "--num-generations", "4",
            "--max-completion-length", "4", "--samples", "1", "--max-new-tokens", "4", "--no-kernels"]
    assert main(["rlhf", "--output-dir", str(out), *argv]) == 0
    assert "rewards: builtin:exact_answer, builtin:format" in caplog.text
    assert f"by tigon sft into {out / 'sft'}" in caplog.text
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert {"loss", "reward", "rewards/exact_answer/mean", "rewards/format/mean", "entropy"} <= set(r)
        assert 0 <= r["rewards/exact_answer/mean"] <= 1 and r["tokens_per_s"] > 0
    assert (out / "final" / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def builtin_sft(tmp_path_factory):
    """The built-in model after a 2-step sft stage, as `make demo` leaves it, for the runs below."""
    out = tmp_path_factory.mktemp("builtin-sft")
    assert main(["sft", "--output-dir", str(out), "--max-steps", "2", "--samples", "0", "--no-kernels"]) == 0
    return out / "final"


@pytest.mark.parametrize("argv, logged", [
    (["--loss-type", "cispo", "--epsilon-high", "5"], "cispo_clip_ratio"), (["--loss-type", "sapo"], "entropy"),
    (["--loss-type", "luspo", "--beta", "0.02"], "clip_ratio/region_mean"),
    (["--loss-type", "vespo"], "vespo/phi_seq_mean"),
    (["--loss-type", "dr_grpo", "--delta", "1.5"], "clip_ratio/region_mean"),
])
def test_builtin_model_trains_with_each_new_loss_type(tmp_path, monkeypatch, builtin_sft, argv, logged):
    monkeypatch.setattr(builtin, "DEMO_SFT", builtin_sft)
    out = tmp_path / "run"
    assert main(["rlhf", "--output-dir", str(out), "--method", "grpo", "--max-steps", "2", "--batch-size", "8",
                 "--num-generations", "4", "--max-completion-length", "4", "--samples", "0", "--no-kernels",
                 *argv]) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(logged in r and r["loss"] == r["loss"] for r in steps)


REWARD_FILE = '''
def fine(prompts, completions, **kwargs):
    return [1.0] * len(completions)

def no_kwargs(completions):
    return [0.0] * len(completions)

def broken(prompts, completions, **kwargs):
    return [1 / 0 for _ in completions]

def short(prompts, completions, **kwargs):
    return [1.0]

def words(prompts, completions, **kwargs):
    return ["good"] * len(completions)
'''


@pytest.mark.parametrize("argv, message", [
    (["--reward-funcs", "{tmp}/none.py:fine"], "--reward-funcs {tmp}/none.py:fine: no such file: {tmp}/none.py"),
    (["--reward-funcs", "{tmp}/r.py:missing"], "--reward-funcs {tmp}/r.py:missing: {tmp}/r.py defines no function "
                                               "'missing' (its functions: broken, fine, no_kwargs, short, words)"),
    (["--reward-funcs", "{tmp}/r.py:no_kwargs"], "--reward-funcs {tmp}/r.py:no_kwargs: no_kwargs(completions) cannot "
                                                 "take TRL's call"),
    (["--reward-funcs", "{tmp}/r.py:fine,broken"], "reward function broken raised ZeroDivisionError: division by zero "
                                                   "({tmp}/r.py line 9)"),
    (["--reward-funcs", "{tmp}/r.py:short"], "reward function short returned 1 values for 2 completions"),
    (["--reward-funcs", "{tmp}/r.py:words"], "reward function words returned 'good' (str) among its rewards"),
    (["--reward-funcs", "{tmp}/syntax.py:f"], "--reward-funcs {tmp}/syntax.py:f: importing {tmp}/syntax.py raised "
                                              "SyntaxError"),
    (["--reward-funcs", "builtin:accuracy"], "--reward-funcs builtin:accuracy: no built-in reward 'accuracy'; choose "
                                             "from exact_answer, format, length"),
    (["--reward-funcs", "fine"], "--reward-funcs fine: 'fine' is not FILE.py:FUNCTION or builtin:NAME"),
    (["--reward-funcs", "builtin:exact_answer", "--dataset", "{tmp}/plain.jsonl"],
     "--reward-funcs builtin:exact_answer reads the data's answer column, which the data lacks (its columns: none)"),
    (["--format-regex", "(["], "--format-regex '([': not a regular expression"),
    (["--num-generations", "1"], "--num-generations must be >= 2"),
    (["--batch-size", "6", "--num-generations", "4"], "--batch-size (6 completions) x --grad-accum (1) must be a "
                                                      "multiple of --num-generations (4)"),
    (["--temperature", "0"], "--temperature must be > 0, got 0.0"),
    (["--beta", "-1"], "--beta must be >= 0, got -1.0"),
    (["--loss-type", "sapo", "--delta", "1.5"], "--delta caps the clipped ratio, which --loss-type sapo has not"),
    (["--delta", "1"], "--delta must be > 1 (INTELLECT-2 takes it above 1 + --epsilon-high), got 1.0"),
    (["--loss-type", "sapo", "--sapo-temperature-neg", "0"], "--sapo-temperature-neg must be > 0, got 0.0"),
    (["--vespo-k-pos", "-1"], "--vespo-k-pos must be >= 0, got -1.0"),
    (["--vllm-importance-sampling-clip-min", "4"], "--vllm-importance-sampling-clip-min (4.0) must not exceed "
                                                    "--vllm-importance-sampling-clip-max (3.0)"),
    (["--loss-type", "vespo", "--vllm-importance-sampling-mode", "sequence_mask"],
     "--vllm-importance-sampling-mode sequence_mask: vespo folds the correction into its per-token weights"),
])
def test_bad_grpo_input_is_one_line_and_writes_nothing(tmp_path, capsys, argv, message):
    (tmp_path / "r.py").write_text(REWARD_FILE)
    (tmp_path / "syntax.py").write_text("def f(:\n")
    (tmp_path / "plain.jsonl").write_text(json.dumps({"prompt": "What is 1 plus 1?"}) + "\n")
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["rlhf", "--method", "grpo", "--output-dir", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tigon rlhf: error: {message.format(tmp=tmp_path)}"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_unknown_loss_type_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["rlhf", "--method", "grpo", "--output-dir", str(tmp_path / "out"), "--loss-type", "ppo"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert err.startswith("tigon rlhf: error: argument --loss-type: invalid choice: 'ppo' (choose from 'grpo', "), err


@pytest.mark.parametrize("argv, message", [
    (["--num-generations", "4"], "--num-generations: only for --method grpo / ppo / rloo, not dpo"),
    (["--reward-funcs", "builtin:format"], "--reward-funcs: only for --method grpo / ppo / rloo, not dpo"),
    (["--delta", "1.5"], "--delta: only for --method grpo, not dpo"),
])
def test_grpo_flags_are_refused_for_other_methods(tmp_path, capsys, argv, message):
    assert main(["rlhf", "--output-dir", str(tmp_path / "out"), *argv]) == 2
    assert capsys.readouterr().err.startswith(f"tigon rlhf: error: {message}")


def test_help_names_the_built_in_rewards(capsys):
    with pytest.raises(SystemExit):
        main(["rlhf", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in ("builtin:exact_answer", "builtin:format", "builtin:length", "--num-generations",
                 "--max-completion-length", "--reward-funcs"):
        assert name in text
