"""`tigon rlhf --method ppo` and `--method rloo` on CPU: GAE and the per-token rewards against a
small example worked by hand, PPO's loss (fused policy term and value term) against the same
loss in plain PyTorch from the materialised logits, RLOO's fused loss against TRL's own
`_compute_loss` and a few steps of the command against TRL's unpatched RLOOTrainer, the reward
model as a reward function, the embedded defaults, and bad flags as one line.

As in test_grpo (whose fixtures these tests share), the fused ops run their PyTorch references
but for the gpu-marked test, which runs `linear_policy_loss`'s kernels."""

import json
import logging
import random
import shutil

import pytest
import torch

from tests.train.fused_helpers import argv_of, assert_same_steps, plain_model
from tests.train.test_grpo import rollout as grpo_rollout
from tests.train.test_grpo import quick, tiny_grpo  # noqa: F401 (GRPO's fixtures: see there)
from tigon.cli import main
from tigon.train import advantages, builtin, grpo, ppo, rewards, rloo
from tigon.train.config import RLHFConfig, SFTError, resolve_rlhf
from tigon.train.reward import model_reward

trl = pytest.importorskip("trl")


def rl_values(root, method, **extra):
    values = dict(method=method, model=str(root / "m"), dataset=[str(root / "prompts.jsonl")], kernels=False,
                  batch_size=4, num_generations=2, max_completion_length=6, lr=1e-3, save_steps=0, samples=0,
                  tuner="full")
    values.update(extra)
    return values


def trainer_for(root, tokenizer, tmp_path, method, **extra):
    """The trainer `tigon rlhf --method ppo|rloo` makes (the arguments it gives TRL)."""
    from datasets import Dataset

    cfg = resolve_rlhf(RLHFConfig(output_dir=str(tmp_path), **rl_values(root, method, **extra)))
    rows, _ = grpo.prompt_rows(tokenizer, grpo.load_prompts(cfg.dataset, cfg.seed), cfg.max_length, "data")
    fns = [r.fn for r in rewards.load_rewards(None, cfg.format_regex, cfg.max_completion_length)]
    spec = ppo.PPO if method == "ppo" else rloo.RLOO
    return spec.trainer(model=plain_model(root / "m"), reward_funcs=fns, args=spec.arguments(cfg, torch.float32, False),
                        train_dataset=Dataset.from_list(rows), processing_class=tokenizer, **spec.trainer_options(cfg))


# --- the math -----------------------------------------------------------------------------------

