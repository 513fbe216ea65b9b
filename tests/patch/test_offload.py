"""Activation offload: the checkpointed hidden states leave and come back bit for bit."""

from __future__ import annotations

import pytest
import torch

import tigon
from tests.helpers import assert_close, record_offload_sessions
from tests.patch.tiny import batch, tiny_model
from tigon.patch import offload
from tigon.train.config import SFTError, SFTConfig, resolve
from tigon.train.modeling import apply_kernels


@pytest.fixture
def sessions(monkeypatch):
    """Every ActivationOffload the patched forwards open, to see what they moved."""
    return record_offload_sessions(monkeypatch)


def _loss_and_grads(model, ids, mask, labels):
    model.zero_grad()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, want):
    got_loss, got_grads = got
    want_loss, want_grads = want
    assert torch.equal(got_loss, want_loss), (got_loss, want_loss)
    assert want_grads and got_grads.keys() == want_grads.keys()
    for name in want_grads:
        assert torch.equal(got_grads[name], want_grads[name]), name


@pytest.mark.parametrize("model_type, reentrant", [("llama", False), ("llama", True), ("qwen3", False), ("gemma2", False)])
def test_offload_same_loss_and_grads(model_type, reentrant, sessions):
    model = tiny_model(model_type).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        model.enable_input_require_grads()
    ids, mask, labels = batch(seed=3, rows=2, cols=11)
    tigon.patch(model)
    want = _loss_and_grads(model, ids, mask, labels)
    assert not sessions
    applied = tigon.patch(model, offload_activations=True).applied
    assert "offload_activations" in applied and "linear_cross_entropy" in applied
    got = _loss_and_grads(model, ids, mask, labels)
    _assert_same(got, want)
    (session,) = sessions
    # Every layer's checkpointed input went out (plus what the head saves of the last hidden state).
    assert session.offloaded >= model.config.num_hidden_layers
    tigon.unpatch(model)
    assert all("forward" not in vars(m) for m in model.modules())


def test_offload_off_without_checkpointing_or_in_eval(sessions):
    model = tiny_model("llama").train()
    ids, mask, labels = batch(seed=4)
    tigon.patch(model, offload_activations=True)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    model.gradient_checkpointing_enable()
    model.eval()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert not sessions
    tigon.unpatch(model)


def test_offload_and_tiled_with_peft_lora(sessions):
    from peft import LoraConfig, get_peft_model

    base = tiny_model("mistral").train()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, p in model.named_parameters():  # B starts at zero: make the adapters matter
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    ids, mask, labels = batch(seed=6, rows=2, cols=37)  # 74 tokens > width 64: the MLP tiles
    tigon.patch(model)
    want = _loss_and_grads(model, ids, mask, labels)
    tigon.patch(model, offload_activations=True, tiled_mlp=True)
    got_loss, got_grads = _loss_and_grads(model, ids, mask, labels)
    tigon.unpatch(model)
    assert sessions[0].offloaded >= 2
    # The MLP's weight gradients are sums over chunks: equal up to rounding.
    assert_close(got_loss, want[0], name="loss")
    assert got_grads.keys() == want[1].keys()
    for name in want[1]:
        assert_close(got_grads[name], want[1][name], name=name)


def test_class_patch_and_unpatch():
    from transformers.models.llama import modeling_llama as ml

    original = ml.LlamaForCausalLM.forward
    try:
        applied = tigon.patch("llama", offload_activations=True, linear_cross_entropy=False).applied
        assert applied == ("rms_norm", "rope", "swiglu", "add_rms_norm", "qkv_group", "offload_activations")
        wrapped = ml.LlamaForCausalLM.forward
        assert wrapped is not original
        # Patching again installs the identical function (stable for torch.compile).
        tigon.patch("llama", offload_activations=True, linear_cross_entropy=False)
        assert ml.LlamaForCausalLM.forward is wrapped
    finally:
        tigon.unpatch("llama")
    assert ml.LlamaForCausalLM.forward is original


