"""`tigon sft --quant` (QLoRA, on bitsandbytes' CPU backend here) and the PEFT-variant flags: each
reaches PEFT or the Trainer, a QLoRA run trains, and its adapter merges onto the dequantised base."""

import json
import logging

import pytest
import torch

from tigon.cli import main
from tigon.train import tiny
from tigon.train.config import SFTConfig, SFTError, resolve
from tigon.train.modeling import QUANT_FILE, add_lora, lora_config, loraplus_optimizer
from tigon.train.run import training_arguments

pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is in the dev extra (pip install -e '.[dev]')")

SHORT = ["--dataset", f"{tiny.BUNDLED_DATASET}#8", "--batch-size", "2", "--max-length", "32", "--samples", "0",
         "--save-steps", "0", "--max-steps", "2", "--lr", "2e-2", "--no-kernels"]


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


@pytest.mark.parametrize("changes, want", [
    ({}, {"use_dora": False, "use_rslora": False, "init_lora_weights": True}),
    ({"lora_variant": "dora", "use_rslora": True}, {"use_dora": True, "use_rslora": True}),
    ({"init_lora_weights": "gaussian"}, {"init_lora_weights": "gaussian"}),
    ({"init_lora_weights": "pissa"}, {"init_lora_weights": "pissa"}),
    ({"init_lora_weights": "olora"}, {"init_lora_weights": "olora"}),
    # LoftQ is applied after PEFT's own initialisation (replace_lora_weights_loftq), not through the config
    ({"init_lora_weights": "loftq", "quant": "nf4"}, {"init_lora_weights": True}),
])
def test_variant_flags_reach_peft_config(changes, want):
    cfg = resolve(SFTConfig(model="m", lora_rank=5, **changes))
    config = lora_config(cfg)
    assert {k: getattr(config, k) for k in want} == want
    assert (config.r, config.lora_alpha) == (5, 10)


def test_dora_and_rslora_build_peft_dora_layers_with_rslora_scaling():
    cfg = resolve(SFTConfig(model="m", lora_rank=4, lora_alpha=6, lora_variant="dora", use_rslora=True,
                            target_modules="q_proj"))
    model = add_lora(tiny_llama(), cfg)
    (layer,) = [m for n, m in model.named_modules() if n.endswith("q_proj")]
    assert "default" in layer.lora_magnitude_vector
    assert layer.scaling["default"] == pytest.approx(6 / 4 ** 0.5)


def test_loftq_off_cuda_is_one_line():
    cfg = resolve(SFTConfig(model="m", quant="nf4", init_lora_weights="loftq"))
    with pytest.raises(SFTError, match=r"^--init-lora-weights loftq needs a CUDA GPU .* the model is on cpu$"):
        add_lora(tiny_llama(), cfg)