def test_gae_equals_a_hand_computed_example():
    """Two completions of 3 and 2 tokens (the second padded), gamma 0.9, lambda 0.5, worked by hand:
    row 0: deltas 0.4, 0.8, -1 -> A = 0.5575, 0.35, -1; row 1: deltas 1.7, -1 -> A = 1.25, -1, and the
    padding's value and reward (9, 5) never enter."""
    rewards_ = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
    values = torch.tensor([[0.5, 1.0, 2.0], [1.0, 3.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    got, returns = advantages.gae(rewards_, values, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(got, torch.tensor([[0.5575, 0.35, -1.0], [1.25, -1.0, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[1.0575, 1.35, 1.0], [2.25, 2.0, 0.0]]))
    # lambda 1, gamma 1: Monte Carlo returns, the rewards to go.
    _, returns = advantages.gae(rewards_, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))


@pytest.mark.parametrize("tokens", [0, 1, 5, 127, 128, 129, 300])
@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.99, 0.9), (1.0, 1.0), (0.5, 0.0)])
def test_gae_equals_the_token_by_token_recurrence(tokens, gamma, lam):
    """Across and inside the chunks the closed form takes: A_t = delta_t + gamma lam A_{t+1},
    walked back one token at a time, on random completions of random lengths (one empty)."""
    gen = torch.Generator().manual_seed(tokens)
    rewards_, values = torch.randn(4, tokens, generator=gen), torch.randn(4, tokens, generator=gen)
    lengths = torch.tensor([tokens, tokens // 2, 0, max(tokens - 1, 0)])
    mask = (torch.arange(tokens) < lengths[:, None]).long()
    scored_values, scored_rewards = values * mask, rewards_ * mask
    expected = torch.zeros(4, tokens)
    running = torch.zeros(4)
    for t in reversed(range(tokens)):
        following = scored_values[:, t + 1] if t + 1 < tokens else torch.zeros(4)
        running = scored_rewards[:, t] + gamma * following - scored_values[:, t] + gamma * lam * running
        expected[:, t] = running * mask[:, t]
    got, returns = advantages.gae(rewards_, values, mask, gamma, lam)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(returns, (expected + scored_values) * mask, rtol=1e-5, atol=1e-5)
    assert got.dtype == values.dtype and not got[2].any()


def test_token_rewards_put_the_score_on_the_last_token_and_the_kl_on_every_one():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]])
    ref = torch.tensor([[-1.5, -2.0, -0.25], [-0.3, -0.2, 4.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    got, penalty = advantages.token_rewards(torch.tensor([2.0, -1.0]), logp, ref, mask, beta=0.1)
    torch.testing.assert_close(penalty, torch.tensor([[-0.05, 0.0, 0.025], [0.0, 0.05, 0.0]]))
    torch.testing.assert_close(got, torch.tensor([[-0.05, 0.0, 2.025], [0.0, -0.95, 0.0]]))
    got, penalty = advantages.token_rewards(torch.tensor([2.0, -1.0]), logp, None, mask, beta=0.1)
    torch.testing.assert_close(got, torch.tensor([[0.0, 0.0, 2.0], [0.0, -1.0, 0.0]]))


def test_whiten_is_trls_masked_whiten():
    x = torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    kept = x[mask.bool()]
    want = torch.zeros_like(x)
    want[mask.bool()] = (kept - kept.mean()) / kept.std()
    torch.testing.assert_close(advantages.whiten(x, mask), want, rtol=1e-5, atol=1e-6)


def rollout(trainer):
    """A rollout batch as PPO's `_generate_and_score_completions` hands it to the loss: GRPO's test
    rollout (left-padded prompts, completions cut at different lengths) with per-token
    advantages, values and returns."""
    inputs = grpo_rollout(trainer, old=False, ref=False)
    shape, device = inputs["completion_ids"].shape, inputs["completion_ids"].device
    g = torch.Generator().manual_seed(random.randrange(2**31))
    inputs.update({k: torch.randn(shape, generator=g).to(device) for k in ("advantages", "values", "returns")})
    return inputs


def plain_log_probs(model, inputs, temperature):
    """The last hidden states at the positions predicting the completion's tokens, and those
    tokens' log-probs from the materialised logits, of the unpatched model."""
    prompt_len = inputs["prompt_ids"].shape[1]
    hidden = model.model(input_ids=torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
                         attention_mask=torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
                         ).last_hidden_state[:, prompt_len - 1:-1]
    logits = model.lm_head(hidden) / temperature
    return hidden, torch.log_softmax(logits, -1).gather(-1, inputs["completion_ids"][..., None])[..., 0]


def plain_ppo_loss(trainer, inputs):
    """PPO's loss as TRL PPOv2 writes it, over the materialised logits."""
    hidden, logp = plain_log_probs(trainer.model, inputs, trainer.temperature)
    mask = inputs["completion_mask"].bool()
    ratio = torch.exp(logp - inputs["old_per_token_logps"])
    adv = inputs["advantages"]
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - trainer.epsilon_low, 1 + trainer.epsilon_high))
    vpred = trainer.value_head(hidden).squeeze(-1)
    old_v, ret, c = inputs["values"], inputs["returns"], trainer.cliprange_value
    vclipped = torch.clamp(vpred, old_v - c, old_v + c)
    vf = 0.5 * torch.maximum((vpred - ret) ** 2, (vclipped - ret) ** 2)
    return pg[mask].mean() + trainer.vf_coef * vf[mask].mean()


def test_ppo_loss_and_gradients_equal_plain_pytorch(tiny_grpo, tmp_path):
    """One rollout, two losses: the PPO trainer's (hidden states and head into
    `linear_policy_loss`, the value head's clipped loss) and PPO written out over the logits: equal
    loss and gradients of every weight, the value head's included, with some ratios and values
    clipped."""
    compare_ppo_loss(tiny_grpo, tmp_path, 1e-4)


@pytest.mark.gpu
def test_gpu_ppo_loss_and_gradients_equal_plain_pytorch(tiny_grpo, tmp_path, monkeypatch):
    """The same on the GPU with `linear_policy_loss`'s Triton kernels (fp32; TF32-level tolerance)."""
    monkeypatch.delenv("TIGON_DISABLE")
    compare_ppo_loss(tiny_grpo, tmp_path, 2e-3)


def compare_ppo_loss(tiny_grpo, tmp_path, rtol):
    root, tokenizer = tiny_grpo
    trainer = trainer_for(root, tokenizer, tmp_path, "ppo", epsilon=0.1, vf_coef=0.3, cliprange_value=0.5)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    torch.nn.init.normal_(trainer.value_head.weight, std=0.05)  # values near the rollout's: some clipped, some not
    inputs = rollout(trainer)
    params = [*trainer.model.parameters(), *trainer.value_head.parameters()]

    def grads_of(loss):
        for p in params:
            p.grad = None
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in params]

    with torch.no_grad():
        logp = plain_log_probs(trainer.model, inputs, trainer.temperature)[1]
    inputs["old_per_token_logps"] = logp + 0.3 * torch.randn(logp.shape).to(logp.device)
    theirs, their_grads = grads_of(plain_ppo_loss(trainer, inputs))
    ours, our_grads = grads_of(ppo.TigonPPOTrainer._compute_loss(trainer, trainer.model, inputs))
    assert ours.item() == pytest.approx(theirs.item(), rel=rtol / 10)
    for (name, _), mine, want in zip([*trainer.model.named_parameters(), *trainer.value_head.named_parameters()],
                                     our_grads, their_grads):
        torch.testing.assert_close(mine, want, rtol=rtol, atol=1e-6, msg=name)
    metrics = trainer._averages("train")
    assert 0 < metrics["clip_ratio/region_mean"] < 1 and 0 < metrics["value_clipfrac"] < 1


