"""`tigon export`: merged safetensors and GGUF, read back with the gguf package's reader and
loaded back by transformers' own GGUF loader. (llama-cpp-python has no wheel for this platform,
so transformers' loader is the independent reader that generates from the file.)"""

import logging

import gguf
import numpy as np
import pytest
import torch

from tigon.cli import main
from tigon.serve.export import FAMILIES, export_gguf, interleave_rope_rows
from tigon.train import tiny


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def ids(tiny_model):
    _, tokenizer = tiny_model
    return torch.tensor([tokenizer("Who are you? <|im_start|>user\nhi<|im_end|>")["input_ids"]])


def test_gguf_holds_the_models_tensors_and_tokenizer(tiny_dir, tiny_model, tmp_path, caplog):
    model, tokenizer = tiny_model
    caplog.set_level(logging.INFO)
    assert main(["export", str(tiny_dir), "--to", "gguf", "--dtype", "f32", "--output", str(tmp_path)]) == 0
    # tigon's one line says what was written; none of the gguf writer's own account of it.
    assert "tigon export: " in caplog.text and "n_tensors" not in caplog.text and "Endian" not in caplog.text
    reader = gguf.GGUFReader(tmp_path / "model.gguf")
    tensors = {t.name: t for t in reader.tensors}
    layers = model.config.num_hidden_layers
    per_layer = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm", "ffn_gate": "mlp.gate_proj",
                 "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_norm": "post_attention_layernorm"}
    expected = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    expected |= {f"blk.{i}.{g}.weight": f"model.layers.{i}.{h}.weight" for i in range(layers) for g, h in per_layer.items()}
    assert set(tensors) == set(expected)  # tied head: no output.weight
    state = model.state_dict()
    for name, hf_name in expected.items():
        want = state[hf_name]
        if ".attn_q." in name:
            want = interleave_rope_rows(want, model.config.num_attention_heads)
        elif ".attn_k." in name:
            want = interleave_rope_rows(want, model.config.num_key_value_heads)
        assert tensors[name].data.shape == tuple(want.shape), name
        assert np.array_equal(tensors[name].data, want.numpy()), name
        assert tensors[name].tensor_type == gguf.GGMLQuantizationType.F32
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert field("general.architecture") == "llama"
    assert field("llama.block_count") == layers and field("llama.attention.head_count_kv") == 2
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.pre") == "gpt-2"
    assert field("tokenizer.ggml.tokens") == tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    assert field("tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    assert field("tokenizer.ggml.padding_token_id") == tokenizer.pad_token_id
    assert field("tokenizer.ggml.token_type")[tokenizer.eos_token_id] == gguf.TokenType.CONTROL
    assert len(field("tokenizer.ggml.merges")) > 100
    assert field("tokenizer.chat_template") == tokenizer.chat_template
    modelfile = (tmp_path / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./model.gguf\n") and 'PARAMETER stop "<|im_end|>"' in modelfile
    assert '{{ if eq .Role "system" }}<|im_start|>system\n{{ .Content }}<|im_end|>\n' in modelfile


def _tiny_family(kind, tokenizer, path):
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(vocab_size=len(tokenizer), hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                 tie_word_embeddings=False, initializer_range=0.1)
    if kind == "qwen3":
        # != hidden / heads, so the GGUF must say so (attention.key_length); transformers' GGUF loader
        # does not read that key for qwen3 and takes Qwen3's default, 128, so the test uses that.
        sizes["head_dim"] = 128
    config = AutoConfig.for_model(kind, **sizes)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config).eval()
    if kind == "qwen2":  # q/k/v biases, random so that they count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "qwen3"])
def test_each_family_loads_back_in_transformers_with_the_same_logits(kind, tiny_model, ids, tmp_path):
    from transformers import AutoModelForCausalLM

    assert kind in FAMILIES
    model = _tiny_family(kind, tiny_model[1], tmp_path / "hf")
    export_gguf(str(tmp_path / "hf"), str(tmp_path / "gguf"), "f32")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "gguf", gguf_file="model.gguf", dtype=torch.float32)
    reader = gguf.GGUFReader(tmp_path / "gguf" / "model.gguf")
    assert "output.weight" in {t.name for t in reader.tensors}
    assert reader.fields["general.architecture"].contents() == ("llama" if kind == "mistral" else kind)
    if kind == "qwen3":
        assert reader.fields["qwen3.attention.key_length"].contents() == 128
    torch.testing.assert_close(_logits(back.eval(), ids), _logits(model, ids), atol=1e-4, rtol=1e-4)


