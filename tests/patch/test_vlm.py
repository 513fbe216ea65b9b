"""Vision-language models patched: the language model through its text family's kernels, the loss
on the multimodal head (image positions never scored), the vision tower's norms, gated MLPs and
rotary; loss and every gradient equal to the unpatched model's."""

from __future__ import annotations

import copy

import pytest
import torch

import tigon
from tests.helpers import assert_close
from tests.patch.tiny_vlm import SPECS, tiny_vlm, vlm_batch, vlm_params
from tigon.patch import VLM_FAMILIES, VLM_OVER_TEXT


@pytest.fixture(autouse=True)
def clean_patches():
    yield
    tigon.unpatch()


def vlm_run(model, batch):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def counting(monkeypatch) -> dict:
    """Calls of each tigon functional op, counted."""
    from tigon import functional

    counts: dict[str, int] = {}
    for name in ("rms_norm", "add_rms_norm", "layer_norm", "rope", "glu_mlp", "add_rms_norm_glu_mlp",
                 "linear_cross_entropy", "linear_group", "gelu_mlp", "geglu"):
        real = getattr(functional, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(functional, name, counted)
    return counts


def test_every_vlm_family_is_tested():
    assert set(SPECS) == set(VLM_FAMILIES) | set(VLM_OVER_TEXT)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("model_type", vlm_params())
def test_patched_vlm_trains_as_the_unpatched_one(model_type, device, monkeypatch):
    # (cuDNN's convolutions, the towers' patch embeddings, in float32 not TF32: an exact comparison.)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    want_model = tiny_vlm(model_type).to(device)
    model = copy.deepcopy(want_model)
    batch = {key: value.to(device) for key, value in vlm_batch(model_type).items()}
    want_loss, want_grads = vlm_run(want_model, batch)
    counts = counting(monkeypatch)
    patched = tigon.patch(model)
    assert "linear_cross_entropy" in patched.applied and "rms_norm" in patched.applied
    loss, grads = vlm_run(model, batch)
    # The loss came from tigon's fused head, the decoder's norms from its kernels.
    assert counts.get("linear_cross_entropy") == 1
    assert counts.get("rms_norm", 0) + counts.get("add_rms_norm", 0) + counts.get("add_rms_norm_glu_mlp", 0) > 0
    assert_close(loss, want_loss, name="loss")
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        if want_grads[name] is None:
            assert grad is None, name
            continue
        assert grad is not None, f"no gradient for {name}"
        assert_close(grad, want_grads[name], name=f"grad {name}")
    tigon.unpatch(model)
    loss_after, _ = vlm_run(model, batch)
    assert_close(loss_after, want_loss, name="loss after unpatch")


@pytest.mark.parametrize("model_type", ["llava", "gemma3"])
def test_positional_pixels_reach_the_model_as_its_own_forward_reads_them(model_type):
    """A multimodal forward's second parameter is its pixels: called positionally (as generate's
    callers may), the patched model reads it so, without labels as with them."""
    want_model = tiny_vlm(model_type).eval()
    model = copy.deepcopy(want_model)
    tigon.patch(model)
    batch = vlm_batch(model_type)
    with torch.no_grad():
        got = model(batch["input_ids"], batch["pixel_values"]).logits
        want = want_model(batch["input_ids"], batch["pixel_values"]).logits
        assert_close(got, want, name="logits")
        with pytest.raises(TypeError, match="multiple values for argument 'pixel_values'"):
            model(batch["input_ids"], batch["pixel_values"], pixel_values=batch["pixel_values"])


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_vision_tower_runs_tigon_kernels(model_type, monkeypatch):
    """The vision tower's 2-D rotary and its norms (LayerNorm for Qwen2-VL, RMSNorm and a gated
    MLP for Qwen2.5-VL) run tigon's ops, not only the language model."""
    model = tiny_vlm(model_type)
    tigon.patch(model)
    counts = counting(monkeypatch)
    batch = vlm_batch(model_type)
    model.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"])
    assert counts.get("rope", 0) == 2  # one per vision block
    assert counts.get("layer_norm" if model_type == "qwen2_vl" else "rms_norm", 0) >= 4
    assert counts.get("glu_mlp" if model_type == "qwen2_5_vl" else "gelu_mlp", 0) == 2


@pytest.mark.parametrize("model_type", ["gemma3", "llava", "idefics3", "internvl", "qwen3_vl", "qwen3_vl_moe", "mllama"])
def test_vision_tower_gelu_mlps_run_one_op(model_type, monkeypatch):
    """The towers' MLPs that are not gated (SigLIP's tanh GELU, CLIP's QuickGELU, ...) run as one
    gelu_mlp per block, from the tower's own modeling module where it has one."""
    model = tiny_vlm(model_type)
    tigon.patch(model)
    counts = counting(monkeypatch)
    vlm_run(model, vlm_batch(model_type))
    # (SigLIP's attention-pooling head has an MLP too; Mllama's tower has a global block after its 2.)
    blocks = 3 if model_type in ("gemma3", "mllama") else 2
    assert counts.get("gelu_mlp", 0) == blocks


@pytest.mark.parametrize("model_type", vlm_params([t for t, family in VLM_FAMILIES.items() if family.patch_embed]))
def test_patch_embedding_runs_as_one_gemm_not_a_convolution(model_type, monkeypatch):
    """The Qwen-VL / GLM-4V patch embedding (a Conv3d whose stride is its kernel, with a bias in
    Qwen3-VL's and GLM-4V's) gives the convolution's output and gradients without running it; with
    a hook on its Conv3d it runs the module's own forward."""
    model = tiny_vlm(model_type)
    embed = next(m for m in model.modules() if type(m).__name__ == VLM_FAMILIES[model_type].patch_embed)
    pixels = vlm_batch(model_type)["pixel_values"]
    grad = torch.randn(pixels.shape[0], embed.proj.out_channels, generator=torch.Generator().manual_seed(3))

    def run():
        embed.zero_grad(set_to_none=True)
        out = embed(pixels)
        out.backward(grad)
        return out.detach(), [p.grad for p in embed.parameters()]

    want, want_grads = run()
    assert "patch_embed" in tigon.patch(model).applied
    convolutions = []
    real = torch.nn.Conv3d._conv_forward
    monkeypatch.setattr(torch.nn.Conv3d, "_conv_forward", lambda *a: convolutions.append(1) or real(*a))
    got, grads = run()
    assert not convolutions
    assert_close(got, want, name="output")
    assert len(grads) == len(want_grads) == (2 if embed.proj.bias is not None else 1)
    for g, w in zip(grads, want_grads):
        assert_close(g, w, name="gradient")
    embed.proj.register_forward_hook(lambda *a: None)
    assert_close(embed(pixels), want, name="hooked output")
    assert convolutions == [1]


@pytest.mark.parametrize("model_type", vlm_params([t for t, family in VLM_FAMILIES.items() if family.vision_attention]))
@pytest.mark.parametrize("grids", [[[1, 4, 4], [1, 4, 4]], [[1, 4, 4], [1, 2, 4], [1, 4, 2]]], ids=["one-size", "sizes"])
def test_vision_attention_reads_the_image_lengths_once_per_tower_forward(model_type, grids, monkeypatch):
    """With SDPA, a Qwen-VL / GLM-4V tower's attention reads the packed images' lengths to the
    host (a device sync) once per boundaries tensor, not three times in every block; images of one
    size go to one batched attention call; output and every gradient are the unpatched tower's.
    Under eager attention the module's own forward runs."""
    model = tiny_vlm(model_type)
    visual = model.model.visual
    visual.config._attn_implementation = "sdpa"
    grid = torch.tensor(grids)
    gen = torch.Generator().manual_seed(5)
    pixels = torch.randn(int(grid.prod(1).sum()), vlm_batch(model_type)["pixel_values"].shape[1], generator=gen)
    reads, calls = [], []
    tolist, sdpa = torch.Tensor.tolist, torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, *a, **k: calls.append(q.shape[0]) or sdpa(q, *a, **k))

    def run():
        visual.zero_grad(set_to_none=True)
        reads.clear()
        calls.clear()
        out = visual(pixels, grid_thw=grid)
        out = getattr(out, "pooler_output", out)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(6)))
        # (Qwen3-VL's deepstack mergers feed the language model, not the pooled output: no gradient)
        return out.detach(), {n: p.grad for n, p in visual.named_parameters() if p.grad is not None}, len(reads), list(calls)

    want, want_grads, want_reads, want_calls = run()
    assert "vision_attention" in tigon.patch(model).applied
    got, grads, got_reads, got_calls = run()
    assert_close(got, want, name="output")
    assert grads.keys() == want_grads.keys() and any("blocks.0.attn.qkv" in name for name in grads)
    for name, grad in grads.items():
        assert_close(grad, want_grads[name], name=name)
    blocks = len(visual.blocks)
    boundaries = 2 if model_type == "qwen2_5_vl" else 1  # its windowed blocks' and its whole-image ones'
    assert want_reads - got_reads == 3 * blocks - boundaries
    assert sum(got_calls) == sum(want_calls) == len(want_calls)  # every segment attended, each alone before
    if len(grids) == 2 and model_type != "qwen2_5_vl":
        assert got_calls == [2] * blocks
    elif len(grids) == 3:
        assert len(got_calls) == len(want_calls)
    visual.config._attn_implementation = "eager"
    eager, *_ = run()
    assert_close(eager, want, name="eager attention's output")
    assert not calls


