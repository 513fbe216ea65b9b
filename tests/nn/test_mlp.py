import types

import pytest
import torch

import tigon.nn
from tests.helpers import assert_close, saved_activation_bytes


def _llama_config(**kwargs):
    from transformers import LlamaConfig

    kwargs = {"hidden_size": 48, "intermediate_size": 136, "num_attention_heads": 4, "num_key_value_heads": 2, **kwargs}
    return LlamaConfig(**kwargs)


def _gemma_config(version=1, **kwargs):
    from transformers import Gemma2Config, GemmaConfig

    cls = GemmaConfig if version == 1 else Gemma2Config
    kwargs = {"hidden_size": 40, "intermediate_size": 104, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 20, **kwargs}
    return cls(**kwargs)


def _hf_mlp(config):
    from transformers.models.gemma.modeling_gemma import GemmaMLP
    from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    cls = {"llama": LlamaMLP, "gemma": GemmaMLP, "gemma2": Gemma2MLP}[config.model_type]
    return cls(config)


def _assert_same_fwd_bwd(ours, hf, device, dtype=torch.float32, tokens=(2, 7)):
    """Equal outputs and equal gradients of the input and of every parameter, by name."""
    x = torch.randn(*tokens, hf.hidden_size, device=device, dtype=dtype, requires_grad=True)
    x_hf = x.detach().clone().requires_grad_()
    out, out_hf = ours(x), hf(x_hf)
    assert_close(out, out_hf, name="output")
    grad = torch.randn_like(out)
    out.backward(grad)
    out_hf.backward(grad)
    assert_close(x.grad, x_hf.grad, name="grad x")
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        if p.requires_grad:
            assert_close(p.grad, hf_params[name].grad, name=f"grad {name}")


def _twin(cls, config, device):
    """An HF MLP with random weights and a tigon module loaded from its state dict."""
    hf = _hf_mlp(config).to(device)
    ours = cls(config).to(device)
    assert ours.state_dict().keys() == hf.state_dict().keys()
    ours.load_state_dict(hf.state_dict())
    return ours, hf


@pytest.mark.parametrize("mlp_bias", [False, True])
def test_swiglu_mlp_replaces_llama_mlp(poison_outputs, device, mlp_bias):
    ours, hf = _twin(tigon.nn.SwiGLUMLP, _llama_config(mlp_bias=mlp_bias), device)
    assert (ours.gate_proj.bias is not None) == mlp_bias
    _assert_same_fwd_bwd(ours, hf, device)


@pytest.mark.parametrize("version", [1, 2])
def test_geglu_mlp_replaces_gemma_mlp(poison_outputs, device, version):
    ours, hf = _twin(tigon.nn.GeGLUMLP, _gemma_config(version), device)
    _assert_same_fwd_bwd(ours, hf, device)


def test_geglu_mlp_exact_gelu(poison_outputs, device):
    # A Llama-shaped MLP with hidden_act="gelu" is the oracle for the erf form.
    ours, hf = _twin(tigon.nn.GeGLUMLP, _llama_config(hidden_act="gelu"), device)
    _assert_same_fwd_bwd(ours, hf, device)


def test_fp16_and_intermediate_size_override(device):
    config = _llama_config()
    ours = tigon.nn.SwiGLUMLP(config, intermediate_size=72).to(device, torch.float16)
    assert ours.up_proj.weight.shape == (72, 48) and ours.down_proj.weight.shape == (48, 72)
    x = torch.randn(5, 48, device=device, dtype=torch.float16)
    from tigon.ops import glu_mlp_reference

    want = glu_mlp_reference(
        x.double(), ours.gate_proj.weight.double(), ours.up_proj.weight.double(), ours.down_proj.weight.double()
    )
    assert_close(ours(x), want.half(), name="fp16")


@pytest.mark.parametrize(
    "cls,config,match",
    [
        (tigon.nn.SwiGLUMLP, lambda: _llama_config(hidden_act="relu"), r"SwiGLUMLP needs hidden_act in 'silu', 'swish', got 'relu'"),
        (tigon.nn.SwiGLUMLP, lambda: _gemma_config(1), "use tigon.nn.GeGLUMLP"),
        (tigon.nn.GeGLUMLP, lambda: _llama_config(), "use tigon.nn.SwiGLUMLP"),
        (tigon.nn.GeGLUMLP, lambda: _llama_config(hidden_act="gelu_10"), "GeGLUMLP needs hidden_act"),
    ],
)
def test_unsupported_activation_is_a_value_error(cls, config, match):
    with pytest.raises(ValueError, match=match):
        cls(config())


def _saved_activation_bytes(module, x):
    return saved_activation_bytes(module, x)[0]


def test_saves_only_input_gate_and_up(device):
    ours, hf = _twin(tigon.nn.SwiGLUMLP, _llama_config(), device)
    x = torch.randn(2, 7, 48, device=device, requires_grad=True)
    tokens, hidden, intermediate, size = 14, 48, 136, x.element_size()
    ours_bytes = _saved_activation_bytes(ours, x)
    eager_bytes = _saved_activation_bytes(hf, x)
    # x, gate and up; eager also keeps silu(gate) and the down_proj input silu(gate) * up.
    assert ours_bytes == (tokens * hidden + 2 * tokens * intermediate) * size
    assert eager_bytes - ours_bytes >= tokens * intermediate * size


def test_forward_binds_to_a_live_hf_module(device):
    # Instance patching rebinds the forward: it must only read what LlamaMLP has.
    ours, hf = _twin(tigon.nn.SwiGLUMLP, _llama_config(), device)
    x = torch.randn(3, 48, device=device)
    want = hf(x)
    hf.forward = types.MethodType(tigon.nn.SwiGLUMLP.forward, hf)
    assert_close(hf(x), want, name="rebound")
    x_grad = x.clone().requires_grad_()
    saved = _saved_activation_bytes(hf, x_grad)
    assert saved == (3 * 48 + 2 * 3 * 136) * x.element_size()


def test_peft_lora_projections_keep_their_forwards(device):
    from peft import LoraConfig, inject_adapter_in_model

    ours, hf = _twin(tigon.nn.SwiGLUMLP, _llama_config(), device)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False)
    hf = inject_adapter_in_model(lora, hf)
    ours = inject_adapter_in_model(lora, ours)
    ours.load_state_dict(hf.state_dict())
    assert any("lora_A" in name for name in dict(ours.named_parameters()))
    _assert_same_fwd_bwd(ours, hf, device)


@pytest.mark.gpu
@pytest.mark.parametrize("cls,config", [(tigon.nn.SwiGLUMLP, _llama_config), (tigon.nn.GeGLUMLP, _gemma_config)])
def test_bf16_module_on_gpu(cls, config):
    device = torch.device("cuda")
    config = config(hidden_size=2048, intermediate_size=8192)
    hf = _hf_mlp(config).to(device, torch.bfloat16)
    ours = cls(config).to(device, torch.bfloat16)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(4, 1024, 2048, device=device, dtype=torch.bfloat16)
    out, out_hf = ours(x.requires_grad_()), hf(x.detach().clone().requires_grad_())
    assert_close(out, out_hf, torch.bfloat16, name="bf16 output")
    ours_bytes = _saved_activation_bytes(ours, x)
    eager_bytes = _saved_activation_bytes(hf, x)
    per_tensor = 4 * 1024 * 8192 * 2
    assert ours_bytes == 4 * 1024 * 2048 * 2 + 2 * per_tensor
    assert eager_bytes - ours_bytes >= per_tensor
