"""Sequence-tiled MLP: same output and gradients as the whole-sequence MLP, chunk by chunk."""

from __future__ import annotations

import math

import pytest
import torch

import tigon
from tests.helpers import assert_close
from tests.patch.tiny import batch, tiny_model
from tigon.patch import tiled
from tigon.nn import SwiGLUMLP


class _Config:
    hidden_size, intermediate_size, hidden_act = 24, 40, "silu"


def _mlp(seed: int) -> SwiGLUMLP:
    torch.manual_seed(seed)
    mlp = SwiGLUMLP(_Config()).double()
    for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        linear.bias = torch.nn.Parameter(torch.randn(linear.out_features, dtype=torch.float64))
    return mlp


@pytest.mark.parametrize("shape, chunk", [((2, 13, 24), 5), ((3, 7, 24), 4), ((1, 29, 24), 28)])
def test_tiled_mlp_matches_whole_sequence_on_odd_lengths(shape, chunk, poison_outputs):
    seed = sum(shape) + chunk
    mlp = _mlp(seed)
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    grad = torch.randn(shape, dtype=torch.float64)
    seen = []

    def forward(rows):
        seen.append(rows.shape[:-1].numel())
        return mlp(rows)

    params = list(mlp.parameters())
    out = tiled.tiled_mlp(forward, x, params, chunk=chunk)
    got = torch.autograd.grad(out, [x, *params], grad)
    tokens = math.prod(shape[:-1])
    # Forward and backward's recomputation each see chunks only, the last one the remainder.
    want_sizes = [chunk] * (tokens // chunk) + ([tokens % chunk] if tokens % chunk else [])
    assert seen == want_sizes * 2
    want_out = mlp(x)
    want = torch.autograd.grad(want_out, [x, *params], grad)
    assert_close(out, want_out, name="out")
    for name, g, w in zip(["x", *(n for n, _ in mlp.named_parameters())], got, want):
        assert_close(g, w, name=name)


def test_tiled_mlp_gradient_of_frozen_parameters_and_input():
    """Only what requires grad gets a gradient; frozen weights are read but not differentiated."""
    mlp = _mlp(3)
    mlp.gate_proj.weight.requires_grad_(False)
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    trainable = [p for p in mlp.parameters() if p.requires_grad]
    out = tiled.tiled_mlp(mlp, x, trainable, chunk=4)
    out.square().sum().backward()
    got = {n: p.grad.clone() for n, p in mlp.named_parameters() if p.requires_grad}
    assert mlp.gate_proj.weight.grad is None
    mlp.zero_grad()
    mlp(x).square().sum().backward()
    for name, p in mlp.named_parameters():
        if p.requires_grad:
            assert_close(got[name], p.grad, name=name)


def test_tiled_mlp_replays_dropout_masks():
    """Backward recomputes each chunk with the forward's RNG state: the gradient is that of the
    masks the forward drew."""
    x = torch.randn(3, 11, 8, dtype=torch.float64, requires_grad=True)
    drop = torch.nn.Dropout(0.5)
    out = tiled.tiled_mlp(lambda rows: 3.0 * drop(rows), x, [], chunk=4)
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
    kept = (out != 0).double()
    assert 0 < kept.mean() < 1
    assert torch.equal(grad, kept * 6.0)


@pytest.mark.parametrize("tokens, hidden", [(1, 64), (64, 64), (65, 64), (1000, 64), (262144, 2048), (100003, 4096)])
def test_chunk_size_is_balanced_and_bounded_by_the_width(tokens, hidden):
    chunk = tiled.chunk_size(tokens, hidden)
    chunks = math.ceil(tokens / chunk)
    most = tiled.CHUNK_WIDTHS * hidden
    assert chunk <= most or tokens <= most
    assert chunks == math.ceil(tokens / most)
    assert tokens - (chunks - 1) * chunk >= chunk - chunks  # the last chunk is not a sliver


def test_bad_arguments():
    with pytest.raises(ValueError, match="tokens and hidden"):
        tiled.chunk_size(0, 64)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        tiled.tiled_mlp(torch.nn.Identity(), torch.ones(2, 3), [], chunk=0)


def _loss_and_grads(model, ids, mask, labels):
    model.zero_grad()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", ["llama", "gemma", "phi3"])
def test_patched_model_with_checkpointing_same_loss_and_grads(model_type, monkeypatch):
    """tiled_mlp=True on a model under gradient checkpointing, chunk size automatic (more tokens
    than the width): the loss and every gradient are those of the untiled model."""
    model = tiny_model(model_type, dtype=torch.float64, resid_pdrop=0.0).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, mask, labels = batch(seed=5, rows=2, cols=47)
    monkeypatch.setattr(tiled, "CHUNK_WIDTHS", 1)  # chunks of the width, 64: 94 tokens make two
    calls = []
    apply = tiled._TiledFunction.apply
    monkeypatch.setattr(tiled._TiledFunction, "apply", lambda *a: calls.append(a[1]) or apply(*a))
    tigon.patch(model)
    want_loss, want = _loss_and_grads(model, ids, mask, labels)
    assert not calls
    applied = tigon.patch(model, tiled_mlp=True).applied
    assert "tiled_mlp" in applied
    got_loss, got = _loss_and_grads(model, ids, mask, labels)
    assert calls == [47] * 4  # per layer: the forward, then checkpointing's recomputation
    assert_close(got_loss, want_loss, name="loss")
    assert got.keys() == want.keys()
    for name in want:
        assert_close(got[name], want[name], name=name)
    tigon.unpatch(model)
    assert all("forward" not in vars(m) for m in model.modules())


def test_class_patch_and_unpatch(monkeypatch):
    from transformers.models.llama import modeling_llama as ml

    original = ml.LlamaMLP.forward
    try:
        patched = tigon.patch("llama", tiled_mlp=True, swiglu=False)
        assert patched.applied.count("tiled_mlp") == 1
        assert ml.LlamaMLP.forward is not original
        model = tiny_model("llama", dtype=torch.float64)
        ids, mask, labels = batch(seed=2, rows=1, cols=70)
        monkeypatch.setattr(tiled, "CHUNK_WIDTHS", 1)
        calls = []
        apply = tiled._TiledFunction.apply
        monkeypatch.setattr(tiled._TiledFunction, "apply", lambda *a: calls.append(a[1]) or apply(*a))
        model(input_ids=ids, labels=labels).loss.backward()
        assert calls == [35, 35]  # once per layer
    finally:
        tigon.unpatch("llama")
    assert ml.LlamaMLP.forward is original


def test_peft_lora_tiled_same_loss_and_grads():
    """Under tiled_mlp the LoRA MLP runs its LoRA linears per chunk; the adapters' gradients are
    unchanged."""
    from peft import LoraConfig, get_peft_model

    base = tiny_model("llama", dtype=torch.float64)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"])
    model = get_peft_model(base, config).train()
    for name, p in model.named_parameters():  # B starts at zero: make the adapters matter
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    ids, mask, labels = batch(seed=9, rows=2, cols=41)
    tigon.patch(model)
    want_loss, want = _loss_and_grads(model, ids, mask, labels)
    tigon.patch(model, tiled_mlp=True)
    got_loss, got = _loss_and_grads(model, ids, mask, labels)
    tigon.unpatch(model)
    assert_close(got_loss, want_loss, name="loss")
    assert want and got.keys() == want.keys()
    for name in want:
        assert_close(got[name], want[name], name=name)


@pytest.mark.gpu
def test_tiled_mlp_bf16_gpu():
    """bf16 on the GPU at a long-context shape: output and gradients within bf16 tolerance of the
    whole-sequence fused MLP, and the chunked forward's peak far below the whole one's."""
    torch.manual_seed(0)
    config = type("C", (), dict(hidden_size=2048, intermediate_size=8192, hidden_act="silu"))()
    mlp = SwiGLUMLP(config).cuda().bfloat16()
    x = torch.randn(1, 32768, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    params = list(mlp.parameters())
    want_out = mlp(x)
    want = torch.autograd.grad(want_out, [x, *params], grad)
    del want_out
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = tiled.tiled_mlp(mlp, x, params)
    got = torch.autograd.grad(out, [x, *params], grad)
    peak = torch.cuda.max_memory_allocated() - base
    whole = 3 * x.shape[1] * 8192 * 2  # gate, up and their product for the whole sequence, bytes
    assert peak < 0.75 * whole  # the untiled MLP keeps gate and up alone: 2/3 of it, and more in backward
    for g, w in zip(got, want):
        assert_close(g, w, torch.bfloat16)