def test_activation_offload_unit():
    """Saved tensors shaped like the hidden states go out and come back in reverse order, others
    stay; gradients are unchanged, and a second backward through a retained graph refetches."""
    hidden, tokens = 6, 10
    x = torch.randn(2, 5, hidden, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(hidden, hidden, dtype=torch.float64, requires_grad=True)
    with offload.ActivationOffload(hidden, tokens) as session:
        h = x
        for _ in range(3):
            h = torch.tanh(h @ weight)
        loss = (h * h).sum()
    assert session.offloaded >= 3 and session.held == session.offloaded
    grads = torch.autograd.grad(loss, [x, weight], retain_graph=True)
    assert session.held == session.offloaded
    again = torch.autograd.grad(loss, [x, weight])
    h = x
    for _ in range(3):
        h = torch.tanh(h @ weight)
    want = torch.autograd.grad((h * h).sum(), [x, weight])
    for g, a, w in zip(grads, again, want):
        assert torch.equal(g, w) and torch.equal(a, w)
    # Released with the graph, though `loss` (and so the graph's nodes) is still referenced: the
    # next step's forward must find the pinned buffers back in the cache, not allocate anew.
    assert session.held == 0 and session.offloaded >= 3
    with pytest.raises(ValueError, match="hidden_size and tokens"):
        offload.ActivationOffload(0, 4)


def test_sft_flags():
    cfg = resolve(SFTConfig(offload_activations=True, tiled_mlp=True, gradient_checkpointing=True))
    assert cfg.offload_activations and cfg.tiled_mlp
    with pytest.raises(SFTError, match="--offload-activations offloads what gradient checkpointing keeps"):
        resolve(SFTConfig(offload_activations=True))
    with pytest.raises(SFTError, match="--tiled-mlp: applied by tigon.patch"):
        resolve(SFTConfig(tiled_mlp=True, kernels=False))
    model = tiny_model("llama")
    try:
        line = apply_kernels(model, SFTConfig(offload_activations=True, tiled_mlp=True, kernels_off=["rope"]))
        assert "tiled_mlp" in line and "offload_activations" in line and "rope" not in line
    finally:
        tigon.unpatch(model)


def test_sft_command_line_flags():
    import argparse

    from tigon.train.config import add_sft_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_sft_arguments(parser)
    cfg, given = config_from_args(parser.parse_args(["--offload-activations", "--tiled-mlp", "--gradient-checkpointing"]))
    assert cfg.offload_activations and cfg.tiled_mlp and {"offload_activations", "tiled_mlp"} <= given


@pytest.mark.gpu
def test_offload_bf16_gpu_exact_and_saves_memory():
    """On the GPU (pinned memory, side stream, prefetch): the same loss and gradients bit for bit,
    and the checkpointed hidden states no longer on the device."""
    model = tiny_model(
        "llama", device="cuda", dtype=torch.bfloat16, hidden_size=1024, intermediate_size=2816,
        num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=8192,
    ).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(3, 1000, (1, 8192), device="cuda")
    mask = torch.ones_like(ids)

    def step():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = _loss_and_grads(model, ids, mask, ids)
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - base

    tigon.patch(model)
    want, plain_peak = step()
    again, _ = step()
    tigon.patch(model, offload_activations=True)
    got, offload_peak = step()
    tigon.unpatch(model)
    try:
        _assert_same(again, want)
    except AssertionError:  # the step itself is not bit-reproducible here: compare to rounding
        assert torch.equal(got[0], want[0])
        for name in want[1]:
            assert_close(got[1][name], want[1][name], torch.bfloat16, name=name)
    else:
        _assert_same(got, want)
    hidden_bytes = 8192 * 1024 * 2
    # 16 checkpointed states leave the GPU; at most two (in flight) come back at a time.
    assert offload_peak < plain_peak - 8 * hidden_bytes


TINY_SHAPE = dict(
    hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=1000, tie_word_embeddings=True,
)


def test_max_context_bench_pipeline_on_cpu(tmp_path):
    """Both variants per length, merged into max_context.json across runs (its numbers mean nothing
    on the CPU); the long variant's first loss is the plain one's."""
    import json

    from tigon.bench.max_context import run_max_context

    lines = []
    kwargs = dict(steps=1, warmup=0, shape=TINY_SHAPE, device=torch.device("cpu"), out_dir=tmp_path, log=lines.append)
    first = run_max_context([72], **kwargs)
    second = run_max_context([66], ["long"], **kwargs)
    assert not [r["error"] for r in first + second if "error" in r]
    assert [(r["variant"], r["seq"]) for r in first] == [("tigon", 72), ("long", 72)]
    assert "tiled_mlp" in first[1]["applied"] and "offload_activations" in first[1]["applied"]
    assert first[0]["losses"] == first[1]["losses"] and first[0]["step_s"] > 0
    assert all(r["checkpointed_layers"] == TINY_SHAPE["num_hidden_layers"] for r in first)
    saved = json.loads((tmp_path / "max_context.json").read_text())["results"]
    assert [(r["variant"], r["seq"]) for r in saved] == [("tigon", 72), ("long", 72), ("long", 66)]
    assert "66" in lines[-2] and "72" in lines[-2]
    tigon.unpatch()
    with pytest.raises(ValueError, match="variants must be among"):
        run_max_context([72], ["nope"], **kwargs)


def test_max_context_counts_checkpointed_layers():
    from tigon.bench.max_context import _count_checkpoints

    model = tiny_model("llama").train()
    model.gradient_checkpointing_enable()
    tigon.patch(model)
    calls = _count_checkpoints(model)
    ids, mask, labels = batch(seed=8)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    tigon.unpatch(model)
    assert calls == [model.config.num_hidden_layers]


def test_max_context_extrapolation():
    from tigon.bench.max_context import extrapolate, format_table

    records = [
        {"variant": "long", "seq": s, "peak_gb": 2.0 + s / 2**16, "reserved_gb": 0, "step_s": 1.0, "host_gb": 1.0}
        for s in (2**16, 2**17, 2**18)
    ] + [{"variant": "tigon", "seq": 2**19, "error": "OutOfMemoryError: ..."}]
    assert extrapolate(records) == {"long": pytest.approx(2.0 + 16)}
    assert "extrapolated" in format_table(records) and "OutOfMemoryError" in format_table(records)


def test_max_context_on_a_4bit_base_with_unsloth_beside_it(tmp_path, monkeypatch):
    """QLoRA (--quant nf4): the plain and the long (offload + tiled MLP) variants take the same first
    step on the NF4 base; Unsloth's variant runs in a process of its own and, not installable without
    a GPU, is a skipped row; results go to their own file."""
    pytest.importorskip("bitsandbytes")
    import json
    import tempfile

    from tigon.bench.max_context import run_max_context

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the saved random model
    lines = []
    records = run_max_context([72], ["tigon", "long", "unsloth"], steps=1, warmup=0, quant="nf4", shape=TINY_SHAPE,
                              device=torch.device("cpu"), out_dir=tmp_path, log=lines.append)
    tigon.unpatch()
    plain, long, unsloth = records
    assert "error" not in plain and "error" not in long, (plain.get("error"), long.get("error"))
    assert "offload_activations" in long["applied"] and "lora" in long["applied"]
    assert long["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert unsloth["skipped"].startswith("unsloth cannot be imported here")
    saved = json.loads((tmp_path / "max_context-nf4.json").read_text())["results"]
    assert [r["variant"] for r in saved] == ["tigon", "long", "unsloth"] and not (tmp_path / "max_context.json").exists()
    assert "skipped: unsloth cannot be imported" in lines[-2]
    with pytest.raises(ValueError, match="memory cap must be > 0 GB"):
        run_max_context([72], ["tigon"], memory_cap_gb=0, shape=TINY_SHAPE, device=torch.device("cpu"))


@pytest.mark.gpu
def test_gpu_max_context_memory_cap_makes_too_long_an_out_of_memory_row():
    """Under --memory-cap a length that needs more is that length's out-of-memory row, and the
    next length, in a fresh process, still runs within the cap."""
    from tigon.bench.max_context import run_max_context

    shape = dict(TINY_SHAPE, hidden_size=512, intermediate_size=1408, vocab_size=32000)
    records = run_max_context([1048576, 2048], ["long"], steps=1, warmup=0, quant="nf4", memory_cap_gb=1.0, isolate=True,
                              shape=shape, log=lambda line: None)
    assert "OutOfMemoryError" in records[0]["error"], records[0]
    assert "error" not in records[1] and records[1]["peak_gb"] <= 1.0 and records[1]["memory_cap_gb"] == 1.0
