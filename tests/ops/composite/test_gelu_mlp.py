"""The vision towers' MLPs: the GELU MLP op, and what the towers' other blocks run on (the gated
MLP op for Qwen2.5-VL's SwiGLU MLP, the LayerNorm and RMSNorm kernels at the towers' widths)."""

import pytest
import torch

import tigon.functional as F
from tigon.ops import gelu_mlp_reference, rms_norm_reference
from tests.helpers import assert_close, compare_fwd_bwd, kernel_launches, saved_activation_bytes

APPROXIMATIONS = ["none", "tanh", "sigmoid"]


def _mlp_args(tokens, hidden, intermediate, out, dtype, device, bias):
    def param(*shape):
        return (torch.randn(*shape, dtype=dtype, device=device) / shape[-1] ** 0.5).requires_grad_()

    x = torch.randn(*tokens, hidden, dtype=dtype, device=device, requires_grad=True)
    biases = (param(intermediate), param(out)) if bias else (None, None)
    return x, param(intermediate, hidden), param(out, intermediate), *biases


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("bias,out", [(True, 24), (False, 24), (True, 17)])
def test_gelu_mlp_matches_reference(poison_outputs, device, dtype, approximate, bias, out):
    args = [a for a in _mlp_args((3, 7), 24, 40, out, dtype, device, bias) if a is not None]

    def split(a):
        return (*a[:3], *(a[3:] or (None, None)))

    compare_fwd_bwd(
        lambda *a: F.gelu_mlp(*split(a), approximate=approximate),
        lambda *a: gelu_mlp_reference(*split(a), approximate),
        args, name=f"gelu_mlp {approximate}",
    )


# transformers' vision MLPs: (module, class, config class, hidden_act, the op's approximate)
VISION_MLPS = [
    ("siglip", "SiglipMLP", "SiglipVisionConfig", "gelu_pytorch_tanh", "tanh"),
    ("clip", "CLIPMLP", "CLIPVisionConfig", "quick_gelu", "sigmoid"),
    ("qwen2_vl", "VisionMlp", None, "quick_gelu", "sigmoid"),
    ("qwen3_vl", "Qwen3VLVisionMLP", "Qwen3VLVisionConfig", "gelu_pytorch_tanh", "tanh"),
]


def _vision_mlp(module, cls, config_cls, hidden_act):
    import importlib

    import transformers

    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    if config_cls is None:  # Qwen2-VL's VisionMlp takes its sizes
        return getattr(modeling, cls)(dim=24, hidden_dim=40, hidden_act=hidden_act)
    config = getattr(transformers, config_cls)(hidden_size=24, intermediate_size=40, hidden_act=hidden_act)
    return getattr(modeling, cls)(config)


@pytest.mark.parametrize("module,cls,config_cls,hidden_act,approximate", VISION_MLPS, ids=[m[0] for m in VISION_MLPS])
def test_gelu_mlp_matches_transformers_vision_mlps(poison_outputs, device, module, cls, config_cls, hidden_act,
                                                  approximate):
    mlp = _vision_mlp(module, cls, config_cls, hidden_act).to(device)
    fc1, fc2 = [m for m in mlp.modules() if isinstance(m, torch.nn.Linear)]
    act = next(getattr(mlp, name) for name in ("activation_fn", "act", "act_fn") if hasattr(mlp, name))
    x = torch.randn(2, 9, 24, device=device, requires_grad=True)
    params = [p.detach().requires_grad_() for p in (fc1.weight, fc2.weight, fc1.bias, fc2.bias)]
    # the module is fc2(act(fc1(x))) with transformers' activation for its hidden_act
    torch.testing.assert_close(mlp(x), gelu_mlp_reference(x, *params, approximate), rtol=1e-6, atol=1e-6)
    compare_fwd_bwd(
        lambda x, *p: F.gelu_mlp(x, *p, approximate=approximate),
        lambda x, w1, w2, b1, b2: torch.nn.functional.linear(act(torch.nn.functional.linear(x, w1, b1)), w2, b2),
        (x, *params), name=module,
    )


def test_gelu_mlp_saves_input_and_fc1_output_only(device):
    x, w1, w2, b1, b2 = _mlp_args((13,), 16, 48, 16, torch.float32, device, True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        F.gelu_mlp(x, w1, w2, b1, b2, approximate="sigmoid")
    activations = [t for t in saved if t.dim() == 2 and t.shape[0] == 13]
    assert sorted(t.shape[1] for t in activations) == [16, 48]  # x and fc1(x); not the activation


def test_gelu_mlp_runs_the_kernels_and_frozen_parts(device):
    x, w1, w2, b1, b2 = _mlp_args((5,), 16, 24, 16, torch.float32, device, True)
    w2.requires_grad_(False)
    x = x.detach()
    with kernel_launches() as launches:
        F.gelu_mlp(x, w1, w2, b1, b2).sum().backward()
    assert launches == {"_gelu_fwd_kernel": 1, "_gelu_bwd_kernel": 1}
    assert w1.grad is not None and b1.grad is not None and b2.grad is not None and w2.grad is None


def test_gelu_mlp_second_backward_through_retained_graph_fails_loudly(device):
    # The backward writes fc1's output gradient over the saved fc1 output.
    x, w1, w2, *_ = _mlp_args((5,), 16, 24, 16, torch.float32, device, False)
    out = F.gelu_mlp(x, w1, w2)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_gelu_mlp_nan_in_nan_out(device):
    x, w1, w2, b1, b2 = _mlp_args((4,), 16, 24, 16, torch.float32, device, True)
    with torch.no_grad():
        x[2, 3] = float("nan")
    out = F.gelu_mlp(x, w1, w2, b1, b2, approximate="tanh")
    assert out[2].isnan().all() and out[[0, 1, 3]].isfinite().all()
    out.sum().backward()
    assert w1.grad.isnan().any() and x.grad[0].isfinite().all()


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: F.gelu_mlp(torch.randn(2, 8), torch.randn(6, 7), torch.randn(8, 6)), r"fc1_weight must have shape \(6, 8\)"),
        (lambda: F.gelu_mlp(torch.randn(2, 8), torch.randn(6, 8), torch.randn(8, 5)), r"fc2_weight must have shape \(8, 6\)"),
        (lambda: F.gelu_mlp(torch.randn(2, 8), torch.randn(6, 8), torch.randn(8, 6), torch.randn(5)), r"fc1_bias must have shape \(6,\)"),
        (lambda: F.gelu_mlp(torch.randn(2, 8), torch.randn(6, 8), torch.randn(8, 6), None, torch.randn(6)), r"fc2_bias must have shape \(8,\)"),
        (lambda: F.gelu_mlp(torch.randn(2, 8), torch.randn(6, 8), torch.randn(8, 6), approximate="quick"), "approximate must be one of"),
    ],
)
def test_gelu_mlp_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- the towers' other blocks on existing ops --------------------------------------------------

