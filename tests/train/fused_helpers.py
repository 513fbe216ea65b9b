"""What the tests of the fused-loss trainers (`tigon rlhf`'s methods) share: one thread and the
fused op's PyTorch reference, tiny saved models, command lines from settings, TRL's plain model."""

import contextlib
import random

import pytest
import torch

from tigon.train import tiny


@contextlib.contextmanager
def one_thread_and_references(ops: str):
    """One thread (a tiny model gains nothing from threads; a busy machine loses a lot) and the ops
    `ops` (TIGON_DISABLE's list) on their PyTorch references: in Triton's interpreter one step of
    a fused loss takes ~25 s, and the kernels are checked against the references in tests/ops."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIGON_DISABLE", ops)
        yield
    torch.set_num_threads(threads)


def save_tiny(path, tokenizer, width=32):
    """A randomly initialised two-layer tiny Llama of hidden size `width`, saved with `tokenizer`."""
    tiny.build_model(tokenizer, random.randrange(1000), hidden_size=width, intermediate_size=2 * width,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1).save_pretrained(path)
    tokenizer.save_pretrained(path)


def argv_of(values):
    """The command line setting the RLHFConfig fields `values`."""
    argv = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, *map(str, value if isinstance(value, list) else [value])]
    return argv


def plain_model(path):
    """The saved model as TRL's own trainers get it: fp32, unpatched, no KV cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    return model


def assert_same_steps(ours, trainer, steps):
    """tigon's metrics.jsonl records `ours` against the log of TRL's online `trainer` after its
    train(): the same completions (rewards, their spread, lengths), losses and KL, step by step."""
    theirs = [r for r in trainer.state.log_history if "loss" in r]
    assert [r["step"] for r in ours] == list(range(1, steps + 1)) and len(theirs) == steps
    for a, b in zip(ours, theirs):
        for key in ("reward", "reward_std", "completions/mean_length"):
            assert a[key] == pytest.approx(b[key], rel=1e-6), (a["step"], key)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6), a["step"]
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-3, abs=1e-6), a["step"]
