"""tigon.patch on models loaded quantised by bitsandbytes (through transformers' BitsAndBytesConfig),
with and without PEFT LoRA / DoRA adapters: the fused ops against PEFT + bitsandbytes themselves.

bitsandbytes' CPU backend runs all of it: 4-bit (NF4/FP4) dequantisation and matmuls, and LLM.int8
through its dequantise-then-matmul training path."""

import logging

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytest.importorskip("bitsandbytes")

import tigon  # noqa: E402
from tigon.patch.lora import active_adapter  # noqa: E402
from tests.patch.test_lora import FUSED, _assert_same_step, _ids, _run, apply_lora, spy  # noqa: E402,F401
from tests.helpers import assert_close, record_offload_sessions  # noqa: E402
from tests.ops.composite.test_lora import one_cpu_thread  # noqa: E402,F401 (autouse fixture)

VOCAB = 101
KINDS = ["nf4", "fp4", "nf4-double", "int8"]


@pytest.fixture(autouse=True)
def clean_patches():
    yield
    tigon.unpatch()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama on disk: bitsandbytes quantises while transformers loads."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _quantization(kind, compute_dtype=torch.float32):
    if kind == "int8":
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    return transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=kind[:3], bnb_4bit_use_double_quant=kind.endswith("double"),
        bnb_4bit_compute_dtype=compute_dtype,
    )


def _load(checkpoint, kind, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, quantization_config=_quantization(kind, dtype), dtype=dtype, device_map="cpu"
    )


def _qlora(checkpoint, kind, **lora):
    """The quantised model with the same random (non-zero) adapters, twice: two loads, as
    bitsandbytes' 8-bit parameters do not deep-copy."""
    models = []
    for _ in range(2):
        base = _load(checkpoint, kind)
        torch.manual_seed(0)
        config = peft.LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": "all-linear",
                                    "init_lora_weights": False, **lora})
        models.append(peft.get_peft_model(base, config, autocast_adapter_dtype=False).train())
    return models


@pytest.mark.parametrize("kind", KINDS)
def test_qlora_matches_peft_and_bitsandbytes(checkpoint, kind, spy):
    ours, theirs = _qlora(checkpoint, kind)
    summary = apply_lora(ours)
    assert (summary.linears, summary.gated_mlps, summary.qkv_groups, summary.left) == (14, 2, 2, {})
    assert summary.quantized == {kind[:3] if kind != "int8" else "int8": 14}
    _assert_same_step(ours, theirs, _ids())
    assert spy == FUSED


def test_qdora_matches_peft(checkpoint, spy):
    ours, theirs = _qlora(checkpoint, "nf4-double", use_dora=True)
    summary = apply_lora(ours)
    assert (summary.linears, summary.dora, summary.quantized) == (14, 14, {"nf4": 14})
    _assert_same_step(ours, theirs, _ids())
    assert spy == FUSED


def test_summary_line_counts_quantised_and_dora_layers(checkpoint, caplog):
    ours, _ = _qlora(checkpoint, "nf4", use_dora=True, target_modules=["q_proj", "v_proj", "embed_tokens"])
    with caplog.at_level(logging.INFO, logger="tigon"):
        apply_lora(ours)
    assert caplog.records[0].getMessage() == (
        "tigon: fused LoRA on 4 of 5 LoRA layers (0 of them as 0 gated MLPs); 4 on nf4 bases, 4 DoRA; "
        "left on PEFT's path: Embedding layer: 1"
    )


def test_other_compute_dtype_and_cpu_repacked_weights_stay_on_peft(checkpoint, spy):
    """A 4-bit base computes in its compute dtype, not in x's: x of another dtype takes PEFT's path
    (bitsandbytes' own casts); so does a weight bitsandbytes repacked for its CPU inference kernel."""
    ours, theirs = _qlora(checkpoint, "nf4")
    for model in (ours, theirs):
        for module in model.modules():
            if hasattr(module, "compute_dtype"):
                module.compute_dtype = torch.float16
    apply_lora(ours)
    ids = _ids()
    assert_close(ours(input_ids=ids).logits, theirs(input_ids=ids).logits, name="fp16 compute dtype")
    assert spy["lora_linear"] == spy["lora_linear_group"] == spy["lora_gated_mlp"] == 0

    layer = ours.base_model.model.model.layers[0].self_attn.o_proj
    layer.base_layer.weight.quant_state.packing_format_for_cpu = True
    assert "repacked" in active_adapter(layer)[1]


