"""`tigon sft --fp8` / `tigon rlhf --fp8`: the option, its refusals (one line, before anything
loads), FSDP2's detection, and a run end to end: on the CPU with the hardware check stood aside
(torch._scaled_mm runs there), on an FP8 GPU with CUDA graphs and gradient checkpointing."""

from __future__ import annotations

import json
import logging
import re
import sys

import pytest
import torch
from safetensors.torch import load_file

from tigon.cli import main
from tigon.patch import fp8
from tigon.train import tiny
from tigon.train.config import RLHFConfig, SFTConfig, SFTError, resolve, resolve_rlhf
from tests.patch.test_fp8 import fp8_anywhere  # noqa: F401  (a fixture)
from tests.train.test_config import parse

pytest.importorskip("torchao")
pytest.importorskip("peft")

SHORT = ["--dataset", f"{tiny.BUNDLED_DATASET}#40", "--batch-size", "4", "--max-length", "48", "--samples", "0"]


def test_the_option_and_its_config_file_key(tmp_path):
    cfg, given = parse(["--fp8", "rowwise"])
    assert cfg.fp8 == "rowwise" and given == {"fp8"}
    assert parse([])[0].fp8 is None
    bad = tmp_path / "run.yaml"
    bad.write_text("fp8: blockwise\n")
    with pytest.raises(SFTError, match="fp8 must be one of tensorwise, rowwise, got 'blockwise'"):
        parse(["--config", str(bad)])


def test_refused_on_the_cpu_naming_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a GPU machine runs this test too
    with pytest.raises(SFTError) as err:
        resolve(SFTConfig(fp8="tensorwise"))
    assert str(err.value) == ("--fp8 tensorwise: FP8 matmuls need a CUDA GPU of compute capability >= 8.9 (Ada, "
                              "Hopper or newer), and here is only the CPU (no CUDA GPU is visible): train without --fp8")


def test_refused_on_a_gpu_without_fp8_naming_it_and_its_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A10")
    with pytest.raises(SFTError) as err:
        resolve_rlhf(RLHFConfig(fp8="rowwise"))
    assert str(err.value) == ("--fp8 rowwise: FP8 matmuls need compute capability >= 8.9 (Ada, Hopper or newer); "
                              "cuda:0 (NVIDIA A10) has 8.6: train without --fp8")


@pytest.mark.parametrize("changes, message", [
    (dict(model="some/model"), "--fp8 rowwise: FP8 linears train the full model's weights: add --tuner full "
                               "(LoRA on an FP8 base is --quant fp8)"),
    (dict(tuner="lora"), "--fp8 rowwise: FP8 linears train the full model's weights"),
    (dict(kernels=False), "--fp8 rowwise: applied by tigon.patch, which --no-kernels turns off"),
    (dict(dtype="fp32"), "--fp8 rowwise: FP8 training keeps bf16 weights, not --dtype fp32: use --dtype bf16"),
])
def test_settings_that_would_not_train_in_fp8_are_refused(fp8_anywhere, changes, message):
    with pytest.raises(SFTError, match="^" + re.escape(message)):
        resolve(SFTConfig(fp8="rowwise", **changes))