def test_rloo_fused_loss_and_gradients_equal_trls_compute_loss(tiny_grpo, tmp_path):
    """On policy (as tigon runs RLOO) TRL 1.16's `RLOOTrainer._compute_loss` over its logits and
    tigon's through `linear_policy_loss`: equal loss and gradient of every weight."""
    root, tokenizer = tiny_grpo
    trainer = trainer_for(root, tokenizer, tmp_path, "rloo", grad_accum=1)
    trainer.model.train()
    inputs = rollout(trainer)
    inputs["advantages"] = inputs["advantages"][:, 0]
    with torch.no_grad():
        logp = plain_log_probs(trainer.model, inputs, trainer.temperature)[1]
    inputs["old_logps"] = (logp * inputs["completion_mask"]).sum(1)

    def loss_and_grads(compute):
        trainer.model.zero_grad()
        loss = compute(trainer, trainer.model, inputs)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}

    theirs, their_grads = loss_and_grads(trl.RLOOTrainer._compute_loss)
    ours, our_grads = loss_and_grads(rloo.TigonRLOOTrainer._compute_loss)
    # TRL's ratio is 1 up to the fp32 rounding of the two log-prob sums; tigon's is 1 exactly.
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-4, abs=1e-7)
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


# --- the command --------------------------------------------------------------------------------