def test_patch_of_a_quantised_model_without_adapters(checkpoint):
    """No LoRA: norms, RoPE and the loss run tigon's kernels around bitsandbytes' linears."""
    ours, theirs = _load(checkpoint, "nf4"), _load(checkpoint, "nf4")
    patched = tigon.patch(ours)
    assert "rms_norm" in patched.applied and "linear_cross_entropy" in patched.applied
    ids = _ids()
    ours.train()
    theirs.train()
    loss, ref_loss = ours(input_ids=ids, labels=ids).loss, theirs(input_ids=ids, labels=ids).loss
    assert_close(loss, ref_loss, name="loss")
    ours.eval()
    theirs.eval()
    with torch.no_grad():
        assert_close(ours(input_ids=ids).logits, theirs(input_ids=ids).logits, name="eval logits")


@pytest.mark.gpu
@pytest.mark.parametrize("kind,dora", [("nf4-double", False), ("fp4", False), ("int8", False), ("nf4-double", True)])
def test_bf16_qlora_on_gpu_as_accurate_as_peft(tmp_path, kind, dora):
    """bf16 on a GPU: the fused path's error against an fp32 run of the same quantised weights is
    no worse than PEFT + bitsandbytes' (for int8 bitsandbytes also rounds the activations to int8,
    so tigon's dequantise-and-multiply is the more precise one)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                                      num_attention_heads=16, num_key_value_heads=4, vocab_size=1000)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    runs = {}
    for name, dtype in (("ours", torch.bfloat16), ("peft", torch.bfloat16), ("oracle", torch.float32)):
        base = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, quantization_config=_quantization(kind, dtype), dtype=dtype, device_map="cuda"
        )
        torch.manual_seed(1)
        lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False,
                               use_dora=dora)
        runs[name] = peft.get_peft_model(base, lora).train()
    summary = apply_lora(runs["ours"])
    assert summary.linears == 14 and summary.dora == (14 if dora else 0)
    ids = torch.randint(0, 1000, (4, 512), device="cuda")
    want, got, peft_got = (_run(runs[name], ids) for name in ("oracle", "ours", "peft"))

    def error(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    assert error(got[1], want[1]) <= 1.5 * error(peft_got[1], want[1]) + 1e-3
    assert error(got[0], want[0]) <= 1.5 * error(peft_got[0], want[0]) + 1e-3
    for name, w in want[2].items():
        assert error(got[2][name], w) <= 1.5 * error(peft_got[2][name], w) + 2e-3, name


def _checkpointed_step(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("switches", [{"offload_activations": True}, {"tiled_mlp": True},
                                      {"offload_activations": True, "tiled_mlp": True}])
def test_offload_and_tiled_mlp_on_a_4bit_base_take_the_same_step(checkpoint, switches, monkeypatch):
    """The long-context switches on QLoRA (NF4, double quantisation, checkpointing as `tigon sft
    --quant nf4 --gradient-checkpointing` prepares it): the checkpointed hidden states do go to
    the host, and loss and adapter gradients are the plain fused QLoRA step's (the tiled MLP's
    weight gradients are sums over chunks: equal up to rounding)."""
    from tigon.train.modeling import prepare_quantized

    opened = record_offload_sessions(monkeypatch)
    models = []
    for _ in range(2):
        base = _load(checkpoint, "nf4-double")
        prepare_quantized(base, gradient_checkpointing=True)  # frozen base, checkpointing on: before the adapters
        torch.manual_seed(0)
        lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
        models.append(peft.get_peft_model(base, lora, autocast_adapter_dtype=False).train())
    ids = torch.randint(0, VOCAB, (2, 37), generator=torch.Generator().manual_seed(3))  # 74 tokens > width 64: tiles
    tigon.patch(models[0])
    want = _checkpointed_step(models[0], ids)
    tigon.unpatch(models[0])
    applied = tigon.patch(models[1], **switches).applied
    got = _checkpointed_step(models[1], ids)
    assert all(name in applied for name in switches)
    assert not switches.get("offload_activations") or opened[0].offloaded >= 2
    assert_close(got[0], want[0], name="loss")
    assert want[1] and got[1].keys() == want[1].keys()
    for name in want[1]:
        assert_close(got[1][name], want[1][name], name=name)


@pytest.mark.gpu
def test_offload_and_tiled_mlp_on_a_4bit_base_in_bf16_on_gpu(tmp_path):
    """The same on the GPU in bf16 with the fused 4-bit path: offload gives the plain step's loss
    (the same bytes come back) and its gradients within the plain step's own run-to-run spread
    (the bf16 backward on the GPU is not bitwise reproducible: two plain steps differ), the tiled
    MLP within bf16 rounding, and together they hold the peak below the plain QLoRA step's at a
    length where the MLP's intermediates dominate."""
    from tigon.train.modeling import prepare_quantized

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=1000)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    ids = torch.randint(0, 1000, (1, 8192), device="cuda")
    runs = {}
    for switches in ({}, {"offload_activations": True}, {"offload_activations": True, "tiled_mlp": True}, {}):
        base = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, quantization_config=_quantization("nf4-double", torch.bfloat16), dtype=torch.bfloat16,
            device_map="cuda")
        prepare_quantized(base, gradient_checkpointing=True)
        torch.manual_seed(1)
        model = peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                          init_lora_weights=False)).train()
        tigon.patch(model, **switches)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        loss, grads = _checkpointed_step(model, ids)
        runs[tuple(switches) if tuple(switches) not in runs else "again"] = (
            loss, grads, torch.cuda.max_memory_allocated() - start)
        tigon.unpatch(model)
        del model, base
        torch.cuda.empty_cache()
    plain, offloaded, both = runs[()], runs[("offload_activations",)], runs[("offload_activations", "tiled_mlp")]
    assert torch.equal(offloaded[0], plain[0])

    def spread(other):  # the largest gradient difference, relative to the gradient's largest entry
        return max(((other[1][n] - plain[1][n]).abs().max() / plain[1][n].abs().max()).item() for n in plain[1])

    assert spread(offloaded) <= 3 * spread(runs["again"]), (spread(offloaded), spread(runs["again"]))
    assert_close(both[0], plain[0], torch.bfloat16, name="loss")  # per-chunk GEMMs may round differently
    assert both[2] < plain[2], (both[2], plain[2])


