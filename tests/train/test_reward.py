"""`tigon rlhf --method rm` and the sequence classifier under it: the Bradley-Terry loss against
TRL's RewardTrainer's own compute_loss on the same model and batch, the head read at the last
token alone against transformers' classifier, patched against unpatched, a run whose eval
accuracy rises, the reward model as a reward of `tigon rlhf --method grpo`, and bad rows."""

import json
import random

import pytest
import torch

import tigon
from tests.train.fused_helpers import argv_of, one_thread_and_references
from tigon.cli import main
from tigon.train import classify, preference, reward, rlhf, tiny
from tigon.train.config import RLHFConfig, resolve_rlhf
from tigon.train.data import load_samples
from tigon.train.modeling import classifier_options
from tigon.train.template import ensure_chat_template

trl = pytest.importorskip("trl")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_thread_and_references(""):
        yield


@pytest.fixture(scope="module")
def tokenizer():
    tok = tiny.build_tokenizer(load_samples([str(tiny.BUNDLED_DATASET)], seed=0))
    ensure_chat_template(tok)
    return tok


def tiny_classifier(tokenizer, labels, seed=0, width=32):
    """A two-layer random Llama sequence classifier of `labels`, fp32, unpatched."""
    model = tiny.build_model(tokenizer, seed, classifier_options(labels), hidden_size=width,
                             intermediate_size=2 * width, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1)
    model.config.use_cache = False
    return model


def pairs_file(path, n, margins=False, seed=0):
    rows = [json.loads(line) for line in rlhf.BUNDLED_PREFERENCES.read_text().splitlines()]
    rows = random.Random(seed).sample(rows, n)
    if margins:
        rows = [{**r, "margin": round(random.Random(i).uniform(0, 2), 3)} for i, r in enumerate(rows)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def reward_batch(tokenizer, tmp_path, n=4, margins=True):
    cfg = resolve_rlhf(RLHFConfig(method="rm", output_dir=str(tmp_path / "out")))
    pairs = preference.load_preferences([str(pairs_file(tmp_path / "p.jsonl", n, margins))], 0, "rm")
    rows = reward.reward_rows(tokenizer, pairs, cfg, "data")
    return cfg, rows, reward.RewardCollator(tokenizer.pad_token_id)(rows)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("margins,center", [(False, None), (True, None), (True, 0.01)])
def test_loss_and_gradients_equal_trls_reward_trainer(tokenizer, tmp_path, margins, center):
    """tigon's compute_loss (the head at the last token, via the hidden states) against TRL's
    RewardTrainer.compute_loss itself (the model's own forward) on one model and batch."""
    from datasets import Dataset

    model = tiny_classifier(tokenizer, [reward.REWARD_LABEL])
    cfg, rows, batch = reward_batch(tokenizer, tmp_path, margins=margins)
    cfg = resolve_rlhf(RLHFConfig(method="rm", output_dir=str(tmp_path / "out"), center_rewards=center or 0.0))
    args = reward.trl_arguments(cfg, torch.float32, False)
    trainer = reward.TigonRewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                                        processing_class=tokenizer,
                                        data_collator=reward.RewardCollator(tokenizer.pad_token_id))
    assert trainer.args.center_rewards_coefficient == center
    batch.pop("num_tokens")
    assert "attention_mask" in batch  # pairs of several lengths: padded rows
    theirs = trl.RewardTrainer.compute_loss(trainer, model, dict(batch))
    theirs.backward()
    want = grads(model)
    model.zero_grad()
    ours = trainer.compute_loss(model, dict(batch))
    ours.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    got = grads(model)
    assert got.keys() == want.keys() and "score.weight" in got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    # And the formula against its definition, so a change in TRL's is seen too.
    chosen, rejected = model(**{k: v for k, v in batch.items() if k != "margin"}).logits.squeeze(-1).chunk(2)
    diff = chosen - rejected - (batch["margin"] if margins else 0)
    expected = torch.log1p(torch.exp(-diff)).mean() + (center or 0) * ((chosen + rejected) ** 2).mean()
    assert ours.item() == pytest.approx(expected.item(), rel=1e-5)