def test_a_few_rloo_steps_equal_trls_rloo_trainer(tiny_grpo, tmp_path):
    """`tigon rlhf --method rloo` against TRL's RLOOTrainer on the unpatched model, fed the same
    prompts, arguments and seed: the same completions (equal rewards and lengths) and losses at
    every step, and a KL to the reference once the policy has moved."""
    from datasets import Dataset
    from transformers import set_seed

    root, tokenizer = tiny_grpo
    (tmp_path / "letters.py").write_text(
        "def letters(prompts, completions, **kwargs):\n"
        "    return [float(sum(ch.isalpha() for ch in c[0]['content'])) for c in completions]\n")
    values = rl_values(root, "rloo", max_steps=3, reward_funcs=[f"{tmp_path}/letters.py:letters"])
    out = tmp_path / "tigon"
    assert main(["rlhf", *argv_of(values), "--output-dir", str(out)]) == 0
    ours = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert (out / "final" / "model.safetensors").is_file()

    cfg = resolve_rlhf(RLHFConfig(output_dir=str(tmp_path / "trl"), **values))
    rows, _ = grpo.prompt_rows(tokenizer, grpo.load_prompts(cfg.dataset, cfg.seed), cfg.max_length, "data")
    fns = [r.fn for r in rewards.load_rewards(cfg.reward_funcs, cfg.format_regex, cfg.max_completion_length)]
    set_seed(cfg.seed)
    trainer = trl.RLOOTrainer(model=plain_model(root / "m"), reward_funcs=fns,
                              args=rloo.trl_arguments(cfg, torch.float32, False), train_dataset=Dataset.from_list(rows),
                              processing_class=tokenizer)
    trainer.train()
    assert_same_steps(ours, trainer, 3)
    assert ours[0]["reward_std"] > 0 and ours[-1]["kl"] != 0


def test_ppo_run_writes_its_outputs_and_resumes_its_value_head(tiny_grpo, tmp_path):
    """Two steps of `tigon rlhf --method ppo` (one rollout batch, two passes): metrics with PPO's
    keys, final/ with the value head beside the model, a checkpoint whose value head --resume
    reads back (writing final/ again from it)."""
    root, _ = tiny_grpo
    out = tmp_path / "run"
    values = rl_values(root, "ppo", max_steps=2, ppo_epochs=2, save_steps=2, beta=0.1)
    assert main(["rlhf", *argv_of(values), "--output-dir", str(out)]) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2]
    assert {"loss", "reward", "kl", "value_loss", "policy_loss", "value", "entropy"} <= set(steps[0])
    assert "reward" not in steps[1]  # the second pass over the same rollouts
    from safetensors.torch import load_file

    head = load_file(str(out / "final" / ppo.VALUE_HEAD_FILE))
    assert head["weight"].shape == (1, 32) and head["weight"].abs().sum() > 0  # trained from zero
    saved = load_file(str(out / "checkpoint-2" / ppo.VALUE_HEAD_FILE))
    torch.testing.assert_close(saved["weight"], head["weight"])
    # A finished run without final/ writes it from its checkpoint: the value head read back from there.
    shutil.rmtree(out / "final")
    assert main(["rlhf", *argv_of(values), "--output-dir", str(out), "--resume"]) == 0
    torch.testing.assert_close(load_file(str(out / "final" / ppo.VALUE_HEAD_FILE))["weight"], head["weight"])


