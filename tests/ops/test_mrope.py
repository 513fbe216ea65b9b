import pytest
import torch

import tigon.functional as F
from tigon.ops.mrope import merge_tables, mrope_reference, vision_rope_reference
from tests.helpers import assert_close, compare_fwd_bwd, kernel_launches

# (module, rotary embedding class, text config class, interleaved sections)
FAMILIES = {
    "qwen2_vl": ("qwen2_vl", "Qwen2VLRotaryEmbedding", "Qwen2VLTextConfig", False),
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLRotaryEmbedding", "Qwen2_5_VLTextConfig", False),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLTextRotaryEmbedding", "Qwen3VLTextConfig", True),
}


def _modeling(family):
    import importlib

    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def _position_ids(batch, tokens, device):
    """3-D (temporal, height, width) position ids as the Qwen-VL models build them: text, then an
    image of a 2 x 3 grid of merged patches at one temporal position, then text again."""
    rows = []
    for b in range(batch):
        start = 3 * b  # each sample its own offset
        image = min(6, max(0, tokens - 2))
        text_before = min(2, tokens)
        t = list(range(start, start + text_before))
        pos = [[p] * 3 for p in t]
        base = start + text_before
        pos += [[base, base + i // 3, base + i % 3] for i in range(image)]
        after = base + 3
        pos += [[after + i] * 3 for i in range(tokens - len(pos))]
        rows.append(pos)
    return torch.tensor(rows, device=device).permute(2, 0, 1).contiguous()  # (3, batch, tokens)


def _tables(position_ids, rot, dtype, base=10000.0):
    """Per-axis cos/sin ``(3, batch, tokens, R)`` of the 3-D position ids, as the Qwen-VL rotary
    embeddings compute them before merging the axes."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot, 2, device=position_ids.device).double() / rot)
    freqs = position_ids[..., None].double() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _qk(batch, q_heads, k_heads, tokens, head_dim, dtype, device):
    """q, k as HF attention passes them: (B, T, H, D) projections viewed as (B, H, T, D)."""
    def make(heads):
        return torch.randn(batch, tokens, heads, head_dim, dtype=dtype, device=device).transpose(1, 2).requires_grad_()

    return make(q_heads), make(k_heads)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(
    "head_dim,rot,section", [(16, 16, (3, 4, 1)), (32, 32, (4, 6, 6)), (24, 16, (4, 2, 2)), (40, 40, (8, 5, 7))]
)
@pytest.mark.parametrize(
    "dtype,batch,tokens,q_heads,k_heads",
    [(torch.float32, 3, 1, 3, 1), (torch.float32, 2, 37, 7, 1), (torch.float16, 1, 45, 6, 2)],
)
def test_mrope_matches_reference(poison_outputs, device, dtype, interleaved, head_dim, rot, section, batch, tokens,
                                 q_heads, k_heads):
    q, k = _qk(batch, q_heads, k_heads, tokens, head_dim, dtype, device)
    cos, sin = _tables(_position_ids(batch, tokens, device), rot, dtype)
    out = compare_fwd_bwd(
        lambda q, k: F.mrope(q, k, cos, sin, section, interleaved=interleaved),
        lambda q, k: mrope_reference(q, k, cos.double(), sin.double(), section, interleaved),
        (q, k), name=f"mrope D={head_dim} R={rot}",
    )
    assert out[0].stride() == q.stride() and out[1].stride() == k.stride()


def _apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section):
    """transformers < 5's Qwen2-VL formula, written out: split the R columns into the sections
    (twice over, one per half), take section i from axis i % 3, and rotate as Llama does."""
    chunks = list(mrope_section) * 2
    cos = torch.cat([part[i % 3] for i, part in enumerate(cos.split(chunks, dim=-1))], dim=-1).unsqueeze(1)
    sin = torch.cat([part[i % 3] for i, part in enumerate(sin.split(chunks, dim=-1))], dim=-1).unsqueeze(1)
    half = q.shape[-1] // 2

    def rotate(x):
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def test_matches_the_sectioned_formula_with_unequal_halves(poison_outputs, device):
    # Each of the 2R columns is read from its own section's table, in both halves.
    q, k = _qk(2, 4, 2, 11, 32, torch.float32, device)
    cos, sin = torch.randn(3, 2, 11, 32, device=device), torch.randn(3, 2, 11, 32, device=device)
    compare_fwd_bwd(
        lambda q, k: F.mrope(q, k, cos, sin, [4, 6, 6]),
        lambda q, k: _apply_multimodal_rotary_pos_emb(q, k, cos.double(), sin.double(), [4, 6, 6]),
        (q, k), name="sectioned formula",
    )


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_transformers_rotary_embedding_and_apply(poison_outputs, device, family, dtype):
    """The per-axis tables through tigon equal transformers' own path: its rotary embedding
    module (which merges the axes, interleaved for Qwen3-VL) and its apply_rotary_pos_emb."""
    import transformers

    module, rotary_cls, config_cls, interleaved = FAMILIES[family]
    section = [6, 6, 4]  # unequal, so a wrong axis or bound shows
    config = getattr(transformers, config_cls)(
        hidden_size=96, num_attention_heads=3, head_dim=32, num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
    )
    modeling = _modeling(module)
    rotary = getattr(modeling, rotary_cls)(config).to(device)
    position_ids = _position_ids(2, 23, device) * 37  # large angles too
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=dtype, device=device), position_ids)
    freqs = position_ids[..., None].float() * rotary.inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * rotary.attention_scaling).to(dtype), (emb.sin() * rotary.attention_scaling).to(dtype)
    # the merge is transformers': per-axis tables merged by section give its cos/sin exactly
    assert torch.equal(merge_tables(cos, section, interleaved), hf_cos)
    assert torch.equal(merge_tables(sin, section, interleaved), hf_sin)
    q, k = _qk(2, 3, 1, 23, 32, dtype, device)
    out = compare_fwd_bwd(
        lambda q, k: F.mrope(q, k, cos, sin, section, interleaved=interleaved),
        lambda q, k: modeling.apply_rotary_pos_emb(q, k, hf_cos.double(), hf_sin.double()),
        (q, k), name=f"vs {family}",
    )
    if dtype == torch.float32:  # against transformers' own fp32 arithmetic: equal up to rounding
        for ours, theirs in zip(out, modeling.apply_rotary_pos_emb(q, k, hf_cos, hf_sin)):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_merged_tables_on_rope_give_the_same(device):
    # On transformers >= 5 the merged table goes to the plain rotation: the same numbers.
    q, k = _qk(2, 5, 1, 13, 32, torch.float32, device)
    cos, sin = _tables(_position_ids(2, 13, device), 32, torch.float32)
    for interleaved in (False, True):
        ours = F.mrope(q, k, cos, sin, [4, 6, 6], interleaved=interleaved)
        merged = F.rope(q, k, merge_tables(cos, [4, 6, 6], interleaved), merge_tables(sin, [4, 6, 6], interleaved))
        for a, b in zip(ours, merged):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_batch_broadcast_tables(poison_outputs, device):
    q, k = _qk(3, 2, 2, 9, 16, torch.float32, device)
    cos, sin = _tables(_position_ids(1, 9, device), 16, torch.float32)
    compare_fwd_bwd(
        lambda q, k: F.mrope(q, k, cos, sin, [2, 3, 3]),
        lambda q, k: mrope_reference(q, k, cos.double(), sin.double(), [2, 3, 3]),
        (q, k), name="batch 1 tables",
    )


def test_one_launch_forward_and_backward(device):
    q, k = _qk(2, 5, 3, 8, 16, torch.float32, device)
    cos, sin = _tables(_position_ids(2, 8, device), 16, torch.float32)
    with kernel_launches() as launches:
        out = F.mrope(q, k, cos, sin, [2, 3, 3], interleaved=True)
        sum(o.sum() for o in out).backward()
    assert launches == {"_mrope_kernel": 2}


def test_strided_inputs_are_not_copied(poison_outputs, device, monkeypatch):
    # Slices of one fused qkv projection, viewed as HF does: neither q nor k is contiguous.
    qkv = torch.randn(2, 9, (4 + 2 + 2) * 16, device=device)
    q = qkv[..., : 4 * 16].view(2, 9, 4, 16).transpose(1, 2)
    k = qkv[..., 4 * 16 : 6 * 16].view(2, 9, 2, 16).transpose(1, 2)
    cos, sin = _tables(_position_ids(2, 9, device), 16, torch.float32)
    expected = mrope_reference(q, k, cos, sin, [2, 3, 3])

    def no_copies(*args, **kwargs):
        raise AssertionError("mrope copied an input")

    monkeypatch.setattr(torch.Tensor, "contiguous", no_copies)
    monkeypatch.setattr(torch.Tensor, "clone", no_copies)
    out = F.mrope(q, k, cos, sin, [2, 3, 3])
    monkeypatch.undo()
    for got, want in zip(out, expected):
        assert_close(got, want, name="strided")


def test_nan_in_nan_out(device):
    q, k = _qk(1, 2, 1, 5, 16, torch.float32, device)
    cos, sin = _tables(_position_ids(1, 5, device), 16, torch.float32)
    with torch.no_grad():
        q[0, 1, 2, 3] = float("nan")
        k[0, 0, 4, 10] = float("inf")
    q_out, k_out = F.mrope(q, k, cos, sin, [2, 3, 3])
    q_ref, k_ref = mrope_reference(q, k, cos, sin, [2, 3, 3])
    assert torch.equal(q_out.isnan(), q_ref.isnan()) and q_out[0, 1, 2].isnan().any()
    assert torch.equal(k_out.isfinite(), k_ref.isfinite()) and not k_out[0, 0, 4].isfinite().all()
    grad = torch.zeros_like(q_out)
    grad[0, 0, 1, 0] = float("nan")
    q_out.backward(grad, inputs=[q])
    assert q.grad[0, 0, 1].isnan().any() and q.grad[0, 0, 0].isfinite().all()


def test_only_one_output_used_and_frozen_key(device):
    q, k = _qk(2, 4, 2, 5, 16, torch.float32, device)
    k = k.detach()
    cos, sin = _tables(_position_ids(2, 5, device), 16, torch.float32)
    q_out, _ = F.mrope(q, k, cos, sin, [2, 3, 3])
    grad = torch.randn_like(q_out)
    q_out.backward(grad)
    q_ref = q.detach().clone().requires_grad_()
    mrope_reference(q_ref, k, cos, sin, [2, 3, 3])[0].backward(grad)
    assert_close(q.grad, q_ref.grad, name="grad q")
    assert k.grad is None


def test_mixed_dtype_promotes_and_grads_keep_the_inputs_dtype(device):
    q, k = _qk(1, 2, 1, 6, 16, torch.float16, device)
    cos, sin = _tables(_position_ids(1, 6, device), 16, torch.float32)
    out = F.mrope(q, k, cos, sin, [2, 3, 3])
    assert out[0].dtype == out[1].dtype == torch.float32
    for got, want in zip(out, mrope_reference(q, k, cos, sin, [2, 3, 3])):
        assert_close(got, want, torch.float16)
    sum(o.sum() for o in out).backward()
    assert q.grad.dtype == k.grad.dtype == torch.float16


def test_tables_requiring_grad_use_the_reference(device):
    q, k = _qk(1, 2, 1, 6, 16, torch.float32, device)
    cos, sin = _tables(_position_ids(1, 6, device), 16, torch.float32)
    cos.requires_grad_()
    sum(o.sum() for o in F.mrope(q, k, cos, sin, [2, 3, 3])).backward()
    assert cos.grad is not None and cos.grad.abs().sum() > 0


def _bad(q_shape=(2, 4, 5, 16), k_shape=(2, 2, 5, 16), cos_shape=(3, 2, 5, 16), sin_shape=None, section=(2, 3, 3), **kw):
    sin_shape = sin_shape or cos_shape
    return lambda: F.mrope(torch.randn(q_shape), torch.randn(k_shape), torch.randn(cos_shape), torch.randn(sin_shape),
                           section, **kw)


@pytest.mark.parametrize(
    "call,match",
    [
        (_bad(q_shape=(4, 5, 16)), r"q must have shape \(batch, heads, tokens, head_dim\)"),
        (_bad(k_shape=(2, 2, 6, 16)), r"k must have shape \(2, kv_heads, 5, 16\)"),
        (_bad(cos_shape=(2, 5, 16)), r"cos must have shape \(3, 2 or 1, 5, R\)"),
        (_bad(cos_shape=(3, 3, 5, 16)), "cos must have shape"),
        (_bad(cos_shape=(3, 2, 5, 18)), "cos must have shape"),
        (_bad(sin_shape=(3, 2, 5, 8)), r"sin must have the shape of cos"),
        (_bad(section=(2, 3, 2)), r"mrope_section must be 3 non-negative ints .* R/2 = 8"),
        (_bad(section=(8,)), "mrope_section must be"),
        (_bad(section=(2.0, 3, 3)), "mrope_section must be"),
        (_bad(interleaved=1), "interleaved must be True or False"),
        (lambda: F.mrope(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8).half(), torch.randn(3, 1, 2, 8),
                         torch.randn(3, 1, 2, 8), [1, 2, 1]), "k must have the dtype of q"),
    ],
)
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- vision_rope ------------------------------------------------------------------------------

def _vision_qk(tokens, heads, head_dim, dtype, device):
    """q, k as the Qwen-VL vision attention makes them: slices of one qkv projection,
    ``reshape(tokens, 3, heads, D).permute(1, 0, 2, 3).unbind(0)``."""
    qkv = torch.randn(tokens, 3 * heads * head_dim, dtype=dtype, device=device)
    q, k, _ = qkv.reshape(tokens, 3, heads, head_dim).permute(1, 0, 2, 3).unbind(0)
    return q.detach().requires_grad_(), k.detach().requires_grad_()


def _vision_tables(tokens, head_dim, device):
    """fp32 cos/sin ``(tokens, head_dim)`` of 2-D (row, column) positions: each axis's angles over
    head_dim / 4 frequencies, merged and written twice, as the towers' rotary embedding does."""
    rows, cols = torch.arange(tokens, device=device) // 5, torch.arange(tokens, device=device) % 5
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim // 2, 2, device=device).float() / (head_dim // 2))
    freqs = torch.cat((rows[:, None] * inv_freq, cols[:, None] * inv_freq), dim=-1)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype,tokens,heads,head_dim", [(torch.float32, 31, 3, 16), (torch.float16, 53, 2, 40)])
def test_vision_rope_matches_transformers(poison_outputs, device, family, dtype, tokens, heads, head_dim):
    modeling = _modeling(family)
    q, k = _vision_qk(tokens, heads, head_dim, dtype, device)
    cos, sin = _vision_tables(tokens, head_dim, device)
    out = compare_fwd_bwd(
        lambda q, k: F.vision_rope(q, k, cos, sin),
        lambda q, k: modeling.apply_rotary_pos_emb_vision(q, k, cos.double(), sin.double()),
        (q, k), name=f"vision {family}",
    )
    assert out[0].dtype == out[1].dtype == dtype
    if dtype == torch.float32:
        for ours, theirs in zip(out, modeling.apply_rotary_pos_emb_vision(q, k, cos, sin)):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    else:  # fp32 inside, one rounding out: transformers' own fp16 result to the last bit, nearly everywhere
        for ours, theirs in zip(out, modeling.apply_rotary_pos_emb_vision(q, k, cos, sin)):
            assert (ours != theirs).float().mean() < 0.01


def test_vision_rope_reference_is_transformers(device):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    q, k = _vision_qk(17, 2, 16, torch.float16, device)
    cos, sin = _vision_tables(17, 16, device)
    for ours, theirs in zip(vision_rope_reference(q, k, cos, sin), apply_rotary_pos_emb_vision(q, k, cos, sin)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_vision_rope_one_launch_and_partial_rotary(poison_outputs, device):
    q, k = _vision_qk(19, 3, 24, torch.float32, device)
    cos, sin = _vision_tables(19, 16, device)
    with kernel_launches() as launches:
        compare_fwd_bwd(
            lambda q, k: F.vision_rope(q, k, cos, sin),
            lambda q, k: vision_rope_reference(q, k, cos.double(), sin.double()),
            (q, k), name="partial",
        )
    assert launches == {"_mrope_kernel": 2}


def test_vision_rope_nan_in_nan_out(device):
    q, k = _vision_qk(7, 2, 16, torch.float32, device)
    cos, sin = _vision_tables(7, 16, device)
    with torch.no_grad():
        q[3, 1, 5] = float("nan")
    q_out, k_out = F.vision_rope(q, k, cos, sin)
    assert q_out[3, 1].isnan().any() and q_out[2].isfinite().all() and k_out.isfinite().all()


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: F.vision_rope(torch.randn(1, 5, 2, 16), torch.randn(5, 2, 16), torch.randn(5, 16), torch.randn(5, 16)),
         r"q must have shape \(tokens, heads, head_dim\)"),
        (lambda: F.vision_rope(torch.randn(5, 2, 16), torch.randn(5, 2, 8), torch.randn(5, 16), torch.randn(5, 16)),
         r"k must have shape \(5, heads, 16\)"),
        (lambda: F.vision_rope(torch.randn(5, 2, 16), torch.randn(5, 2, 16), torch.randn(4, 16), torch.randn(4, 16)),
         r"cos must have shape \(5, R\)"),
    ],
)
def test_vision_rope_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("interleaved,section", [(False, (16, 24, 24)), (True, (24, 20, 20))])
@pytest.mark.parametrize("batch,q_heads,k_heads,tokens", [(4, 28, 4, 2304), (2, 12, 2, 1023), (1, 16, 8, 4097)])
def test_mrope_bf16_on_gpu(interleaved, section, batch, q_heads, k_heads, tokens):
    device = torch.device("cuda")
    q, k = _qk(batch, q_heads, k_heads, tokens, 128, torch.bfloat16, device)
    cos, sin = _tables(_position_ids(batch, tokens, device), 128, torch.bfloat16)
    compare_fwd_bwd(
        lambda q, k: F.mrope(q, k, cos, sin, section, interleaved=interleaved),
        lambda q, k: mrope_reference(q, k, cos.double(), sin.double(), section, interleaved),
        (q, k), torch.bfloat16, name="bf16",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,heads,head_dim", [(4096, 16, 80), (1031, 16, 72)])
def test_vision_rope_bf16_on_gpu(tokens, heads, head_dim):
    device = torch.device("cuda")
    q, k = _vision_qk(tokens, heads, head_dim, torch.bfloat16, device)
    cos, sin = _vision_tables(tokens, head_dim, device)
    compare_fwd_bwd(
        lambda q, k: F.vision_rope(q, k, cos, sin),
        lambda q, k: vision_rope_reference(q, k, cos.double(), sin.double()),
        (q, k), torch.bfloat16, name="vision bf16",
    )
