"""`tigon sft --quant fp8`: LoRA on an FP8 base. The flag's refusals, a run on the built-in model
(the FP8 ops' reference on the CPU, by explicit opt-in) and its merge, and loading an FP8
checkpoint in Hugging Face's block-scaled layout without dequantising it."""

import json
import logging

import pytest
import torch

from tigon.cli import main
from tigon.nn import Fp8Linear
from tigon.ops import Fp8Weight, dequantize_fp8
from tigon.train import tiny
from tigon.train.config import SFTError
from tigon.train.modeling import FP8_EMULATE, QUANT_FILE, check_fp8, fp8_checkpoint, load_fp8_checkpoint

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

SHORT = ["--dataset", f"{tiny.BUNDLED_DATASET}#8", "--batch-size", "2", "--max-length", "32", "--samples", "0",
         "--save-steps", "0", "--max-steps", "2", "--lr", "2e-2", "--no-kernels"]
BLOCK = 128
# The flows a machine without an FP8 GPU takes (refusal, the emulated reference, transformers'
# own dequantisation of an FP8 checkpoint); a GPU machine runs the gpu-marked tests instead.
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the flow of a machine without a GPU")


@cpu_only
def test_fp8_is_refused_where_there_is_no_fp8(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(FP8_EMULATE, raising=False)
    assert main(["sft", *SHORT, "--quant", "fp8", "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == ("tigon sft: error: --quant fp8: this run is on the cpu, which has no FP8 GEMMs: it needs a GPU of "
                   f"compute capability 8.9+ ({FP8_EMULATE}=1 runs the dequantised reference, for tests)\n")
    assert not (tmp_path / "out").exists()

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(SFTError, match=r"^--quant fp8: NVIDIA A100-SXM4-80GB has compute capability 8\.0; FP8 GEMMs "
                                       r"need 8\.9\+ \(Ada, Hopper or newer\): use --quant nf4 \(QLoRA\) on this GPU$"):
        check_fp8(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8(torch.device("cuda", 0))  # an H100 / H200 is let through, in bf16
    with pytest.raises(SFTError, match=r"^--quant fp8 computes in bfloat16 \(what FP8 GEMMs write\), not float16: "):
        check_fp8(torch.device("cuda", 0), torch.float16)


def test_fp8_with_full_tuning_is_refused(tmp_path, capsys):
    assert main(["sft", *SHORT, "--quant", "fp8", "--tuner", "full", "--output-dir", str(tmp_path / "o")]) == 2
    assert "--quant fp8 with --tuner full: quantised weights cannot be trained" in capsys.readouterr().err


@cpu_only
def test_sft_on_an_fp8_base_trains_and_merges_to_bf16(tmp_path, caplog, monkeypatch):
    """Two steps of LoRA on the built-in model's FP8 base, then `tigon merge`: the merged bf16
    model is the adapter on the dequantised FP8 base (not on the original weights)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tigon.nn.fp8 import quantize_linears

    monkeypatch.setenv(FP8_EMULATE, "1")
    caplog.set_level(logging.INFO)
    out = tmp_path / "run"
    assert main(["sft", *SHORT, "--quant", "fp8", "--lora-rank", "4", "--output-dir", str(out)]) == 0
    assert "(base fp8), QLoRA tuning" in caplog.text
    adapter = out / "final"
    assert json.loads((adapter / QUANT_FILE).read_text())["quantization_config"] == {"quant_method": "fp8",
                                                                                     "dtype": "float32"}
    losses = [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))

    assert main(["merge", str(adapter), "--output", str(tmp_path / "merged")]) == 0
    assert "dequantised the fp8 base (tigon)" in caplog.text
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert merged.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    fp8_base = AutoModelForCausalLM.from_pretrained(out / "base")
    quantize_linears(fp8_base)
    on_fp8 = PeftModel.from_pretrained(fp8_base, adapter).eval()
    on_original = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base"), adapter).eval()
    ids = torch.randint(4, merged.config.vocab_size, (1, 11))
    with torch.no_grad():
        want = on_fp8(input_ids=ids).logits
        got = merged.float()(input_ids=ids).logits
        off = (on_original(input_ids=ids).logits - want).abs().max()
        assert (got - want).abs().max() < off / 2  # merged onto the FP8 base's weights, not the original


def _block_quantize(weight):
    """`weight` as HF's FP8 checkpoints store it: e4m3 payloads and one fp32 multiplier per
    128x128 block (`weight_scale_inv`), the block's absmax over 448."""
    rows, cols = weight.shape
    blocks = (-(-rows // BLOCK), -(-cols // BLOCK))
    scale = torch.empty(blocks)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(blocks[0]):
        for j in range(blocks[1]):
            part = weight[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            scale[i, j] = part.abs().max() / 448
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (part / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


@pytest.fixture(scope="module")
def fp8_checkpoint_dir(tmp_path_factory):
    """A tiny Llama saved as an FP8 checkpoint: its decoder linears block-quantised (an
    width of 256 makes two blocks of a row; whole blocks, as transformers' own dequantisation assumes),
    with transformers' fp8 quantization_config."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from tigon.train.data import load_samples

    tokenizer = tiny.build_tokenizer(load_samples([f"{tiny.BUNDLED_DATASET}#8"], 0))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("fp8-llama")
    state = {}
    for name, tensor in model.state_dict().items():
        if ".layers." in name and name.endswith("proj.weight"):
            state[name], state[name + "_scale_inv"] = _block_quantize(tensor)
        else:
            state[name] = tensor.to(torch.bfloat16)
    config.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": ["lm_head"]}
    config.save_pretrained(path)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(path)
    return path, state


@cpu_only
def test_fp8_checkpoint_loads_its_fp8_weights_as_they_are(fp8_checkpoint_dir):
    path, state = fp8_checkpoint_dir
    assert fp8_checkpoint(str(path))["weight_block_size"] == [BLOCK, BLOCK]
    model = load_fp8_checkpoint(str(path), torch.float32, torch.device("cpu"))
    down = model.model.layers[1].mlp.down_proj
    assert type(down) is Fp8Linear and down.block_size == (BLOCK, BLOCK)
    assert down.weight.dtype == torch.float8_e4m3fn and down.weight_scale_inv.shape == (1, 2)
    for name, module in model.named_modules():
        if type(module) is Fp8Linear:
            assert torch.equal(module.weight.view(torch.uint8), state[name + ".weight"].view(torch.uint8))
            assert torch.equal(module.weight_scale_inv, state[name + ".weight_scale_inv"])
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.float32

    # transformers dequantises the same checkpoint itself on a machine without an FP8 GPU: its
    # weights are ours, dequantised.
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for name, module in model.named_modules():
        if type(module) is Fp8Linear:
            want = theirs.get_submodule(name).weight
            torch.testing.assert_close(module.dequantize(want.dtype), want, rtol=1e-2, atol=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, theirs(input_ids=ids).logits, rtol=2e-2, atol=2e-2)


def test_fp8_checkpoint_block_scales_dequantise_per_block(fp8_checkpoint_dir):
    """down_proj (128 x 256) has two blocks along a row, up_proj (256 x 128) two down a column."""
    _, state = fp8_checkpoint_dir
    for name, halves in (("model.layers.0.mlp.down_proj", lambda t, i: t[:, i * BLOCK:(i + 1) * BLOCK]),
                         ("model.layers.0.mlp.up_proj", lambda t, i: t[i * BLOCK:(i + 1) * BLOCK])):
        data, scale = state[name + ".weight"], state[name + ".weight_scale_inv"]
        dense = dequantize_fp8(Fp8Weight(data, scale, (BLOCK, BLOCK)), torch.float32)
        for i in range(2):
            assert torch.equal(halves(dense, i), halves(data, i).float() * scale.view(-1)[i])


def test_an_fp8_checkpoint_needs_the_flag(fp8_checkpoint_dir, tmp_path, capsys):
    path, _ = fp8_checkpoint_dir
    assert main(["sft", *SHORT, "--model", str(path), "--output-dir", str(tmp_path / "o")]) == 2
    assert "is an FP8 checkpoint (quantization_config fp8): train LoRA on its FP8 weights with --quant fp8" in (
        capsys.readouterr().err)


@cpu_only
def test_sft_on_an_fp8_checkpoint(fp8_checkpoint_dir, tmp_path, caplog, monkeypatch):
    path, _ = fp8_checkpoint_dir
    monkeypatch.setenv(FP8_EMULATE, "1")
    caplog.set_level(logging.INFO)
    out = tmp_path / "run"
    assert main(["sft", *SHORT, "--model", str(path), "--quant", "fp8", "--dtype", "fp32", "--output-dir", str(out)]) == 0
    assert "(base fp8), QLoRA tuning" in caplog.text
    assert (out / "final" / "adapter_model.safetensors").is_file()


@cpu_only
def test_rlhf_takes_quant_fp8_and_refuses_it_alike(fp8_checkpoint_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(FP8_EMULATE, raising=False)
    path, _ = fp8_checkpoint_dir
    assert main(["rlhf", "--model", str(path), "--max-steps", "1", "--quant", "fp8", "--no-kernels",
                 "--output-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("tigon rlhf: error: --quant fp8: this run is on the cpu, which has no FP8")


@pytest.mark.gpu
def test_sft_quant_fp8_trains_on_the_gpu_and_merges(tmp_path, caplog):
    """`tigon sft --quant fp8` on the built-in model with tigon's kernels on an FP8 GPU: every LoRA
    layer fused on its FP8 base, a finite loss, and `tigon merge` writes bf16."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU of compute capability 8.9+")
    caplog.set_level(logging.INFO)
    out = tmp_path / "run"
    short = [arg for arg in SHORT if arg != "--no-kernels"]
    assert main(["sft", *short, "--quant", "fp8", "--output-dir", str(out)]) == 0
    assert "(base fp8), QLoRA tuning" in caplog.text and " on fp8 bases" in caplog.text
    losses = [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert main(["merge", str(out / "final"), "--output", str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16


def test_an_fp8_base_computes_in_bf16_on_the_built_in_model_too(monkeypatch):
    """--dtype auto is fp32 for the built-in model, but an FP8 base's GEMMs write bf16: on a GPU
    auto picks bf16 there (the H100 run of `tigon sft --quant fp8` on the built-in model was
    refused for fp32); on a CPU (the emulated reference) it stays fp32."""
    from tigon.train.config import SFTConfig
    from tigon.train.run import run_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_dtype(SFTConfig(quant="fp8")) == torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert run_dtype(SFTConfig(quant="fp8")) == torch.bfloat16
    assert run_dtype(SFTConfig()) == torch.float32
    assert run_dtype(SFTConfig(quant="fp8", dtype="fp32")) == torch.float32  # asked for: refused later by name
