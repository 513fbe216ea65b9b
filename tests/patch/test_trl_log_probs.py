"""Switch trl_log_probs: TRL's fused LM head (the per-token log-probs of its DPO, KTO and GRPO
trainers) on tigon's linear_log_probs, with TRL's own function's outputs and gradients; undone by
unpatch; never planned, and TRL never imported, for a process that has not imported TRL."""

import sys

import pytest
import torch

import tigon
import tigon.functional
from tests.helpers import assert_close
from tigon.patch import SWITCHES, trl_head
from tigon.train import tiny
from tigon.train.data import Sample

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")
trl_utils = pytest.importorskip("trl.trainer.utils")
TRLS = trl_utils._ChunkedLogProbFunction
ONLY_THE_HOOK = {name: name == "trl_log_probs" for name in SWITCHES}


@pytest.fixture(autouse=True)
def clean_patches():
    yield
    tigon.unpatch()


@pytest.fixture
def counted(monkeypatch):
    """Calls of tigon's op and of TRL's own function (by their names, as the trainers reach them)."""
    calls = {"tigon": 0, "trl": 0}
    op, trls = tigon.functional.linear_log_probs, TRLS.apply

    def ours(*args, **kwargs):
        calls["tigon"] += 1
        return op(*args, **kwargs)

    def theirs(*args, **kwargs):
        calls["trl"] += 1
        return trls(*args, **kwargs)

    monkeypatch.setattr(tigon.functional, "linear_log_probs", ours)
    monkeypatch.setattr(TRLS, "apply", theirs)
    return calls


def _inputs(n, hidden, vocab, dtype=torch.float32, bias=True):
    h = torch.randn(n, hidden).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden) * 2 * hidden**-0.5).to(dtype).requires_grad_()
    b = (0.5 * torch.randn(vocab)).to(dtype).requires_grad_() if bias else None
    return h, w, b, torch.randint(0, vocab, (n,))


OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@pytest.mark.parametrize("dtype,logit_scale,bias", [(torch.float32, 1.0, True), (torch.float16, 0.25, False)])
def test_the_stand_in_gives_trls_outputs_and_gradients(poison_outputs, counted, dtype, logit_scale, bias):
    """Every field TRL asks for, and the gradients of log-probs and entropy, as TRL's function
    gives them (its torch path on the CPU), with a temperature and a logit scale."""
    h, w, b, targets = _inputs(23, 19, 101, dtype, bias)
    with torch.no_grad():  # some targets the argmax, so that is_top1 is both
        targets[::3] = (h.float() @ w.float().T).argmax(-1)[::3]
    ours = [t.detach().clone().requires_grad_() if t is not None else None for t in (h, w, b)]
    args = (targets, 0.7, 32, None, logit_scale, OUTPUTS)
    got = trl_head.chunked_log_probs(TRLS).apply(*ours, *args)
    want = TRLS.apply(h, w, b, *args)
    assert counted == {"tigon": 1, "trl": 1}
    for name, g, e in zip(OUTPUTS, got, want):
        if name == "is_top1":
            assert torch.equal(g, e) and 0 < g.sum() < len(g)
        else:
            assert_close(g, e, name=name)
    grads = [torch.randn(23), torch.randn(23)]
    torch.autograd.backward(got[:2], grads)
    torch.autograd.backward(want[:2], grads)
    for i, (a, c) in enumerate(zip(ours, (h, w, b))):
        if a is not None:
            assert_close(a.grad, c.grad, name=f"grad {i}")
    only = trl_head.chunked_log_probs(TRLS).apply(h.detach(), w.detach(), b, targets, 1.0, 32)
    assert only[0].shape == (23,) and all(x is None for x in only[1:])


def test_a_softcap_stays_on_trls_path(counted, caplog, monkeypatch):
    monkeypatch.setattr(trl_head, "_said", set())
    h, w, b, targets = _inputs(5, 8, 37)
    out = trl_head.chunked_log_probs(TRLS).apply(h, w, b, targets, 1.0, 32, 30.0, 1.0, ("log_probs",))
    assert counted == {"tigon": 0, "trl": 1} and out[0].shape == (5,)
    assert "final softcap" in caplog.text