def test_qlora_follows_peft_and_bitsandbytes_for_20_adamw_steps(checkpoint):
    """Training, not one step: NF4 with double quantisation, tigon's fused ops against PEFT +
    bitsandbytes, AdamW on the same two alternating batches; every step's loss agrees to fp32
    rounding, and the adapters after the 20 updates agree closely."""
    ours, theirs = _qlora(checkpoint, "nf4-double")
    assert apply_lora(ours).quantized == {"nf4": 14}
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (ours, theirs)]
    torch.manual_seed(3)
    batches = [_ids(), _ids()]
    losses = []
    for step_index in range(20):
        ids = batches[step_index % 2]
        step = []
        for model, optimizer in zip((ours, theirs), optimizers):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step.append(loss.item())
        losses.append(step)
    ours_losses, theirs_losses = torch.tensor(losses).unbind(1)
    assert theirs_losses[-1] < theirs_losses[0] - 0.3  # it trains: the comparison is not of a flat line
    torch.testing.assert_close(ours_losses, theirs_losses, rtol=1e-5, atol=1e-5)
    # AdamW divides each update by its gradient's running scale: fp32 rounding in a small
    # gradient moves a weight by a whole step, so the adapters agree less tightly than the losses.
    trained = dict(theirs.named_parameters())
    for name, parameter in ours.named_parameters():
        if parameter.requires_grad:
            torch.testing.assert_close(parameter, trained[name], rtol=1e-3, atol=1e-4,
                                       msg=lambda message, name=name: f"{name}: {message}")