def test_last_token_head_equals_transformers_classifier_patched_and_not(tokenizer, monkeypatch):
    """On a tiny random Llama classifier, with rows padded on the right and on the left: the
    logits, loss and every gradient of transformers' forward are the same patched by tigon as
    unpatched, and tigon's head at the last token alone gives the same logits and gradients."""
    monkeypatch.setenv("TIGON_DISABLE", "")
    torch.manual_seed(0)
    model = tiny_classifier(tokenizer, ["a", "b", "c"], seed=3)
    pad = tokenizer.pad_token_id
    ids = torch.randint(5, 900, (4, 11))
    ids[0, 7:] = pad  # right padding
    ids[1, :3] = pad  # left padding
    mask = (ids != pad).long()
    labels = torch.tensor([0, 2, 1, 2])

    def hf_step():
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        return out.logits.detach(), out.loss.detach(), grads(model)

    plain_logits, plain_loss, plain_grads = hf_step()
    patched = tigon.patch(model)
    assert patched.layers == 2 and {"rms_norm", "swiglu", "rope", "add_rms_norm"} <= set(patched.applied)
    logits, loss, patched_grads = hf_step()
    torch.testing.assert_close(logits, plain_logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-4, atol=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(patched_grads[name], grad, rtol=1e-3, atol=1e-5, msg=name)
    tigon.unpatch(model)

    tigon.train.heads.add_hidden_output(model)
    model.zero_grad()
    pooled = classify.pooled_scores(model, ids, mask, pad)
    torch.nn.functional.cross_entropy(pooled, labels).backward()
    torch.testing.assert_close(pooled.detach(), plain_logits, rtol=1e-5, atol=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-4, atol=1e-6, msg=name)
    tigon.unpatch(model)


def test_rm_run_eval_accuracy_rises_and_grpo_scores_with_it(tokenizer, tmp_path, capsys):
    """A reward model trained on 64 pairs (evaluated on 32 of them, so that a model that learns
    shows it in a few CPU steps) ends with a higher eval accuracy and lower eval loss than its
    first evaluation; GRPO then logs its score as a reward, which is the model's own."""
    model_dir = tmp_path / "m"
    tiny_classifier(tokenizer, ["x", "y"], seed=1).save_pretrained(model_dir)  # a user's model: any head
    tokenizer.save_pretrained(model_dir)
    data = pairs_file(tmp_path / "pairs.jsonl", 64)
    values = dict(method="rm", model=str(model_dir), dataset=[str(data)], eval_dataset=[f"{data}#32"],
                  kernels=False, batch_size=8, lr=3e-3, epochs=6.0, save_steps=4, samples=0, tuner="full")
    out = tmp_path / "rm"
    assert main(["rlhf", *argv_of(values), "--output-dir", str(out)]) == 0
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
             if "eval_loss" in line]
    assert len(evals) >= 3
    assert evals[-1]["eval_rewards/accuracies"] > evals[0]["eval_rewards/accuracies"]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["num_labels"] == 1 if "num_labels" in config else len(config["id2label"]) == 1
    assert config["architectures"] == ["LlamaForSequenceClassification"]

    fn = reward.model_reward(str(out / "final")).fn
    prompts = [[{"role": "user", "content": "What is 2 plus 3?"}]] * 2
    completions = [[{"role": "assistant", "content": "2 plus 3 is 5."}], [{"role": "assistant", "content": "No."}]]
    scores = fn(prompts=prompts, completions=completions)
    from tigon.train.infer import load_for_inference

    rm, rm_tokenizer = load_for_inference(str(out / "final"), torch.float32)
    text = rm_tokenizer.apply_chat_template(prompts[0] + completions[0], tokenize=False)
    alone = rm(**rm_tokenizer(text, add_special_tokens=False, return_tensors="pt")).logits[0, 0].item()
    assert scores[0] == pytest.approx(alone, rel=1e-5) and scores[0] != scores[1]

    capsys.readouterr()
    assert main(["infer", str(out / "final"), "--prompt", "2 plus 3 is 5."]) == 0
    assert capsys.readouterr().out.startswith("reward\t")

    grpo_dir = tmp_path / "grpo"
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(line + "\n" for line in
                                    rlhf.grpo.BUNDLED_PROMPTS.read_text().splitlines()[:4]))
    grpo = dict(method="grpo", model=str(tmp_path / "policy"), dataset=[str(prompts_file)], kernels=False,
                batch_size=4, num_generations=4, max_completion_length=4, max_steps=2, save_steps=0, samples=0,
                tuner="full", reward_model=str(out / "final"))
    from tests.train.fused_helpers import save_tiny

    save_tiny(tmp_path / "policy", tokenizer)
    assert main(["rlhf", *argv_of(grpo), "--output-dir", str(grpo_dir)]) == 0
    logged = [json.loads(line) for line in (grpo_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("rewards/reward_model/mean" in r for r in logged)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("rows,extra,message", [
    ([{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "a", "rejected": "a"}], [],
     "{f} line 2: the chosen and rejected answers are the same: nothing to prefer"),
    ([{"prompt": "q", "chosen": "a", "rejected": "b", "margin": "lots"}], [],
     "{f} line 1: margin must be a finite number, got 'lots'"),
    ([{"prompt": "q", "chosen": "a", "rejected": "b", "margin": 1}, {"prompt": "q", "chosen": "a", "rejected": "c"}],
     [], "{f} line 2: no margin, where {f} line 1 has one"),
    ([{"prompt": "q", "chosen": "a", "rejected": "b"}], ["--center-rewards", "-1"], "--center-rewards must be >= 0"),
    ([{"prompt": "q", "chosen": "a", "rejected": "b"}], ["--reward-model", "x"],
     "--reward-model: only for --method grpo / ppo, not rm"),
])
def test_bad_rm_input_is_one_line_and_writes_nothing(tmp_path, capsys, rows, extra, message):
    f = write_rows(tmp_path / "bad.jsonl", rows)
    assert main(["rlhf", "--method", "rm", "--dataset", f, "--output-dir", str(tmp_path / "out"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tigon rlhf: error: {message.format(f=f)}"), err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_grpo_refuses_a_reward_model_that_is_not_one(tmp_path, capsys, tokenizer):
    tiny_classifier(tokenizer, ["x", "y"]).save_pretrained(tmp_path / "cls")
    tokenizer.save_pretrained(tmp_path / "cls")
    capsys.readouterr()
    assert main(["rlhf", "--method", "grpo", "--reward-model", str(tmp_path / "cls"), "--output-dir",
                 str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "not a reward model (a sequence classifier with one output" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.gpu
def test_gpu_bf16_reward_step_patched_equals_trls_unpatched(tokenizer, tmp_path, monkeypatch):
    """On the GPU in bf16 with LoRA: tigon's reward step on the patched model (Triton kernels)
    against TRL's RewardTrainer.compute_loss on an unpatched copy; loss and LoRA / head gradients
    within bf16 rounding."""
    import copy

    from datasets import Dataset
    from peft import get_peft_model

    from tigon.train.modeling import lora_config

    monkeypatch.setenv("TIGON_DISABLE", "")
    torch.manual_seed(0)
    base = tiny_classifier(tokenizer, [reward.REWARD_LABEL], width=256).to("cuda")
    cfg, rows, batch = reward_batch(tokenizer, tmp_path, n=8)
    lora = lora_config(resolve_rlhf(RLHFConfig(method="rm", model="m", output_dir=str(tmp_path / "o"))), "SEQ_CLS")
    # TRL's step in float32 is the oracle; TRL's in bf16 says how far bf16 rounding alone goes.
    oracle_model = get_peft_model(copy.deepcopy(base), copy.deepcopy(lora))
    theirs_model = get_peft_model(copy.deepcopy(base).bfloat16(), copy.deepcopy(lora))
    ours_model = get_peft_model(base.bfloat16(), lora)
    for name, param in oracle_model.named_parameters():  # B starts at zero: give the adapters something to carry
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02, generator=torch.Generator("cuda").manual_seed(hash(name) % 2**31))
    for model in (theirs_model, ours_model):
        model.load_state_dict({k: v.to(torch.bfloat16) for k, v in oracle_model.state_dict().items()})
    tigon.patch(ours_model)
    args = reward.trl_arguments(resolve_rlhf(RLHFConfig(method="rm", output_dir=str(tmp_path / "o"))),
                                torch.bfloat16, False)
    batch = {k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in batch.items() if k != "num_tokens"}
    results = []
    for model, loss_of in ((oracle_model, trl.RewardTrainer.compute_loss), (theirs_model, trl.RewardTrainer.compute_loss),
                           (ours_model, None)):
        trainer = reward.TigonRewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                                            processing_class=tokenizer,
                                            data_collator=reward.RewardCollator(tokenizer.pad_token_id))
        loss = (loss_of or type(trainer).compute_loss)(trainer, model, dict(batch))
        loss.backward()
        results.append((loss.detach().float(), grads(model)))
    (exact, oracle), (theirs, want), (ours, got) = results
    torch.testing.assert_close(ours, exact, rtol=2e-2, atol=2e-2)
    # Each gradient's error as a whole (its norm): one element's error is a coin toss of bf16 rounding
    # where the gradient's terms cancel, as large in TRL's own bf16 step as in ours.
    for name in oracle:
        reference = oracle[name].float()
        bf16_error = (want[name].float() - reference).norm()
        assert (got[name].float() - reference).norm() <= 2 * bf16_error + 1e-3 * reference.norm(), name


def test_builtin_default_trains_a_reward_model_after_an_sft_stage(tmp_path, monkeypatch, caplog):
    """`tigon rlhf --method rm` alone: the built-in model after its sft stage (shortened here) with a
    one-output head, on the bundled pairs with a tenth held out, evaluated at the end. (On PyTorch's
    ops: interpreted, the kernels take a minute here; the patched head and loss are compared with
    transformers' and TRL's above.)"""
    from tigon.train import builtin

    monkeypatch.setattr(builtin, "SFT_STAGE_STEPS", 2)
    monkeypatch.setattr(builtin, "DEMO_SFT", tmp_path / "no-demo" / "final")  # not a `make demo` run's
    out = tmp_path / "out"
    with caplog.at_level("INFO", logger="tigon.train"):
        assert main(["rlhf", "--method", "rm", "--max-steps", "3", "--no-kernels", "--output-dir", str(out)]) == 0
    assert "reward model: the built-in model, fine-tuned first" in caplog.text
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line]
    assert len(evals) == 1 and 0 <= evals[0]["eval_rewards/accuracies"] <= 1
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["id2label"] == {"0": "reward"}
    assert config["pad_token_id"] is not None


def test_cuda_graphs_is_refused_for_rm(monkeypatch):
    from tigon.train.config import SFTError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the method is what is refused
    with pytest.raises(SFTError, match="^--cuda-graphs: not for --method rm"):
        resolve_rlhf(RLHFConfig(cuda_graphs=True, method="rm"))