def test_patch_swaps_trls_function_and_unpatch_restores_it(counted):
    model = tiny_model(seed=0)
    assert "trl_log_probs" in tigon.patch(model, **ONLY_THE_HOOK).applied
    assert trl_utils._ChunkedLogProbFunction is not TRLS
    other = tiny_model(seed=1)
    tigon.patch(other)  # a second holder of the same swap
    tigon.unpatch(model)
    assert trl_utils._ChunkedLogProbFunction is not TRLS
    tigon.unpatch(other)
    assert trl_utils._ChunkedLogProbFunction is TRLS
    assert "trl_log_probs" not in tigon.patch(model, trl_log_probs=False).applied
    assert trl_utils._ChunkedLogProbFunction is TRLS
    assert "trl_log_probs" not in tigon.patch("llama").applied  # a model instance's only
    assert trl_utils._ChunkedLogProbFunction is TRLS


def test_a_patched_model_collected_without_unpatch_gives_trls_function_back_at_the_next_call(counted):
    import gc

    model = tiny_model(seed=0)
    tigon.patch(model, **ONLY_THE_HOOK)
    assert trl_utils._ChunkedLogProbFunction is not TRLS
    del model
    gc.collect()
    tigon.unpatch("llama")  # any patch or unpatch call; the collector itself swaps nothing back mid-step
    assert trl_utils._ChunkedLogProbFunction is TRLS


def test_without_trl_nothing_is_planned_and_trl_is_not_imported(monkeypatch):
    """A process that has not imported TRL: patching neither plans the swap nor imports TRL."""
    for name in [m for m in sys.modules if m.split(".")[0] == "trl"]:
        monkeypatch.delitem(sys.modules, name)
    assert "trl_log_probs" not in tigon.patch(tiny_model(seed=0)).applied
    assert not [m for m in sys.modules if m.split(".")[0] == "trl"]
    assert trl_utils._ChunkedLogProbFunction is TRLS


# --- TRL's trainers, patched and not ------------------------------------------------------------

TEXTS = ["What is 2+3?", "Name a colour.", "Say hi.", "Count to three.", "What is the capital of France?",
         "One, two, three.", "Paris is the capital of France.", "Red is a colour.", "Hi!", "It is 5."]


def tokenizer():
    return tiny.build_tokenizer([Sample(where=f"row {i}", text=t) for i, t in enumerate(TEXTS)])


