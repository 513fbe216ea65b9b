import argparse
import json

import pytest

from tigon.train.config import SFTConfig, SFTError, add_sft_arguments, config_from_args, resolve


def parse(argv):
    parser = argparse.ArgumentParser()
    add_sft_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_options_absent_from_the_command_line_keep_their_defaults():
    cfg, given = parse(["--lora-rank", "4", "--no-packing", "--kernels-off", "rope,swiglu", "--resume"])
    assert given == {"lora_rank", "packing", "kernels_off", "resume"}
    assert cfg == SFTConfig(lora_rank=4, packing=False, kernels_off=["rope", "swiglu"], resume="latest")


def test_command_line_overrides_config_file(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("model: some/model\nlora-rank: 8\nlr: 1e-4\ndataset: a.jsonl\npacking: true\n"
                         "kernels_off: rope, swiglu\n")
    cfg, given = parse(["--config", str(yaml_file), "--lora-rank", "32", "--dataset", "b.jsonl", "c.csv#10"])
    assert (cfg.model, cfg.lora_rank, cfg.lr, cfg.packing) == ("some/model", 32, 1e-4, True)
    assert cfg.dataset == ["b.jsonl", "c.csv#10"]
    assert cfg.kernels_off == ["rope", "swiglu"]
    assert given == {"model", "lora_rank", "lr", "dataset", "packing", "kernels_off"}

    json_file = tmp_path / "run.json"
    json_file.write_text(json.dumps({"max_steps": 7, "kernels": False, "resume": True, "model": None}))
    cfg, _ = parse(["--config", str(json_file), "--kernels"])
    assert (cfg.max_steps, cfg.kernels, cfg.resume, cfg.model) == (7, True, "latest", None)


@pytest.mark.parametrize("text, message", [
    ("colour: red\n", "unknown setting 'colour'"),
    ("lora_rank: eight\n", "lora_rank must be int"),
    ("max_steps: 2.5\n", "max_steps must be an integer"),
    ("packing: maybe\n", "packing must be true or false"),
    ("tuner: qlora\n", "tuner must be one of lora, full"),
    ("lora_rank:\n", "lora_rank needs a value"),
    ("- a\n- b\n", "expected a mapping"),
    ("model: [unclosed\n", "not valid YAML"),
])
def test_bad_config_file_names_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SFTError, match=message.replace("[", r"\[")):
        parse(["--config", str(path)])


def test_missing_config_file():
    with pytest.raises(SFTError, match="config file not found: nowhere.yaml"):
        parse(["--config", "nowhere.yaml"])


def test_defaults_depend_on_builtin_or_real_model():
    builtin = resolve(SFTConfig())
    real = resolve(SFTConfig(model="m"))
    assert (builtin.tuner, real.tuner) == ("full", "lora")
    assert resolve(SFTConfig(quant="nf4")).tuner == "lora"  # a quantised built-in model is QLoRA-tuned
    assert builtin.max_length < real.max_length and builtin.lr > real.lr
    assert resolve(SFTConfig(model="m", tuner="full")).lr < real.lr
    assert real.lora_alpha == 2 * real.lora_rank
    explicit = resolve(SFTConfig(model="m", lr=0.5, epochs=2, batch_size=3, max_length=9, lora_alpha=5))
    assert (explicit.lr, explicit.epochs, explicit.batch_size, explicit.max_length, explicit.lora_alpha) == (0.5, 2, 3, 9, 5)


@pytest.mark.parametrize("changes, given, message", [
    ({"eval_split": 0.1, "eval_dataset": ["e.jsonl"]}, set(), "--eval-split and --eval-dataset are incompatible"),
    ({"tuner": "full", "lora_rank": 4}, {"tuner", "lora_rank"}, "--lora-rank: only for --tuner lora"),
    ({"tuner": "full", "dtype": "fp16"}, set(), "--dtype fp16 cannot be used with --tuner full"),
    ({"resume": "latest", "overwrite": True}, set(), "--resume and --overwrite are incompatible"),
    ({"kernels": False, "kernels_off": ["rope"]}, set(), "--kernels-off has no effect with --no-kernels"),
    ({"kernels": False, "recompute_mlp": True}, set(), "^--recompute-mlp: applied by tigon.patch, which --no-kernels"),
    ({"kernels_off": ["rope", "warp_drive"]}, set(), "--kernels-off: unknown kernel\\(s\\) warp_drive; choose from rms_norm"),
    ({"lr": 0.0}, set(), "--lr must be > 0"),
    ({"batch_size": -1}, set(), "--batch-size must be > 0"),
    ({"epochs": 0.0}, set(), "--epochs must be > 0"),
    ({"lora_dropout": 1.0}, set(), r"--lora-dropout must be in \[0, 1\)"),
    ({"eval_split": 1.5}, set(), r"--eval-split must be in \[0, 1\)"),
    ({"save_limit": 0}, set(), "--save-limit must be >= 1"),
    ({"warmup": -1.0}, set(), "--warmup must be >= 0"),
    ({"tuner": "full", "quant": "nf4"}, {"tuner", "quant"}, "--quant nf4 with --tuner full: quantised weights cannot"),
    ({"tuner": "full", "lora_variant": "dora"}, {"tuner", "lora_variant"}, "--lora-variant: only for --tuner lora"),
    ({"loraplus_lr_ratio": 0.0}, set(), "--loraplus-lr-ratio must be > 0"),
    ({"neftune_alpha": -5.0}, set(), "--neftune-alpha must be > 0"),
    ({"init_lora_weights": "pissa", "quant": "nf4"}, set(), "--init-lora-weights pissa rewrites the base weights"),
    ({"init_lora_weights": "loftq"}, set(), "--init-lora-weights loftq .* add --quant nf4"),
    ({"init_lora_weights": "loftq", "quant": "int8"}, set(), "--init-lora-weights loftq .* add --quant nf4"),
    ({"init_lora_weights": "loftq", "quant": "nf4", "lora_variant": "dora"}, set(),
     "--init-lora-weights loftq with --lora-variant dora"),
])
def test_incompatible_or_bad_settings(changes, given, message):
    with pytest.raises(SFTError, match=message):
        resolve(SFTConfig(model="m", **changes), given)