def test_missing_torchao_names_the_extra(fp8_anywhere, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(SFTError) as err:
        resolve(SFTConfig(fp8="rowwise"))
    assert str(err.value) == ("--fp8 rowwise: FP8 training runs through torchao, which is not installed: "
                              "pip install 'tigon[fp8]'")


def test_fp8_trains_bf16_weights_the_builtin_model_too(fp8_anywhere):
    assert resolve(SFTConfig(fp8="tensorwise")).dtype == "bf16"
    assert resolve(SFTConfig(fp8="tensorwise", model="m", tuner="full", dtype="bf16")).dtype == "bf16"
    assert resolve_rlhf(RLHFConfig(fp8="rowwise")).dtype == "bf16"
    assert resolve_rlhf(RLHFConfig()).dtype == "fp32"  # the built-in model's own default, without --fp8


@pytest.mark.parametrize("command", ["sft", "rlhf"])
def test_the_cli_refuses_in_one_line(command, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([command, "--fp8", "rowwise"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"tigon {command}: error: --fp8 rowwise: FP8 matmuls need a CUDA GPU of compute capability >= 8.9 "
                   "(Ada, Hopper or newer), and here is only the CPU (no CUDA GPU is visible): train without --fp8"]


def test_fsdp2_is_told_from_accelerate_and_from_the_trainer_arguments(monkeypatch):
    from types import SimpleNamespace

    from tigon.train.run import _fsdp2

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert not _fsdp2(SimpleNamespace(fsdp="", fsdp_config={}))
    assert _fsdp2(SimpleNamespace(fsdp="full_shard", fsdp_config={"version": 2}))
    assert not _fsdp2(SimpleNamespace(fsdp="full_shard", fsdp_config={"version": 1}))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert _fsdp2(SimpleNamespace(fsdp="", fsdp_config={}))
    monkeypatch.setenv("FSDP_VERSION", "1")
    assert not _fsdp2(SimpleNamespace(fsdp="", fsdp_config={}))


def _losses(out):
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _scaled_mm_by_dequantising(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, **_):
    """torch._scaled_mm's product, ``(a · scale_a) @ (b · scale_b)`` in fp32: the CPU's own op takes
    about a tenth of a second per tiny GEMM, minutes for a short run."""
    out = (a.float() * scale_a) @ (b.float() * scale_b)
    return (out if bias is None else out + bias).to(out_dtype or a.dtype)


def test_sft_fp8_trains_and_saves_plain_bf16_weights(fp8_anywhere, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_by_dequantising)
    with caplog.at_level(logging.INFO, logger="tigon"):
        assert main(["sft", *SHORT, "--fp8", "tensorwise", "--max-steps", "4", "--lr", "3e-3",
                     "--output-dir", str(tmp_path / "fp8")]) == 0
    assert [r for r in caplog.records if "fp8 tensorwise (28 linears) to LlamaForCausalLM" in r.getMessage()]
    assert main(["sft", *SHORT, "--dtype", "bf16", "--max-steps", "4", "--lr", "3e-3",
                 "--output-dir", str(tmp_path / "bf16")]) == 0
    assert _losses(tmp_path / "fp8") == pytest.approx(_losses(tmp_path / "bf16"), rel=0.02)
    saved, plain = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("fp8", "bf16"))
    assert set(saved) == set(plain) and {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert "quantization_config" not in (tmp_path / "fp8" / "final" / "config.json").read_text()


# --- on an FP8 GPU -----------------------------------------------------------------------------

def _fp8_gpu():
    if not torch.cuda.is_available() or fp8.unsupported() is not None:
        pytest.skip(fp8.unsupported() or "needs a CUDA GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", fp8.RECIPES)
@pytest.mark.parametrize("extra", [["--cuda-graphs"], ["--gradient-checkpointing"]], ids=["graphs", "checkpointing"])
def test_gpu_sft_fp8_follows_bf16(tmp_path, recipe, extra):
    """`tigon sft --fp8` on a GPU that has FP8, replayed from CUDA graphs or under gradient
    checkpointing: 8 steps within 3% of the same bf16 run's, and a final/ of plain bf16 weights."""
    _fp8_gpu()
    from tests.train.test_sft import _saved_llama

    model = _saved_llama(tmp_path / "m", hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                         num_attention_heads=4)
    args = ["--model", model, "--tuner", "full", "--dtype", "bf16", "--lr", "1e-3", "--packing", "--max-length", "256",
            "--batch-size", "4", "--max-steps", "8", "--save-steps", "0", "--samples", "0",
            "--dataset", str(tiny.BUNDLED_DATASET), *extra]
    assert main(["sft", *args, "--output-dir", str(tmp_path / "bf16")]) == 0
    assert main(["sft", *args, "--output-dir", str(tmp_path / "fp8"), "--fp8", recipe]) == 0
    assert _losses(tmp_path / "fp8") == pytest.approx(_losses(tmp_path / "bf16"), rel=3e-2)
    saved = load_file(tmp_path / "fp8" / "final" / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}


@pytest.mark.gpu
def test_gpu_rlhf_fp8_trains(tmp_path, caplog):
    """`tigon rlhf --fp8` (DPO on the built-in model): the policy's linears in FP8, the frozen
    reference's not; the run ends with a finite loss."""
    _fp8_gpu()
    pytest.importorskip("trl")
    with caplog.at_level(logging.INFO, logger="tigon"):
        assert main(["rlhf", "--fp8", "rowwise", "--max-steps", "4", "--samples", "0",
                     "--output-dir", str(tmp_path)]) == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tigon: applied")]
    assert any("fp8 rowwise" in line for line in lines)
    assert not any("fp8" in line for line in lines if "frozen reference" in line)
    assert all(loss == loss for loss in _losses(tmp_path))


def test_apply_kernels_converts_the_trained_model_only_and_never_trains_unpatched(fp8_anywhere):
    from transformers import GPT2Config, GPT2LMHeadModel

    from tigon.train.modeling import apply_kernels
    from tests.patch.tiny import tiny_model

    cfg = SFTConfig(fp8="tensorwise")
    reference = tiny_model("llama", 0, dtype=torch.bfloat16, intermediate_size=96)
    assert "fp8" not in apply_kernels(reference, cfg, role="the frozen reference")
    policy = tiny_model("llama", 0, dtype=torch.bfloat16, intermediate_size=96)
    assert "fp8 tensorwise (14 linears)" in apply_kernels(policy, cfg)
    # A family tigon.patch lacks trains unpatched without --fp8, with it is refused.
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    assert apply_kernels(gpt2, SFTConfig()).startswith("tigon: kernels off: tigon.patch does not support")
    with pytest.raises(SFTError, match="^--fp8 tensorwise: tigon.patch does not support model_type 'gpt2'"):
        apply_kernels(gpt2, cfg)