def tiny_model(seed=0, tok=None):
    return tiny.build_model(tok or tokenizer(), seed, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny model on disk (the trainers load their reference models from its path) and its tokenizer."""
    path = tmp_path_factory.mktemp("trl") / "m"
    tok = tokenizer()
    tiny_model(0, tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path, tok


def _load(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    return model


def _common(out):
    # SGD: Adam would blow up the rounding differences of gradients that are ~0 into whole steps.
    return dict(output_dir=str(out), max_steps=3, per_device_train_batch_size=4, learning_rate=0.5, optim="sgd",
                logging_steps=1, report_to=[], use_cpu=True, seed=0, data_seed=0, save_strategy="no", dataloader_num_workers=0,
                bf16=False, fp16=False, disable_tqdm=True)


def _dpo(model, tok, out):
    from datasets import Dataset

    rows = [{"prompt": [{"role": "user", "content": TEXTS[i]}], "chosen": [{"role": "assistant", "content": TEXTS[i + 5]}],
             "rejected": [{"role": "assistant", "content": TEXTS[9 - i]}]} for i in range(5)] * 2
    args = trl.DPOConfig(**_common(out), beta=0.2, max_length=48, gradient_checkpointing=False, use_weighting=True)
    return trl.DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)


def _kto(model, tok, out):
    from datasets import Dataset

    rows = [{"prompt": [{"role": "user", "content": TEXTS[i % 5]}],
             "completion": [{"role": "assistant", "content": TEXTS[5 + (i * 3) % 5]}], "label": i % 3 != 0}
            for i in range(12)]
    args = trl.KTOConfig(**_common(out), beta=0.2, max_length=48, gradient_checkpointing=False)
    return trl.KTOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)


def _grpo(model, tok, out, monkeypatch):
    """GRPO on fixed completions: generation replaced by seeded token draws, the same in both runs."""
    from datasets import Dataset

    rng = torch.Generator().manual_seed(0)

    def completions(self, prompt_ids, *args, **kwargs):
        lengths = torch.randint(2, 7, (len(prompt_ids),), generator=rng)
        ids = [torch.randint(3, len(tok), (int(n),), generator=rng).tolist() for n in lengths]
        return ids, None

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn", completions)

    def reward(prompts, completions, completion_ids, **kwargs):
        return [float(sum(i % 7 for i in ids)) / (1 + len(ids)) for ids in completion_ids]

    rows = [{"prompt": [{"role": "user", "content": t}]} for t in TEXTS[:4]] * 3
    # num_iterations=2: the second step of each generation scores its old log-probs too.
    args = trl.GRPOConfig(**{**_common(out), "max_steps": 2}, num_generations=2, max_completion_length=6, beta=0.05,
                          num_iterations=2, loss_type="grpo", entropy_coef=0.01, gradient_checkpointing=False)
    return trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                           processing_class=tok)


def _run(make, model, patched):
    """(per-step losses and gradient norms, the trained weights) of the trainer `make` builds
    on `model`, patched first (as ``DPOTrainer(model=tigon.patch(model))``) or not."""
    if patched:
        tigon.patch(model, **ONLY_THE_HOOK)
    trainer = make(model)
    trainer.train()
    tigon.unpatch(model)
    logs = [(r["loss"], r["grad_norm"]) for r in trainer.state.log_history if "loss" in r]
    return logs, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


# The op's kernels run in Triton's interpreter for GRPO only (~15 s more for each trainer; the
# stand-in's kernels are checked against TRL's function above): DPO and KTO run its reference.
@pytest.mark.parametrize("kind, kernels", [("dpo", False), ("kto", False), ("grpo", True)])
def test_trls_trainers_take_the_same_steps_on_tigons_log_probs(saved, tmp_path, monkeypatch, counted, kind, kernels):
    """DPO (log-probs, entropy, mean logits, top-1, log sum p^2 for its WPO weights), KTO and
    GRPO (the policy with entropy and its gradient, the old and the reference log-probs without
    gradient), a few steps, patched (only this switch) and not: the same losses, gradient norms
    and weights, tigon's op running instead of TRL's function."""
    from transformers import set_seed

    if not kernels:
        monkeypatch.setenv("TIGON_DISABLE", "linear_log_probs")
    path, tok = saved
    makers = {"dpo": _dpo, "kto": _kto, "grpo": lambda model, tok, out: _grpo(model, tok, out, monkeypatch)}
    runs = []
    for patched in (True, False):
        set_seed(0)
        before = dict(counted)
        runs.append(_run(lambda model: makers[kind](model, tok, tmp_path / str(patched)), _load(path), patched))
        ran = {k: counted[k] - before[k] for k in counted}
        assert (ran["tigon"] > 0 and ran["trl"] == 0) if patched else (ran["tigon"] == 0 and ran["trl"] > 0), ran
    (ours, our_weights), (theirs, their_weights) = runs
    assert len(ours) == len(theirs) == (2 if kind == "grpo" else 3)
    for step, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(ours, theirs)):
        assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6), step
        assert norm == pytest.approx(want_norm, rel=1e-4, abs=1e-6), step
    assert our_weights.keys() == their_weights.keys()
    for name, value in our_weights.items():
        torch.testing.assert_close(value, their_weights[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
