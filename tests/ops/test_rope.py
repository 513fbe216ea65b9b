import pytest
import torch

import tigon.functional as F
from tigon.ops.rope import rope_reference
from tests.helpers import assert_close, compare_fwd_bwd


def _cos_sin(batch, tokens, rot, dtype, device, base=10000.0):
    """cos/sin as HF's rotary embeddings build them: (B, T, R), the R/2 frequencies twice over."""
    positions = torch.randint(0, 4096, (batch, tokens), device=device).double()
    inv_freq = 1.0 / base ** (torch.arange(0, rot, 2, device=device).double() / rot)
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _qk(batch, q_heads, k_heads, tokens, head_dim, dtype, device, hf_layout=True):
    """q, k as HF attention passes them: (B, T, H, D) projections viewed as (B, H, T, D)."""
    def make(heads):
        if hf_layout:
            return torch.randn(batch, tokens, heads, head_dim, dtype=dtype, device=device).transpose(1, 2)
        return torch.randn(batch, heads, tokens, head_dim, dtype=dtype, device=device)

    return make(q_heads).requires_grad_(), make(k_heads).requires_grad_()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("head_dim,rot", [(64, 64), (80, 80), (96, 96), (128, 128), (80, 32), (128, 64)])
@pytest.mark.parametrize(
    "dtype,batch,tokens,q_heads,k_heads",
    [(torch.float32, 3, 1, 3, 1), (torch.float32, 1, 257, 2, 1), (torch.float16, 1, 257, 2, 1)],
)
def test_rope_matches_reference(poison_outputs, device, dtype, interleaved, head_dim, rot, batch, tokens, q_heads, k_heads):
    q, k = _qk(batch, q_heads, k_heads, tokens, head_dim, dtype, device)
    cos, sin = _cos_sin(batch, tokens, rot, dtype, device)
    out = compare_fwd_bwd(
        lambda q, k: F.rope(q, k, cos, sin, interleaved=interleaved),
        lambda q, k: rope_reference(q, k, cos.double(), sin.double(), interleaved),
        (q, k), name=f"rope D={head_dim} R={rot}",
    )
    # Outputs keep the inputs' layout, so nothing downstream has to copy them.
    assert out[0].stride() == q.stride() and out[1].stride() == k.stride()


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_matches_hf_llama_apply_rotary_pos_emb(poison_outputs, device, head_dim):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = _qk(2, 6, 2, 33, head_dim, torch.float32, device)
    cos, sin = _cos_sin(2, 33, head_dim, torch.float32, device)
    out = compare_fwd_bwd(
        lambda q, k: F.rope(q, k, cos, sin),
        lambda q, k: apply_rotary_pos_emb(q, k, cos.double(), sin.double()),
        (q, k), name="vs HF",
    )
    # fp32 against HF's own fp32 arithmetic: equal up to rounding.
    hf = apply_rotary_pos_emb(q, k, cos, sin)
    for ours, theirs in zip(out, hf):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def _partial_rotary_by_hand(q, k, cos, sin):
    """Phi-style partial rotary, written out: rotate_half on the first R dims, the rest untouched."""
    rot, half = cos.shape[-1], cos.shape[-1] // 2
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def apply(x):
        x1, x2, rest = x[..., :half], x[..., half:rot], x[..., rot:]
        return torch.cat((x1 * cos[..., :half] - x2 * sin[..., :half], x2 * cos[..., half:] + x1 * sin[..., half:], rest), -1)

    return apply(q), apply(k)


@pytest.mark.parametrize("head_dim,rot", [(80, 32), (128, 64), (96, 48)])
def test_partial_rotary_matches_hand_written(poison_outputs, device, head_dim, rot):
    q, k = _qk(2, 3, 1, 19, head_dim, torch.float32, device)
    cos, sin = _cos_sin(2, 19, rot, torch.float32, device)
    compare_fwd_bwd(
        lambda q, k: F.rope(q, k, cos, sin),
        lambda q, k: _partial_rotary_by_hand(q, k, cos.double(), sin.double()),
        (q, k), name="partial",
    )