@pytest.mark.parametrize("method", ["ppo", "rloo"])
def test_builtin_default_runs_after_an_sft_stage(tmp_path, monkeypatch, caplog, method):
    """No model, no data: the built-in model after a (shortened) sft stage, on the bundled
    arithmetic prompts with the default rewards."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(builtin, "SFT_STAGE_STEPS", 2)
    monkeypatch.setattr(builtin, "DEMO_SFT", tmp_path / "no-demo" / "final")
    out = tmp_path / "run"
    argv = ["--method", method, "--max-steps", "2", "--batch-size", "8", "--num-generations", "4",
            "--max-completion-length", "4", "--samples", "1", "--max-new-tokens", "4", "--no-kernels"]
    assert main(["rlhf", "--output-dir", str(out), *argv]) == 0
    assert "rewards: builtin:exact_answer, builtin:format" in caplog.text
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2]
    assert {"loss", "reward", "rewards/exact_answer/mean", "kl", "entropy"} <= set(steps[0])
    assert (out / "final" / "model.safetensors").is_file()
    assert (out / "final" / ppo.VALUE_HEAD_FILE).is_file() == (method == "ppo")


# --- the reward model ---------------------------------------------------------------------------

def save_reward_model(path, tokenizer, labels=1):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=labels,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def test_reward_model_scores_the_chat_at_its_last_token(tiny_grpo, tmp_path):
    """Each prompt + completion written out by the reward model's chat template and scored, in
    batches, as the model scores it alone; a model of two outputs is refused in one line."""
    _, tokenizer = tiny_grpo
    save_reward_model(tmp_path / "rm", tokenizer)
    reward = model_reward(str(tmp_path / "rm"))
    prompts = [[{"role": "user", "content": f"What is {i} plus 1?"}] for i in range(20)]
    completions = [[{"role": "assistant", "content": "It is " + "1" * (i % 5 + 1) + "."}] for i in range(20)]
    got = reward.fn(prompts=prompts, completions=completions)
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    for p, c, score in zip(prompts, completions, got):
        text = tokenizer.apply_chat_template(p + c, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            assert score == pytest.approx(model(**ids).logits[0, 0].item(), rel=1e-4, abs=1e-5)
    assert len(set(got)) > 1
    save_reward_model(tmp_path / "cls", tokenizer, labels=2)
    with pytest.raises(SFTError, match="not a reward model"):
        model_reward(str(tmp_path / "cls"))


# --- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--method", "ppo", "--gamma", "1.5"], "--gamma must be in [0, 1], got 1.5"),
    (["--method", "ppo", "--lam", "-0.1"], "--lam must be in [0, 1], got -0.1"),
    (["--method", "ppo", "--vf-coef", "-1"], "--vf-coef must be >= 0, got -1.0"),
    (["--method", "ppo", "--cliprange-value", "0"], "--cliprange-value must be > 0, got 0.0"),
    (["--method", "ppo", "--ppo-epochs", "0"], "--ppo-epochs must be >= 1, got 0"),
    (["--method", "ppo", "--mini-batches", "0"], "--mini-batches must be >= 1, got 0"),
    (["--method", "ppo", "--reward-model", "{tmp}/nothing"], "--reward-model {tmp}/nothing: not a model directory"),
    (["--method", "ppo", "--num-generations", "1"], "--num-generations must be >= 2"),
    (["--method", "rloo", "--beta", "-1"], "--beta must be >= 0, got -1.0"),
    (["--method", "grpo", "--gamma", "0.9"], "--gamma: only for --method ppo, not grpo"),
    (["--method", "rloo", "--ppo-epochs", "2"], "--ppo-epochs: only for --method ppo, not rloo"),
    (["--method", "ppo", "--loss-type", "bnpo"], "--loss-type: only for --method grpo / dpo, not ppo"),
    (["--method", "ppo", "--epsilon-high", "0.3"], "--epsilon-high: only for --method grpo / rloo, not ppo"),
])
def test_bad_ppo_and_rloo_flags_are_one_line_and_write_nothing(tmp_path, capsys, argv, message):
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["rlhf", "--output-dir", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tigon rlhf: error: {message.format(tmp=tmp_path)}"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_builtin_default_raises_the_reward(tmp_path, monkeypatch):
    """Issue 41's bar for PPO, as the README states it: `tigon rlhf --method ppo` with no model and
    no data (the built-in model after its sft stage, the bundled sums, the default rewards) ends
    its default steps with a higher mean reward than it began with."""
    monkeypatch.setattr(builtin, "DEMO_SFT", tmp_path / "no-demo" / "final")
    out = tmp_path / "run"
    assert main(["rlhf", "--method", "ppo", "--output-dir", str(out), "--no-kernels"]) == 0
    rewards = [r["reward"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward" in r]
    quarter = max(1, len(rewards) // 4)
    first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
    assert last > first + 0.05, rewards