def test_loraplus_puts_b_matrices_at_ratio_times_the_rate(tmp_path):
    cfg = resolve(SFTConfig(model="m", lr=1e-3, weight_decay=0.01, loraplus_lr_ratio=16.0, output_dir=tmp_path))
    model = add_lora(tiny_llama(), cfg)
    optimizer = loraplus_optimizer(model, training_arguments(cfg, torch.float32, False), cfg.loraplus_lr_ratio)
    rate = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    names = {n: rate[id(p)] for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(r == pytest.approx(16e-3 if ".lora_B." in n else 1e-3) for n, r in names.items())


def test_neftune_reaches_the_trainer(tmp_path):
    args = training_arguments(resolve(SFTConfig(model="m", neftune_alpha=5.0, output_dir=tmp_path)), torch.float32, False)
    assert args.neftune_noise_alpha == 5.0
    assert training_arguments(resolve(SFTConfig(model="m", output_dir=tmp_path)), torch.float32, False).neftune_noise_alpha is None


def test_qlora_dora_run_trains_on_a_4bit_base_and_merges_dequantised(tmp_path, caplog):
    """The built-in model QDoRA-tuned on an nf4 base for two steps (on bitsandbytes' CPU backend),
    then `tigon merge`: the merged bf16 model computes what PEFT computes from the adapter on the
    dequantised base, which differs from what it computes on the original weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    caplog.set_level(logging.INFO)
    out = tmp_path / "run"
    assert main(["sft", *SHORT, "--quant", "nf4", "--lora-variant", "dora", "--lora-rank", "4",
                 "--output-dir", str(out)]) == 0
    assert "(base nf4, bitsandbytes), QDoRA tuning" in caplog.text
    adapter = out / "final"
    recorded = json.loads((adapter / QUANT_FILE).read_text())["quantization_config"]
    assert (recorded["bnb_4bit_quant_type"], recorded["bnb_4bit_use_double_quant"]) == ("nf4", True)
    losses = [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))

    assert main(["merge", str(adapter), "--output", str(tmp_path / "merged")]) == 0
    assert "dequantised the nf4 base (bitsandbytes)" in caplog.text
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert merged.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    quantized = AutoModelForCausalLM.from_pretrained(out / "base", quantization_config=bnb_config(), device_map="cpu")
    on_dequantized = PeftModel.from_pretrained(quantized.dequantize(dtype=torch.float32), adapter).eval()
    on_original = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base"), adapter).eval()
    ids = torch.randint(4, merged.config.vocab_size, (1, 11))
    with torch.no_grad():
        want = on_dequantized(input_ids=ids).logits
        got = merged.float()(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)  # the merged weights are stored in bf16
        off = (on_original(input_ids=ids).logits - want).abs().max()
        assert (got - want).abs().max() < off / 2  # merged onto the dequantised base, not the original


def bnb_config():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32)


def test_bitsandbytes_that_cannot_run_is_one_line(tmp_path, capsys, monkeypatch):
    def unsupported(*args, **kwargs):
        raise RuntimeError("no kernel image for this device\nmore detail")

    monkeypatch.setattr(bnb.functional, "quantize_4bit", unsupported)
    assert main(["sft", *SHORT, "--quant", "fp4", "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == "tigon sft: error: --quant fp4: bitsandbytes cannot run on this machine (cpu): no kernel image for this device\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_gpu_qlora_kernels_train_like_peft_bitsandbytes(tmp_path, quant):
    """On the GPU in bf16: the fused LoRA ops on a quantised base take PEFT + bitsandbytes' steps."""
    args = [*SHORT[:-1], "--quant", quant, "--dtype", "bf16", "--max-steps", "4", "--batch-size", "4",
            "--max-length", "128", "--dataset", f"{tiny.BUNDLED_DATASET}#32"]
    assert main(["sft", *args, "--no-kernels", "--output-dir", str(tmp_path / "off")]) == 0
    assert main(["sft", *args, "--output-dir", str(tmp_path / "on")]) == 0
    off, on = ([r["loss"] for r in map(json.loads, (tmp_path / d / "metrics.jsonl").read_text().splitlines())
                if "loss" in r] for d in ("off", "on"))
    assert len(off) == len(on) == 4
    torch.testing.assert_close(torch.tensor(on), torch.tensor(off), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_loftq_starts_from_the_quantisation_error(tmp_path):
    """--init-lora-weights loftq on an nf4 base: the adapters start non-zero (fitted to W - dequant(W))."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    assert main(["sft", *SHORT[:-1], "--quant", "nf4", "--init-lora-weights", "loftq", "--max-steps", "1",
                 "--lr", "1e-9", "--output-dir", str(out)]) == 0
    saved = load_file(out / "final" / "adapter_model.safetensors")
    b = [v for k, v in saved.items() if "lora_B" in k]
    assert b and all(v.abs().max() > 1e-4 for v in b)  # PEFT starts B at zero, and --lr 1e-9 moves it ~1e-9