def test_a_lora_adapter_exports_merged_to_gguf_and_safetensors(tiny_dir, ids, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32),
                          LoraConfig(r=4, target_modules=["q_proj", "k_proj", "up_proj"], init_lora_weights=False))
    lora.save_pretrained(tmp_path / "adapter")
    want = _logits(lora.eval(), ids)
    assert main(["export", str(tmp_path / "adapter"), "--to", "gguf", "--output", str(tmp_path / "g")]) == 0
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "g", gguf_file="model.gguf", dtype=torch.float32)
    torch.testing.assert_close(_logits(back.eval(), ids), want, atol=1e-4, rtol=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "g", gguf_file="model.gguf")
    assert tokenizer("Who are you? <|im_start|>user\nhi<|im_end|>")["input_ids"] == ids[0].tolist()

    assert main(["export", str(tmp_path / "adapter"), "--to", "merged", "--output", str(tmp_path / "m")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    assert not (tmp_path / "m" / "adapter_config.json").exists()
    torch.testing.assert_close(_logits(merged.eval(), ids), want, atol=1e-4, rtol=1e-4)


def test_a_full_model_exports_merged_in_the_dtype_asked_for(tiny_dir, tiny_model, ids, tmp_path):
    from transformers import AutoModelForCausalLM

    assert main(["export", str(tiny_dir), "--to", "merged", "--dtype", "bf16", "--output", str(tmp_path / "m")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert merged.dtype == torch.bfloat16
    want = tiny_model[0].state_dict()
    for name, tensor in merged.state_dict().items():
        assert torch.equal(tensor, want[name].to(torch.bfloat16)), name
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    assert main(["export", str(tiny_dir), "--to", "merged", "--base", str(tiny_dir), "--output", str(tmp_path / "x")]) == 2


def test_q8_0_quantizes_the_matrices_with_gguf_and_keeps_norms_f32(tiny_dir, tiny_model, tmp_path):
    model, _ = tiny_model
    export_gguf(str(tiny_dir), str(tmp_path), "q8_0")
    reader = gguf.GGUFReader(tmp_path / "model.gguf")
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    down = tensors["blk.1.ffn_down.weight"]
    assert down.tensor_type == gguf.GGMLQuantizationType.Q8_0
    want = model.state_dict()["model.layers.1.mlp.down_proj.weight"].numpy()
    assert np.array_equal(down.data, gguf.quants.quantize(want, gguf.GGMLQuantizationType.Q8_0))
    got = gguf.quants.dequantize(down.data, down.tensor_type)
    assert np.abs(got - want).max() <= np.abs(want).max() / 127


def test_unsupported_family_and_bad_dtype_are_one_line_errors(tiny_model, tiny_dir, tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    tiny_model[1].save_pretrained(tmp_path / "gpt2")
    capsys.readouterr()  # the setup's own output (transformers' shard-writing progress bar, where it is on)
    assert main(["export", str(tmp_path / "gpt2"), "--to", "gguf", "--output", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"tigon export: error: {tmp_path / 'gpt2'}: model family 'gpt2' cannot be exported to GGUF; "
        "supported: llama, mistral, qwen2, qwen3")
    assert main(["export", str(tiny_dir), "--to", "merged", "--dtype", "q8_0", "--output", str(tmp_path / "o")]) == 2
    assert "--dtype q8_0 is for --to gguf" in capsys.readouterr().err
    for to in ("gguf", "merged"):  # a missing model is said as one, whatever the format
        assert main(["export", str(tmp_path / "missing"), "--to", to, "--output", str(tmp_path / "o")]) == 2
        assert capsys.readouterr().err == f"tigon export: error: model not found: {tmp_path / 'missing'} (no such directory)\n"


def test_llama3_rope_factors_match_transformers_scaled_frequencies():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tigon.serve.export import llama3_rope_factors

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=2048, num_attention_heads=32, rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    factors = llama3_rope_factors(config)
    assert factors.shape == (32,) and factors.min() == 1.0 and factors.max() == 32.0
    torch.testing.assert_close(torch.from_numpy(factors).double(), plain / scaled.double(), rtol=1e-5, atol=0)
    assert llama3_rope_factors(LlamaConfig()) is None


# --- where export and merge write: --output, --overwrite, the sources they read ----------------

SHORT_LORA_RUN = ["--tuner", "lora", "--dataset", f"{tiny.BUNDLED_DATASET}#40", "--batch-size", "4",
                  "--max-length", "48", "--samples", "0", "--no-kernels", "--max-steps", "1", "--save-steps", "1"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A run of `tigon sft --tuner lora` on the built-in model: base/, checkpoint-1/, final/ (the
    adapter), metrics."""
    run = tmp_path_factory.mktemp("lora") / "run"
    assert main(["sft", *SHORT_LORA_RUN, "--output-dir", str(run)]) == 0
    return run


def _tree(path):
    """Every file under `path` (relative name -> bytes) and every directory (name -> None)."""
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


def _user_folder(path):
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("mine\n")
    (path / "sub" / "data.bin").write_bytes(bytes(range(256)))
    return _tree(path)


def _one_line_error(capsys, command):
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"tigon {command}: error: "), err
    return lines[-1].removeprefix(f"tigon {command}: error: ")


def _commands(model_dir):
    """The three ways to write a model: export --to merged, export --to gguf, merge."""
    return {"merged": ["export", str(model_dir), "--to", "merged"], "gguf": ["export", str(model_dir), "--to", "gguf"],
            "merge": ["merge", str(model_dir)]}


@pytest.mark.parametrize("how", ["merged", "gguf", "merge"])
def test_a_folder_with_the_users_files_is_refused_untouched_and_replaced_with_overwrite(how, lora_run, tmp_path,
                                                                                      capsys):
    out = tmp_path / "mine"
    before = _user_folder(out)
    command = _commands(lora_run / "final")[how]
    assert main([*command, "--output", str(out)]) == 2
    assert _one_line_error(capsys, command[0]) == (
        f"--output {out} is a directory that is not empty: pass --overwrite to replace it (everything in it is "
        "deleted), or choose another --output")
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["mine"]

    assert main([*command, "--output", str(out), "--overwrite"]) == 0
    written = sorted(p.name for p in out.iterdir())
    if how == "gguf":
        assert written == ["Modelfile", "model.gguf", "tigon-manifest.json"]
    else:
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(written) and "notes.txt" not in written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no staging or old copy left beside it


def test_an_empty_folder_is_written_into_without_overwrite(tiny_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tiny_dir), "--to", "merged", "--output", str(tmp_path / "empty")]) == 0
    assert (tmp_path / "empty" / "model.safetensors").is_file()


@pytest.mark.parametrize("how", ["merged", "gguf", "merge"])
@pytest.mark.parametrize("where", ["run", "final", "inside final", "base"])
def test_the_run_the_model_comes_from_is_never_written_over(how, where, lora_run, capsys):
    """Not even with --overwrite: the run folder holding the adapter, the adapter itself, a folder
    inside it, and the base model the adapter is read against (the run's base/)."""
    out = {"run": lora_run, "final": lora_run / "final", "inside final": lora_run / "final" / "merged",
           "base": lora_run / "base"}[where]
    source = {"run": lora_run / "final", "final": lora_run / "final", "inside final": lora_run / "final",
              "base": lora_run / "base"}[where]
    relation = {"run": "contains", "final": "is", "inside final": "lies inside", "base": "is"}[where]
    before = _tree(lora_run)
    command = _commands(lora_run / "final")[how]
    assert main([*command, "--output", str(out), "--overwrite"]) == 2
    itself = " itself" if relation == "is" else ""
    assert _one_line_error(capsys, command[0]) == (
        f"--output {out} {relation} {source}{itself}, which this command reads: choose another --output")
    assert _tree(lora_run) == before


def test_gguf_output_named_x_gguf_is_that_file_and_an_existing_one_needs_overwrite(tiny_dir, tiny_model, tmp_path,
                                                                                 capsys):
    out = tmp_path / "x.gguf"
    assert main(["export", str(tiny_dir), "--to", "gguf", "--dtype", "f32", "--output", str(out)]) == 0
    assert out.is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["x.gguf"]
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    want = tiny_model[0].state_dict()["model.layers.0.mlp.down_proj.weight"].numpy()
    assert np.array_equal(tensors["blk.0.ffn_down.weight"].data, want)

    out.write_bytes(b"the user's own file")
    assert main(["export", str(tiny_dir), "--to", "gguf", "--output", str(out)]) == 2
    assert _one_line_error(capsys, "export") == (
        f"--output {out} already exists: pass --overwrite to replace it, or choose another --output")
    assert out.read_bytes() == b"the user's own file"
    assert main(["export", str(tiny_dir), "--to", "gguf", "--output", str(out), "--overwrite"]) == 0
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == "llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.gguf"]

    assert main(["export", str(tiny_dir), "--to", "merged", "--output", str(tmp_path / "m.gguf")]) == 2
    assert _one_line_error(capsys, "export") == (
        f"--output {tmp_path / 'm.gguf'}: --to merged writes a directory; a .gguf file is what --to gguf writes")


@pytest.mark.parametrize("command", ["merge", "export"])
def test_an_adapter_that_does_not_fit_base_is_one_line_naming_the_tensor_and_both_shapes(command, lora_run,
                                                                                       tiny_model, tmp_path, capsys):
    other = tmp_path / "other"
    _tiny_family("mistral", tiny_model[1], other)  # hidden size 96 where the adapter's base has 128
    adapter = lora_run / "final"
    argv = ["merge", str(adapter)] if command == "merge" else ["export", str(adapter), "--to", "merged"]
    capsys.readouterr()
    assert main([*argv, "--base", str(other), "--output", str(tmp_path / "m")]) == 2
    assert _one_line_error(capsys, command) == (
        f"{adapter}: does not fit the base model {other}: base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight "
        "is [16, 128] in the adapter and [16, 96] on this base (pass the --base it was trained on)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]


@pytest.mark.parametrize("name", ["gguf", "x.gguf"])
def test_an_export_stopped_while_writing_leaves_nothing_and_keeps_what_it_was_to_replace(name, tiny_dir, tmp_path,
                                                                                        monkeypatch, capsys):
    def stopped_halfway(writer, **kwargs):
        writer.write_ti_data_to_file()
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", stopped_halfway)
    out = tmp_path / name
    assert main(["export", str(tiny_dir), "--to", "gguf", "--output", str(out)]) == 130
    assert list(tmp_path.iterdir()) == []
    if name == "gguf":
        _user_folder(out)
    else:
        out.write_bytes(b"an older export")
    contents = lambda: _tree(out) if out.is_dir() else out.read_bytes()  # noqa: E731
    before = contents()
    assert main(["export", str(tiny_dir), "--to", "gguf", "--output", str(out), "--overwrite"]) == 130
    assert contents() == before and [p.name for p in tmp_path.iterdir()] == [name]