@pytest.mark.parametrize("head_dim,rot", [(64, 64), (128, 64)])
def test_interleaved_matches_hf_glm(poison_outputs, device, head_dim, rot):
    from transformers.models.glm.modeling_glm import apply_rotary_pos_emb

    q, k = _qk(2, 4, 2, 21, head_dim, torch.float32, device)
    cos, sin = _cos_sin(2, 21, rot, torch.float32, device)
    compare_fwd_bwd(
        lambda q, k: F.rope(q, k, cos, sin, interleaved=True),
        lambda q, k: apply_rotary_pos_emb(q, k, cos.double(), sin.double()),
        (q, k), name="vs GLM",
    )


def _hf_cos_sin(family, head_dim, factor, tokens, device):
    """cos/sin from the family's own HF rotary-embedding module, for a config with that head dim
    and partial_rotary_factor: R = int(head_dim * factor), rounded up to even (HF's frequencies are
    arange(0, R, 2))."""
    import transformers
    from transformers.models.phi.modeling_phi import PhiRotaryEmbedding
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding
    from transformers.models.stablelm.modeling_stablelm import StableLmRotaryEmbedding

    if family == "qwen3_next":
        config = transformers.Qwen3NextConfig(head_dim=head_dim, partial_rotary_factor=factor)
        module = Qwen3NextRotaryEmbedding(config)
    else:  # phi, stablelm: head_dim = hidden_size / heads
        config_class, module_class = {"phi": (transformers.PhiConfig, PhiRotaryEmbedding),
                                      "stablelm": (transformers.StableLmConfig, StableLmRotaryEmbedding)}[family]
        module = module_class(config_class(hidden_size=2 * head_dim, num_attention_heads=2, partial_rotary_factor=factor))
    positions = torch.randint(0, 4096, (2, tokens), device=device)
    return module.to(device)(torch.empty(0, device=device), positions)


@pytest.mark.parametrize("family,head_dim,factor", [("phi", 80, 0.4), ("phi", 97, 0.25), ("stablelm", 65, 0.25)])
def test_partial_rotary_matches_hf_phi_slicing(poison_outputs, device, family, head_dim, factor):
    # Phi and StableLM rotate q[..., :rotary_ndims] with apply_rotary_pos_emb and concatenate the
    # rest back (what the patched function receives), at odd head dims too (97, 65: odd pass-through).
    from transformers.models.phi.modeling_phi import apply_rotary_pos_emb

    cos, sin = _hf_cos_sin(family, head_dim, factor, 17, device)
    rot = int(head_dim * factor)
    assert cos.shape[-1] == rot

    def by_hf(q, k):
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :rot], k[..., :rot], cos.double(), sin.double())
        return torch.cat((q_rot, q[..., rot:]), -1), torch.cat((k_rot, k[..., rot:]), -1)

    def sliced(q, k):
        q_rot, k_rot = F.rope(q[..., :rot], k[..., :rot], cos, sin)
        return torch.cat((q_rot, q[..., rot:]), -1), torch.cat((k_rot, k[..., rot:]), -1)

    q, k = _qk(2, 3, 1, 17, head_dim, torch.float32, device)
    compare_fwd_bwd(sliced, by_hf, (q, k), name=f"{family} D={head_dim} sliced")
    compare_fwd_bwd(lambda q, k: F.rope(q, k, cos, sin), by_hf, (q, k), name=f"{family} D={head_dim} whole heads")


@pytest.mark.parametrize("head_dim,factor", [(65, 0.5), (50, 0.5), (33, 0.25), (256, 0.25)])
def test_partial_rotary_matches_hf_qwen3_next(poison_outputs, device, head_dim, factor):
    # Qwen3-Next's apply_rotary_pos_emb rotates the first cos.shape[-1] dims itself. With
    # int(head_dim * factor) odd (50 * 0.5 = 25) HF's frequencies give an even R = 26: both rotate 26.
    from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb

    cos, sin = _hf_cos_sin("qwen3_next", head_dim, factor, 13, device)
    q, k = _qk(2, 4, 2, 13, head_dim, torch.float32, device)
    compare_fwd_bwd(
        lambda q, k: F.rope(q, k, cos, sin),
        lambda q, k: apply_rotary_pos_emb(q, k, cos.double(), sin.double()),
        (q, k), name=f"qwen3_next D={head_dim} R={cos.shape[-1]}",
    )