def test_qwen2_5_vl_vision_swiglu_mlp_is_the_gated_mlp_op(poison_outputs, device):
    """Qwen2.5-VL's vision MLP is a SwiGLU MLP with biases on all three projections: glu_mlp."""
    import transformers
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

    config = transformers.Qwen2_5_VLVisionConfig(hidden_size=24, intermediate_size=40, hidden_act="silu")
    mlp = Qwen2_5_VLMLP(config, bias=True).to(device)
    x = torch.randn(11, 24, device=device, requires_grad=True)
    params = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, mlp.gate_proj.bias, mlp.up_proj.bias,
              mlp.down_proj.bias]
    assert all(p is not None for p in params)
    torch.testing.assert_close(F.glu_mlp(x, *params), mlp(x), rtol=1e-6, atol=1e-6)
    F.glu_mlp(x, *params).sum().backward()
    ours = [x.grad] + [p.grad for p in params]
    x.grad = None
    mlp.zero_grad()
    mlp(x).sum().backward()
    for i, (a, b) in enumerate(zip(ours, [x.grad] + [p.grad for p in params])):
        assert_close(a, b, name=f"grad {i}")


@pytest.mark.parametrize("width", [1152, 1280])  # SigLIP so400m; Qwen2-VL's and Qwen2.5-VL's towers
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layer_norm_and_rms_norm_at_the_towers_widths(poison_outputs, device, width, dtype):
    x = torch.randn(37, width, dtype=dtype, device=device, requires_grad=True)
    w = (1 + 0.1 * torch.randn(width, dtype=dtype, device=device)).requires_grad_()
    b = (0.1 * torch.randn(width, dtype=dtype, device=device)).requires_grad_()
    compare_fwd_bwd(lambda x, w, b: F.layer_norm(x, w, b, eps=1e-6),
                    lambda x, w, b: torch.nn.functional.layer_norm(x, (width,), w, b, 1e-6), (x, w, b),
                    name=f"layer_norm {width}")
    compare_fwd_bwd(lambda x, w: F.rms_norm(x, w, eps=1e-6), lambda x, w: rms_norm_reference(x, w, eps=1e-6), (x, w),
                    name=f"rms_norm {width}")


# --- GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_gelu_mlp_bf16_on_gpu(approximate):
    # SigLIP so400m's MLP: 1152 -> 4304 -> 1152, 4 images of 729 patches
    args = _mlp_args((4, 729), 1152, 4304, 1152, torch.bfloat16, torch.device("cuda"), True)
    compare_fwd_bwd(
        lambda *a: F.gelu_mlp(*a, approximate=approximate),
        lambda *a: gelu_mlp_reference(*a, approximate),
        args, torch.bfloat16, name=f"gelu_mlp {approximate} bf16",
    )


@pytest.mark.gpu
def test_gelu_mlp_saves_one_intermediate_less_than_eager_on_gpu():
    x, w1, w2, b1, b2 = _mlp_args((4096,), 1280, 5120, 1280, torch.bfloat16, torch.device("cuda"), True)

    class Eager(torch.nn.Module):
        def forward(self, x):
            return gelu_mlp_reference(x, w1, w2, b1, b2, "sigmoid")

    class Ours(torch.nn.Module):
        def forward(self, x):
            return F.gelu_mlp(x, w1, w2, b1, b2, approximate="sigmoid")

    eager, _ = saved_activation_bytes(Eager(), x)
    ours, _ = saved_activation_bytes(Ours(), x)
    assert eager - ours >= 4096 * 5120 * 2, (eager, ours)


@pytest.mark.gpu
def test_gelu_mlp_under_autocast_on_gpu():
    args = _mlp_args((4, 256), 512, 1376, 512, torch.float32, torch.device("cuda"), True)
    ours = [a.detach().clone().requires_grad_() for a in args]
    theirs = [a.detach().clone().requires_grad_() for a in args]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = F.gelu_mlp(*ours, approximate="tanh")
        ref = gelu_mlp_reference(*theirs, "tanh")
    assert out.dtype == ref.dtype == torch.bfloat16
    assert_close(out, ref, torch.bfloat16, name="autocast output")
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.grad.dtype == torch.float32
        assert_close(a.grad, b.grad, torch.bfloat16, name=f"autocast grad {i}")
