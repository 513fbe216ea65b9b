"""tigon.patch on PEFT LoRA / DoRA adapters over tigon's FP8 linears (tigon.nn.Fp8Linear): the
fused ops against PEFT's own path through the same FP8 modules, and (on a GPU with FP8) a few
training steps with the FP8 GEMMs."""

import copy

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import tigon  # noqa: E402
from tigon.nn import Fp8Linear  # noqa: E402
from tigon.nn.fp8 import quantize_linears  # noqa: E402
from tests.patch.test_lora import FUSED, _assert_same_step, _ids, apply_lora, spy  # noqa: E402,F401
from tests.helpers import assert_close  # noqa: E402
from tests.ops.composite.test_lora import one_cpu_thread  # noqa: E402,F401 (autouse fixture)

VOCAB = 101


@pytest.fixture(autouse=True)
def clean_patches():
    yield
    tigon.unpatch()


def _fp8_model(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)
    assert quantize_linears(model) == 14
    return model


def _lora_pair(**lora):
    base = _fp8_model()
    torch.manual_seed(0)
    config = peft.LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "init_lora_weights": False,
                                **lora})
    ours = peft.get_peft_model(base, config, autocast_adapter_dtype=False).train()
    return ours, copy.deepcopy(ours)


@pytest.mark.parametrize("dora", [False, True])
def test_lora_on_fp8_bases_matches_peft(spy, dora):
    ours, theirs = _lora_pair(use_dora=dora)
    summary = apply_lora(ours)
    assert (summary.linears, summary.gated_mlps, summary.qkv_groups, summary.left) == (14, 2, 2, {})
    assert summary.quantized == {"fp8": 14} and summary.dora == (14 if dora else 0)
    _assert_same_step(ours, theirs, _ids())
    assert spy == FUSED
    base = ours.base_model.model.model.layers[0].mlp.down_proj.base_layer
    assert type(base) is Fp8Linear and base.weight.dtype == torch.float8_e4m3fn and not base.weight.requires_grad


def test_fp8_linears_match_the_dequantised_model():
    """An FP8 model computes what an nn.Linear model of its dequantised weights computes."""
    fp8 = _fp8_model()
    dense = copy.deepcopy(fp8)
    for name, module in list(dense.named_modules()):
        if type(module) is Fp8Linear:
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=False)
            linear.weight = torch.nn.Parameter(module.dequantize(torch.float32))
            parent, _, child = name.rpartition(".")
            setattr(dense.get_submodule(parent), child, linear)
    ids = _ids()
    assert_close(fp8(input_ids=ids, labels=ids).loss, dense(input_ids=ids, labels=ids).loss, name="loss")


@pytest.mark.gpu
@pytest.mark.parametrize("dora", [False, True])
def test_bf16_lora_on_fp8_trains_on_gpu(dora):
    """A few AdamW steps of LoRA on the FP8 base with the FP8 GEMMs: the loss falls, and the first
    step's loss and adapter gradients stay within FP8's error of the same step on the dequantised
    (bf16 GEMM) path."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU of compute capability 8.9+")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
    base = transformers.LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    quantize_linears(base)
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False, use_dora=dora)
    model = peft.get_peft_model(base, lora).train()
    tigon.patch(model)
    ids = torch.randint(0, VOCAB, (4, 128), device="cuda")
    first = model(input_ids=ids, labels=ids).loss
    first.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    with pytest.MonkeyPatch.context() as mp:  # the same step on the dequantised weights' bf16 GEMMs
        mp.setenv("TIGON_DISABLE", "fp8_matmul,fp8_matmul_grad")
        ref = model(input_ids=ids, labels=ids).loss
        ref.backward()
    assert abs(first.item() - ref.item()) < 0.02 * ref.item()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert_close(grads[name].float(), p.grad.float(), tol=0.1, name=name)
    model.zero_grad()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses


def test_e2e_bench_lora_fp8_mode_runs():
    """The end-to-end benchmark's LoRA-on-FP8 rows, on a tiny Llama on the CPU (numbers mean nothing)."""
    from tigon.bench.e2e import run_e2e

    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=500, tie_word_embeddings=True)
    records = run_e2e(modes=["lora-fp8"], impls=["eager", "tigon"], batch=1, seq=8, steps=2, warmup=1, shape=shape,
                      device=torch.device("cpu"), log=lambda line: None)
    assert not [r["error"] for r in records if "error" in r]
    assert "lora" in records[-1]["applied"] and records[-1]["max_loss_diff"] < 0.02