@pytest.mark.parametrize("rot", [64, 31])
def test_odd_or_too_wide_rotary_is_refused(device, rot):
    # Full rotary on an odd head dim would need R = head_dim + 1 columns (HF's configs refuse it:
    # "RoPE requires an even rotary dimension"), and an odd R has no pairs: tigon names the problem.
    cos, sin = _cos_sin(1, 5, rot + rot % 2, torch.float32, device)
    cos, sin = cos[..., :rot], sin[..., :rot]
    q, k = _qk(1, 2, 2, 5, 63, torch.float32, device)
    with pytest.raises(ValueError, match=rf"R even and 2 <= R <= 63, got \(1, 5, {rot}\)"):
        F.rope(q, k, cos, sin)


def test_halves_of_cos_sin_need_not_match(poison_outputs, device):
    # Non-interleaved reads all R columns, as HF's formula does, forward and backward.
    q, k = _qk(2, 3, 3, 10, 64, torch.float32, device)
    cos, sin = torch.randn(2, 10, 64, device=device), torch.randn(2, 10, 64, device=device)
    compare_fwd_bwd(
        lambda q, k: F.rope(q, k, cos, sin),
        lambda q, k: rope_reference(q, k, cos.double(), sin.double()),
        (q, k), name="unequal halves",
    )


@pytest.mark.parametrize("shape", ["tokens", "batch1"])
def test_broadcast_cos_sin(poison_outputs, device, shape):
    q, k = _qk(3, 2, 1, 12, 64, torch.float32, device, hf_layout=False)
    cos, sin = _cos_sin(1, 12, 64, torch.float32, device)
    if shape == "tokens":
        cos, sin = cos[0], sin[0]
    compare_fwd_bwd(
        lambda q, k: F.rope(q, k, cos, sin),
        lambda q, k: rope_reference(q, k, cos.double(), sin.double()),
        (q, k), name=shape,
    )


def test_strided_inputs_are_not_copied(poison_outputs, device, monkeypatch):
    # A slice of a fused qkv projection, viewed as HF does: neither q nor k is contiguous.
    qkv = torch.randn(2, 9, (4 + 2 + 2) * 64, device=device)
    q = qkv[..., : 4 * 64].view(2, 9, 4, 64).transpose(1, 2).detach().requires_grad_()
    k = qkv[..., 4 * 64 : 6 * 64].view(2, 9, 2, 64).transpose(1, 2).detach().requires_grad_()
    cos, sin = _cos_sin(2, 9, 64, torch.float32, device)
    expected = rope_reference(q, k, cos, sin)

    def no_copies(*args, **kwargs):
        raise AssertionError("rope copied an input")

    monkeypatch.setattr(torch.Tensor, "contiguous", no_copies)
    monkeypatch.setattr(torch.Tensor, "clone", no_copies)
    out = F.rope(q, k, cos, sin)
    monkeypatch.undo()
    for got, want in zip(out, expected):
        assert_close(got, want, name="strided")


def test_only_one_output_used(device):
    q, k = _qk(2, 4, 2, 5, 64, torch.float32, device)
    cos, sin = _cos_sin(2, 5, 64, torch.float32, device)
    q_out, _ = F.rope(q, k, cos, sin)
    grad = torch.randn_like(q_out)
    q_out.backward(grad)
    q_ref = q.detach().clone().requires_grad_()
    rope_reference(q_ref, k.detach(), cos, sin)[0].backward(grad)
    assert_close(q.grad, q_ref.grad, name="grad q")
    assert k.grad is None


def test_frozen_key_gets_no_gradient(device):
    q, k = _qk(1, 2, 2, 4, 64, torch.float32, device)
    k = k.detach()
    cos, sin = _cos_sin(1, 4, 64, torch.float32, device)
    q_out, k_out = F.rope(q, k, cos, sin)
    (q_out.sum() + k_out.sum()).backward()
    assert q.grad is not None and k.grad is None


def test_cos_sin_requiring_grad_use_the_reference(device):
    q, k = _qk(1, 2, 1, 6, 64, torch.float32, device)
    cos, sin = _cos_sin(1, 6, 64, torch.float32, device)
    cos.requires_grad_()
    out = F.rope(q, k, cos, sin)
    sum(o.sum() for o in out).backward()
    assert cos.grad is not None and cos.grad.abs().sum() > 0


def test_mixed_dtype_promotes_like_hf(device):
    q, k = _qk(1, 2, 1, 6, 64, torch.float16, device)
    cos, sin = _cos_sin(1, 6, 64, torch.float32, device)
    out = F.rope(q, k, cos, sin)
    assert out[0].dtype == out[1].dtype == torch.float32
    for got, want in zip(out, rope_reference(q, k, cos, sin)):
        assert_close(got, want, torch.float16)
    sum(o.sum() for o in out).backward()
    assert q.grad.dtype == torch.float16


