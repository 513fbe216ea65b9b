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


def _handed_and_apart(monkeypatch, dtype, device):
    """One step of a fully patched model with LoRA on FP8 bases, its norms handing their FP8 rows
    to the q/k/v and gate/up groups, and one with them quantising their inputs apart: (loss and
    adapter gradients) of each, and the shapes the groups quantised themselves in each."""
    from tigon.ops.composite import lora as lora_ops
    from tigon.patch import lora as patch_lora

    quantized, quantize = [], lora_ops.quantize_rows
    monkeypatch.setattr(lora_ops, "quantize_rows", lambda t, *args: quantized.append(tuple(t.shape)) or quantize(t, *args))
    base = _fp8_model(dtype, device)
    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    model = peft.get_peft_model(base, config, autocast_adapter_dtype=False).train()
    tigon.patch(model)
    ids = _ids(device)

    def run():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    handed, handed_shapes = run(), list(quantized)
    monkeypatch.setattr(patch_lora, "takes_fp8_rows", lambda module, x: False)
    quantized.clear()
    return handed, run(), handed_shapes, quantized


def _assert_bit_for_bit(handed, apart):
    assert torch.equal(handed[0], apart[0])
    assert handed[1].keys() == apart[1].keys() and len(handed[1]) == 28
    for name in handed[1]:
        assert torch.equal(handed[1][name], apart[1][name]), name


def test_norms_write_the_fp8_rows_that_the_lora_groups_take(monkeypatch):
    """LoRA on FP8 bases, fully patched, the FP8 GEMM path forced on (torch's CPU ``_scaled_mm``
    where there is no GPU): the input norm, the add + norm before the MLP and the closing add +
    norm (for the next layer) write their output's FP8 rows in their own pass, and the q/k/v and
    gate/up groups' FP8 GEMMs take them, quantising no input themselves; the loss and every
    adapter gradient bit for bit those of the path that quantises the inputs apart."""
    from tigon.ops import fp8 as fp8_ops
    from tigon.ops.composite import lora as lora_ops, lora_mlp
    from tigon.patch import lora as patch_lora

    for module in (fp8_ops, lora_ops, lora_mlp, patch_lora):
        monkeypatch.setattr(module, "fp8_gemm_reason", lambda x, weight: None)
    try:
        handed, apart, handed_shapes, apart_shapes = _handed_and_apart(monkeypatch, torch.float32, "cpu")
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"torch._scaled_mm does not run here: {err}")
    # Two layers: only the o projections' inputs (the attention's output, which no norm makes).
    assert handed_shapes == [(26, 64)] * 2
    assert apart_shapes == [(26, 64)] * 6  # and the q/k/v and gate/up inputs: the path compared against
    _assert_bit_for_bit(handed, apart)


@pytest.mark.gpu
def test_norms_fp8_rows_are_bit_for_bit_on_gpu(monkeypatch):
    """On a GPU with FP8, bf16: the norms' FP8 rows give the groups' GEMMs the operands that
    quantising the inputs apart gives, bit for bit (loss and adapter gradients)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU of compute capability 8.9+")
    handed, apart, handed_shapes, apart_shapes = _handed_and_apart(monkeypatch, torch.bfloat16, "cuda")
    assert len(handed_shapes) == 2 and len(apart_shapes) == 6
    _assert_bit_for_bit(handed, apart)
