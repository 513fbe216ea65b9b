"""tigon.patch(model, fp8=...): which linears become torchao's Float8Linear, the refusals, the undo,
and training with them. torch._scaled_mm runs on the CPU too, so the CPU tests train through
torchao's FP8 GEMMs with the hardware check stood aside (`fp8_anywhere`); the GPU tests do not."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

import tigon
from tests.helpers import skip_without_cpu_rowwise_scaled_mm
from tests.patch.tiny import batch, tiny_model
from tigon.patch import fp8

pytest.importorskip("torchao")

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


@pytest.fixture
def fp8_anywhere(monkeypatch):
    """FP8 allowed on this machine's CPU, and tigon's ops on their references (the Triton
    interpreter has no bf16 dot)."""
    monkeypatch.setattr(fp8, "unsupported", lambda device=None: None)
    monkeypatch.setenv("TIGON_DISABLE", "all")


def _float8(module):
    return type(module).__name__ == "Float8Linear"


def _converted(model):
    return sorted(name for name, module in model.named_modules() if _float8(module))


def _bf16_llama(**overrides):
    return tiny_model("llama", 0, dtype=torch.bfloat16, **{"intermediate_size": 96, **overrides})


def test_refused_on_the_cpu_naming_it_and_nothing_patched():
    model = _bf16_llama()
    forward = model.model.layers[0].mlp.forward
    with pytest.raises(ValueError, match=r"compute capability >= 8\.9.*the model is on cpu"):
        tigon.patch(model, fp8="rowwise")
    assert not _converted(model)
    assert model.model.layers[0].mlp.forward == forward and "forward" not in vars(model.model.layers[0].mlp)


def test_unsupported_names_the_gpu_and_its_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    reason = fp8.unsupported(torch.device("cuda", 1))
    assert reason == ("FP8 matmuls need compute capability >= 8.9 (Ada, Hopper or newer); cuda:1 "
                      "(NVIDIA A100-SXM4-80GB) has 8.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert fp8.unsupported(torch.device("cuda", 1)) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA GPU is visible" in fp8.unsupported()


def test_bad_recipes_and_targets_are_refused():
    with pytest.raises(ValueError, match="fp8 must be one of tensorwise, rowwise"):
        tigon.patch(_bf16_llama(), fp8="blockwise")
    with pytest.raises(ValueError, match="pass the model, not 'llama'"):
        tigon.patch("llama", fp8="tensorwise")


def test_missing_torchao_is_one_line_naming_the_extra(fp8_anywhere, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import raises ImportError
    with pytest.raises(ValueError) as err:
        tigon.patch(_bf16_llama(), fp8="tensorwise")
    assert str(err.value) == ("tigon.patch(fp8=...): FP8 training runs through torchao, which is not installed: "
                              "pip install 'tigon[fp8]'")


def test_weights_other_than_bf16_are_refused(fp8_anywhere):
    with pytest.raises(ValueError, match="keeps bf16 weights, and the decoder's are float32"):
        tigon.patch(tiny_model("llama", 0, intermediate_size=96), fp8="tensorwise")


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_the_decoder_projections_convert_and_unpatch_restores_them(fp8_anywhere, recipe):
    model = _bf16_llama()
    params = dict(model.named_parameters())
    applied = tigon.patch(model, fp8=recipe)
    assert _converted(model) == sorted(f"model.layers.{i}.{p}" for i in range(2) for p in PROJECTIONS)
    assert str(applied).startswith("tigon: applied rms_norm") and f"fp8 {recipe} (14 linears)" in str(applied)
    assert type(model.lm_head) is torch.nn.Linear  # the head stays in tigon's fused linear + cross-entropy
    assert model.model.layers[0].mlp.down_proj.config == fp8.config(recipe)
    # Each FP8 linear is a compiled region of its own, where torchao's casts fuse.
    assert all(model.get_submodule(name)._compiled_call_impl is not None for name in _converted(model))
    # The same parameters: the optimizer, the state dict and the checkpoints see what they did.
    assert all(p is params[name] for name, p in model.named_parameters())
    assert list(model.state_dict()) == list(params)
    tigon.unpatch(model)
    assert not _converted(model)
    assert all(type(model.get_submodule(f"model.layers.0.{p}")) is torch.nn.Linear for p in PROJECTIONS)
    assert all(p is params[name] for name, p in model.named_parameters())


def test_sides_fp8_cannot_take_stay_bf16_said_once(fp8_anywhere, caplog):
    model = _bf16_llama(intermediate_size=88)  # 88 is no multiple of 16: the MLP's projections stay
    with caplog.at_level(logging.WARNING, logger="tigon"):
        applied = tigon.patch(model, fp8="tensorwise")
    assert _converted(model) == sorted(f"model.layers.{i}.self_attn.{p}" for i in range(2)
                                       for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert "fp8 tensorwise (8 linears, 6 left in bf16)" in str(applied)
    (line,) = [r.getMessage() for r in caplog.records if "stay bf16" in r.getMessage()]
    assert "model.layers.0.mlp.gate_proj (64 -> 88)" in line and "model.layers.1.mlp.down_proj (88 -> 64)" in line
    with pytest.raises(ValueError, match="no projection of the decoder can run in FP8: every one has a side"):
        tigon.patch(_bf16_llama(intermediate_size=88, hidden_size=72, head_dim=18), fp8="tensorwise")


def test_frozen_and_lora_linears_are_never_converted(fp8_anywhere):
    model = _bf16_llama()
    model.model.layers[1].mlp.requires_grad_(False)
    tigon.patch(model, fp8="rowwise")
    assert not any(name.startswith("model.layers.1.mlp") for name in _converted(model))
    assert "model.layers.1.self_attn.q_proj" in _converted(model)
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(_bf16_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match="no projection of the decoder can run in FP8: it has none that trains"):
        tigon.patch(lora, fp8="rowwise")
    assert not _converted(lora)


def test_experts_and_routers_stay_bf16(fp8_anywhere):
    model = tiny_model("qwen2_moe", 0, dtype=torch.bfloat16, intermediate_size=96, moe_intermediate_size=48,
                       shared_expert_intermediate_size=48)
    tigon.patch(model, fp8="tensorwise")
    converted = _converted(model)
    assert "model.layers.0.mlp.down_proj" in converted  # the dense MLP of layer 0
    assert "model.layers.1.mlp.shared_expert.down_proj" in converted  # a dense MLP beside the experts
    assert "model.layers.1.self_attn.q_proj" in converted
    assert not [n for n in converted if "experts" in n.split(".") or n.endswith(("mlp.gate", "shared_expert_gate"))]
    assert type(model.get_submodule("model.layers.1.mlp.gate")).__name__ != "Float8Linear"


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_padded_tokens_change_nothing(recipe):
    """26 tokens run padded to 32 (the weight gradient's GEMM contracts over them): the output and
    every gradient are those of the unpadded GEMMs."""
    if recipe == "rowwise":
        skip_without_cpu_rowwise_scaled_mm()
    float8 = fp8.torchao_float8()
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=False, dtype=torch.bfloat16)
    module = float8.float8_linear.Float8Linear.from_float(linear, config=fp8.config(recipe))
    x = torch.randn(2, 13, 64, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(2, 13, 48, dtype=torch.bfloat16)
    results = []
    for forward in (module.forward, lambda t: fp8.padded_rows(module.forward, t, 48)):
        module.weight.grad = x.grad = None
        out = forward(x)
        out.backward(grad)
        results.append((out, x.grad, module.weight.grad))
    for plain, padded in zip(*results):
        torch.testing.assert_close(padded, plain, rtol=0, atol=0)


def _train(model, steps, checkpointing=False):
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    ids, mask, labels = (t.to(model.device) for t in batch(rows=2, cols=13))  # learnt by heart: the loss falls
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_training_with_fp8_linears_follows_bf16(fp8_anywhere, recipe):
    if recipe == "rowwise":
        skip_without_cpu_rowwise_scaled_mm()
    bf16 = _bf16_llama()
    tigon.patch(bf16)
    model = _bf16_llama()
    tigon.patch(model, fp8=recipe)
    reference, losses = _train(bf16, 6), _train(model, 6)
    assert losses[-1] < losses[0] - 0.1
    assert losses == pytest.approx(reference, rel=0.02)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_every_projection_stays_compiled_over_changing_batch_shapes(fp8_anywhere, caplog):
    """Each weight shape's projections have a compiled function of their own: Dynamo's limit of 8
    graphs a function, shared by the model's 4 shapes, was passed by batches of changing length and
    size (unpacked rows), and the projections after it ran uncompiled."""
    model = _bf16_llama(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    tigon.patch(model, fp8="tensorwise")
    swapped = [m for m in model.modules() if _float8(m)]
    codes = {(m.in_features, m.out_features): m.forward.__func__.__code__ for m in swapped}
    assert len(codes) == 4 and len(set(codes.values())) == 4
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        for batch, seq in ((2, 16), (2, 24), (3, 16)):
            ids = torch.randint(0, 100, (batch, seq))
            model(input_ids=ids, labels=ids).loss.backward()
    assert not [r.getMessage() for r in caplog.records if "recompile_limit" in r.getMessage()]


def test_save_pretrained_writes_the_plain_bf16_weights(fp8_anywhere, tmp_path):
    from safetensors.torch import load_file

    model = _bf16_llama()
    tigon.patch(model, fp8="tensorwise")
    _train(model, 2)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    state = model.state_dict()
    assert set(saved) == set(state) and {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert all(torch.equal(saved[k], state[k]) for k in saved)
    assert "quantization_config" not in (tmp_path / "config.json").read_text()


def test_plain_tensor_unwraps_torchao_fsdp_weights():
    float8 = fp8.torchao_float8()
    linear = float8.float8_linear.Float8Linear.from_float(torch.nn.Linear(32, 32, dtype=torch.bfloat16),
                                            config=fp8.config("tensorwise", all_gather=True))
    wrapped = linear.weight.data
    assert type(wrapped).__name__ == "WeightWithDynamicFloat8CastTensor"
    plain = fp8.plain_state_dict({"w": wrapped, "step": 3})
    assert type(plain["w"]) is torch.Tensor and plain["w"].dtype == torch.bfloat16 and plain["step"] == 3
    assert not fp8.config("rowwise", all_gather=True).enable_fsdp_float8_all_gather  # tensorwise only


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", fp8.RECIPES)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_gpu_fp8_training_follows_bf16(recipe, checkpointing):
    """On an FP8 GPU, with tigon's kernels around torchao's linears: 10 AdamW steps whose losses
    stay within 5% of the first loss of the bf16 run's, under gradient checkpointing too (the tiny
    model memorises its batch: near zero, each step's relative gap says nothing)."""
    if fp8.unsupported() is not None:
        pytest.skip(fp8.unsupported())
    shape = dict(hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    runs = []
    for kind in (None, recipe):
        model = _bf16_llama(**shape).cuda()
        applied = tigon.patch(model, fp8=kind)
        if kind is not None:
            assert f"fp8 {kind} (14 linears)" in str(applied)
        runs.append(_train(model, 10, checkpointing))
    assert runs[1][-1] < runs[1][0] - 0.3
    assert runs[1] == pytest.approx(runs[0], rel=0, abs=0.05 * runs[0][0])