def test_empty_input(device):
    q = torch.randn(2, 3, 0, 64, device=device)
    cos = torch.randn(0, 64, device=device)
    assert [tuple(o.shape) for o in F.rope(q, q, cos, cos)] == [(2, 3, 0, 64)] * 2


def _bad(q_shape=(2, 4, 5, 64), k_shape=(2, 2, 5, 64), cos_shape=(2, 5, 64), sin_shape=None, **kw):
    sin_shape = sin_shape or cos_shape
    return lambda: F.rope(
        torch.randn(q_shape), torch.randn(k_shape), torch.randn(cos_shape), torch.randn(sin_shape), **kw
    )


@pytest.mark.parametrize(
    "call,match",
    [
        (_bad(q_shape=(4, 5, 64)), r"q must have shape \(batch, heads, tokens, head_dim\)"),
        (_bad(k_shape=(2, 2, 6, 64)), r"k must have shape \(2, kv_heads, 5, 64\)"),
        (_bad(cos_shape=(2, 5, 66)), "cos must have shape"),
        (_bad(cos_shape=(2, 5, 63)), "R even"),
        (_bad(cos_shape=(3, 5, 64)), "cos must have shape"),
        (_bad(cos_shape=(2, 6, 64)), "cos must have shape"),
        (_bad(sin_shape=(2, 5, 32)), r"sin must have the shape of cos \(2, 5, 64\)"),
        (_bad(interleaved=1), "interleaved must be True or False"),
        (lambda: F.rope(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8).half(), torch.randn(2, 8), torch.randn(2, 8)),
         "k must have the dtype of q"),
        (lambda: F.rope(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8), torch.randn(2, 8), torch.randn(2, 8).half()),
         "sin must have the dtype of cos"),
        (lambda: F.rope(torch.ones(1, 1, 2, 8, dtype=torch.int64), torch.randn(1, 1, 2, 8), torch.randn(2, 8),
                        torch.randn(2, 8)), "q must be a floating-point"),
    ],
)
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(
    "batch,q_heads,k_heads,tokens,head_dim,rot",
    [(8, 32, 8, 2048, 128, 128), (2, 32, 32, 257, 80, 80), (4, 24, 8, 1, 96, 96), (2, 32, 32, 2047, 80, 32),
     (2, 16, 4, 1023, 97, 24), (2, 16, 16, 511, 65, 16)],
)
def test_bf16_on_gpu(interleaved, batch, q_heads, k_heads, tokens, head_dim, rot):
    device = torch.device("cuda")
    q, k = _qk(batch, q_heads, k_heads, tokens, head_dim, torch.bfloat16, device)
    cos, sin = _cos_sin(batch, tokens, rot, torch.bfloat16, device)
    compare_fwd_bwd(
        lambda q, k: F.rope(q, k, cos, sin, interleaved=interleaved),
        lambda q, k: rope_reference(q, k, cos.double(), sin.double(), interleaved),
        (q, k), torch.bfloat16, name="bf16",
    )


@pytest.mark.gpu
def test_forward_allocates_only_its_outputs_on_gpu():
    device = torch.device("cuda")
    q, k = _qk(8, 32, 8, 2048, 128, torch.bfloat16, device)
    cos, sin = _cos_sin(8, 2048, 128, torch.bfloat16, device)
    F.rope(q, k, cos, sin)  # compile first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = F.rope(q, k, cos, sin)
    torch.cuda.synchronize()
    out_bytes = sum(o.numel() * o.element_size() for o in out)
    assert torch.cuda.max_memory_allocated() - base == out_bytes


@pytest.mark.gpu
def test_int64_offsets_on_gpu():
    # Contiguous (B, H, T, D) with H * T * D past 2**31: the last heads' offsets need int64.
    device = torch.device("cuda")
    q, k = _qk(1, 32, 1, 2**19 + 1, 128, torch.bfloat16, device, hf_layout=False)
    cos, sin = _cos_sin(1, 2**19 + 1, 128, torch.bfloat16, device)
    q_out, _ = F.rope(q, k, cos, sin)
    tail = q[:, -1:, -3:].detach()
    want = rope_reference(tail, tail, cos[:, -3:], sin[:, -3:])[0]
    assert_close(q_out[:, -1:, -3:], want, name="last head, last tokens")