def test_class_patch_of_a_vlm_over_a_text_family_says_what_to_do():
    with pytest.raises(ValueError, match="patch the model instance"):
        tigon.patch("llava")


@pytest.mark.parametrize("model_type", vlm_params(["gemma4"]))
def test_clipped_vision_mlps_run_geglu_between_their_clamps(model_type, monkeypatch):
    """Gemma 4's tower: each gated MLP runs one GeGLU between its clippable linears, whose clamps
    (made to bite here) still apply, and its norms (with and without a weight) run tigon's RMSNorm;
    the tower's output and every gradient are HF's."""
    want_model = tiny_vlm(model_type)
    with torch.no_grad():
        for name, buffer in want_model.named_buffers():
            if name.endswith(("input_min", "output_min")):
                buffer.fill_(-0.3)
            elif name.endswith(("input_max", "output_max")):
                buffer.fill_(0.3)
    model = copy.deepcopy(want_model)
    batch = vlm_batch(model_type)

    def tower(model):
        model.zero_grad(set_to_none=True)
        out = model.model.vision_tower(batch["pixel_values"], batch["image_position_ids"]).last_hidden_state
        out.square().sum().backward()
        return out.detach(), {n: p.grad for n, p in model.model.vision_tower.named_parameters()}

    want, want_grads = tower(want_model)
    tigon.patch(model)
    counts = counting(monkeypatch)
    got, grads = tower(model)
    assert counts.get("geglu", 0) == 2  # one per block
    assert counts.get("rms_norm", 0) == 2 * 7  # per block: 4 around the sublayers, q, k and v (no weight)
    assert_close(got, want, name="tower output")
    for name, grad in grads.items():
        assert_close(grad, want_grads[name], name=f"grad {name}")