def test_config_file_that_is_not_utf8_names_the_byte(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"\xef\xbb\xbfmodel: m\nlr: 1e-4  # \xe9\n")
    with pytest.raises(SFTError, match=f"{path}: not UTF-8 text at byte 24 \\(line 2\\)"):
        parse(["--config", str(path)])
    path.write_bytes(b"\xef\xbb\xbfmodel: m\nlr: 1e-4\n")  # a byte-order mark alone is fine
    assert parse(["--config", str(path)])[0].lr == 1e-4


def test_tracker_that_is_not_installed_names_the_pip_install(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    message = r"^--report-to wandb: the wandb package is not installed \(pip install wandb\)$"
    with pytest.raises(SFTError, match=message):
        resolve(SFTConfig(report_to="wandb"))
    assert resolve(SFTConfig(report_to="none")).report_to == "none"


def test_cuda_graphs_is_refused_where_steps_cannot_be_captured(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SFTError, match="^--cuda-graphs needs a CUDA GPU and none is visible"):
        resolve(SFTConfig(cuda_graphs=True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SFTError, match="^--cuda-graphs runs on one GPU, one process"):
        resolve(SFTConfig(cuda_graphs=True))
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SFTError, match="^--cuda-graphs cannot capture --offload-activations"):
        resolve(SFTConfig(cuda_graphs=True, gradient_checkpointing=True, offload_activations=True))
    assert resolve(SFTConfig(cuda_graphs=True, packing=True)).cuda_graphs


def test_cuda_graphs_option_is_taken_by_sft_and_rlhf_and_compiles_nothing(tmp_path):
    """--cuda-graphs captures the eager patched step (tigon.cuda_graphs): the Trainer is not
    asked to torch.compile the model."""
    import torch

    from tigon.train.config import RLHFConfig
    from tigon.train.run import training_arguments

    cfg, given = parse(["--cuda-graphs", "--packing", "--output-dir", str(tmp_path)])
    assert cfg.cuda_graphs and "cuda_graphs" in given
    assert not training_arguments(cfg, torch.float32, False).torch_compile
    parser = argparse.ArgumentParser()
    add_sft_arguments(parser, RLHFConfig)
    rlhf = parser.parse_args(["--cuda-graphs", "--method", "dpo"])
    assert rlhf.cuda_graphs
    cfg = RLHFConfig(cuda_graphs=True, method="dpo", output_dir=str(tmp_path))
    assert not training_arguments(cfg, torch.float32, False).torch_compile


@pytest.mark.parametrize("method", ["grpo", "gkd"])
def test_cuda_graphs_refuses_the_online_rlhf_methods(monkeypatch, method):
    import torch

    from tigon.train.config import RLHFConfig, resolve_rlhf

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the method is what is refused
    with pytest.raises(SFTError, match=f"^--cuda-graphs: --method {method} generates completions in every step"):
        resolve_rlhf(RLHFConfig(cuda_graphs=True, method=method))
    assert resolve_rlhf(RLHFConfig(cuda_graphs=True, method="kto")).cuda_graphs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SFTError, match="^--cuda-graphs needs a CUDA GPU"):
        resolve_rlhf(RLHFConfig(cuda_graphs=True, method="dpo"))


def test_quant_without_bitsandbytes_names_the_pip_install(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a))
    with pytest.raises(SFTError, match=r"^--quant int8: bitsandbytes is not installed \(pip install bitsandbytes\)$"):
        resolve(SFTConfig(model="m", quant="int8"))
    assert resolve(SFTConfig(model="m")).quant is None
