import pytest
import torch

from tigon.cli import main
from tigon.serve import loading


def test_no_path_serves_the_demo_model_training_it_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    calls = []

    def fake_run_sft(cfg, given):
        calls.append((cfg, given))
        (tmp_path / "demo-out" / "final").mkdir(parents=True)

    monkeypatch.setattr("tigon.train.run_sft", fake_run_sft)
    assert loading.resolve_model_path(None) == "demo-out/final"
    (cfg, given), = calls
    assert cfg.output_dir == "demo-out" and cfg.model is None and cfg.dataset is None and given == {"output_dir"}
    assert loading.resolve_model_path(None) == "demo-out/final" and len(calls) == 1  # trained once
    assert loading.resolve_model_path("some/dir") == "some/dir"


def test_a_lora_adapter_is_served_merged_on_its_base(tiny_dir, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    lora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "down_proj"], init_lora_weights=False))
    lora.save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([[5, 17, 99, 3, 250, 7]])
    with torch.no_grad():
        expected = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32), tmp_path / "adapter")(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)(ids).logits
    model, tokenizer = loading.load_model_for_serving(str(tmp_path / "adapter"), "fp32")
    assert not hasattr(model, "peft_config") and tokenizer.is_fast
    with torch.no_grad():
        got = model(ids).logits
    assert not torch.allclose(expected, plain, atol=1e-3)  # the adapter matters
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)  # the merge rounds once


def test_context_length_is_the_models_or_the_limit(tiny_model):
    model, _ = tiny_model
    assert loading.context_length(model) == 1024 and loading.context_length(model, 300) == 300
    with pytest.raises(ValueError, match="--max-model-len"):
        loading.context_length(model, 0)


def test_vllm_backend_without_vllm_says_so_in_one_line(tiny_dir, capsys):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    assert main(["serve", str(tiny_dir), "--backend", "vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tigon serve: error: --backend vllm: vLLM is not installed (pip install vllm); "
                   "the default --backend transformers needs nothing more"]


def test_vllm_command_names_the_model_and_settings():
    from tigon.serve.vllm import vllm_command

    cmd = vllm_command("/m", "tiny", "0.0.0.0", 9000, "bf16", 512, "/t.jinja")
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    text = " ".join(cmd)
    for part in ("--model /m", "--served-model-name tiny", "--host 0.0.0.0", "--port 9000", "--dtype bfloat16",
                 "--max-model-len 512", "--chat-template /t.jinja"):
        assert part in text


def test_a_port_in_use_is_refused_before_loading(tiny_dir, capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", str(tiny_dir), "--port", str(port)]) == 2
    assert capsys.readouterr().err.strip() == (f"tigon serve: error: --host 127.0.0.1 --port {port}: cannot listen "
                                               "there (Address already in use)")
