"""Tiny random-weight vision-language models of every patched VLM family, built from the HF config
classes, and a batch for each: text with one image's tokens in it, the image's pixels, the extras
the family's forward takes (grids, sizes)."""

from __future__ import annotations

import inspect

import pytest
import torch

VOCAB = 300
IMAGE, VIDEO, START, END = 290, 291, 292, 293  # special token ids inside the tiny vocabulary
TEXT = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    initializer_range=0.1,
)
# 3-D M-RoPE over the 8 dims of a head: 1 + 1 + 2 frequencies for time, height and width.
M_ROPE = {"rope_type": "default", "mrope_section": [1, 1, 2]}
QWEN_VISION = dict(depth=2, hidden_size=32, num_heads=4, spatial_merge_size=2, patch_size=4, temporal_patch_size=2)
QWEN_IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8)

# model_type -> (config keywords, image tokens per image, the pixels' layout)
SPECS = {
    "qwen2_vl": (dict(text_config=dict(TEXT, rope_scaling=M_ROPE), vision_config=dict(QWEN_VISION, embed_dim=32, mlp_ratio=2),
                      **QWEN_IDS), 4, "patches"),
    "qwen2_5_vl": (dict(text_config=dict(TEXT, rope_scaling=M_ROPE), vision_config=dict(
        QWEN_VISION, intermediate_size=64, out_hidden_size=32, fullatt_block_indexes=[1], window_size=16), **QWEN_IDS),
        4, "patches"),
    "qwen3_vl": (dict(text_config=dict(TEXT, rope_scaling=dict(M_ROPE, mrope_interleaved=True)), vision_config=dict(
        QWEN_VISION, intermediate_size=64, out_hidden_size=32, deepstack_visual_indexes=[1], num_position_embeddings=16),
        **QWEN_IDS), 4, "patches"),
    "qwen3_vl_moe": (dict(text_config=dict(TEXT, rope_scaling=dict(M_ROPE, mrope_interleaved=True), num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1,
                                           mlp_only_layers=[1], output_router_logits=True), vision_config=dict(
        QWEN_VISION, intermediate_size=64, out_hidden_size=32, deepstack_visual_indexes=[1], num_position_embeddings=16),
        **QWEN_IDS), 4, "patches"),
    "mllama": (dict(text_config=dict(TEXT, cross_attention_layers=[1]), vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=4, image_size=16,
        patch_size=8, max_num_tiles=1, supported_aspect_ratios=[[1, 1]], intermediate_layers_indices=[0],
        vision_output_dim=64), image_token_index=IMAGE), 1, "tiles"),
    "glm4v": (dict(text_config=dict(TEXT, head_dim=16, rope_parameters=dict(M_ROPE, partial_rotary_factor=0.5)), vision_config=dict(
        QWEN_VISION, intermediate_size=64, out_hidden_size=32, image_size=16), image_token_id=IMAGE, video_token_id=VIDEO,
        image_start_token_id=START, image_end_token_id=END), 4, "patches"),
    "gemma3": (dict(text_config=dict(TEXT, sliding_window=8, final_logit_softcapping=30.0), vision_config=SIGLIP,
                    mm_tokens_per_image=4, image_token_index=IMAGE, boi_token_index=START, eoi_token_index=END), 4, "image"),
    # AltUp, Laurel and per-layer inputs; layer 0's MLP with a sparse gate (HF's), layer 1's dense
    # (tigon's). The tower is timm's: its tiny test EfficientNet (MobileNet-V5 is built by the same
    # builder) makes a 64 x 64 image 4 soft tokens of 256 channels. A small audio tower, never called.
    "gemma3n": (dict(text_config=dict(
        TEXT, sliding_window=8, layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=3.0,
        activation_sparsity_pattern=[0.95, 0.0], num_kv_shared_layers=0, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=VOCAB, laurel_rank=8, altup_num_inputs=2), vision_config=dict(
        architecture="test_efficientnet", hidden_size=256), audio_config=dict(
        hidden_size=16, input_feat_size=8, conf_num_hidden_layers=1, conf_num_attention_heads=2,
        sscp_conv_channel_size=[4, 4]), vision_soft_tokens_per_image=4, image_token_id=IMAGE, boi_token_id=START,
        eoi_token_id=END), 4, "wide"),
    # Per-layer inputs and an expert block beside the MLP, as gemma4_text's tiny model; a tower of
    # clippable linears over 16 patches pooled 2 x 2 into 4 soft tokens; the images' tokens
    # attending to each other in the sliding layers.
    "gemma4": (dict(text_config=dict(
        TEXT, sliding_window=8, final_logit_softcapping=3.0, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=VOCAB, global_head_dim=16, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=16, use_bidirectional_attention="vision"), vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        head_dim=8, patch_size=4, pooling_kernel_size=2, position_embedding_size=8, use_clipped_linears=True),
        audio_config=None, image_token_id=IMAGE, video_token_id=VIDEO, boi_token_id=START, eoi_token_id=END), 4,
        "positioned"),
    "llava": (dict(text_config=dict(TEXT, model_type="llama"), vision_config=dict(
        SIGLIP, model_type="clip_vision_model", projection_dim=32), image_token_index=IMAGE), 16, "image"),
    "paligemma": (dict(text_config=dict(TEXT, model_type="gemma"), vision_config=dict(SIGLIP, projection_dim=32),
                       image_token_index=IMAGE, projection_dim=32), 16, "image"),
    "idefics3": (dict(text_config=dict(TEXT, model_type="llama"), vision_config=SIGLIP, scale_factor=2,
                      image_token_id=IMAGE), 4, "images"),
    "smolvlm": (dict(text_config=dict(TEXT, model_type="llama"), vision_config=SIGLIP, scale_factor=2,
                     image_token_id=IMAGE), 4, "images"),
    "internvl": (dict(text_config=dict(TEXT, model_type="qwen2"), vision_config=dict(
        SIGLIP, image_size=[32, 32], patch_size=[8, 8]), image_token_id=IMAGE), 4, "image"),
    # (Their any-resolution tiling makes an image's token count a function of its size: these run
    # on text alone, which still goes through the multimodal model and head tigon patches.)
    "llava_next": (dict(text_config=dict(TEXT, model_type="llama"), vision_config=dict(
        SIGLIP, model_type="clip_vision_model", projection_dim=32), image_token_index=IMAGE,
        image_grid_pinpoints=[[32, 32]]), 0, "text"),
    "llava_onevision": (dict(text_config=dict(TEXT, model_type="qwen2"), vision_config=SIGLIP, image_token_index=IMAGE,
                             video_token_index=VIDEO, image_grid_pinpoints=[[32, 32]]), 0, "text"),
    "mistral3": (dict(text_config=dict(TEXT, model_type="mistral"), vision_config=dict(
        SIGLIP, model_type="pixtral", head_dim=8), image_token_index=IMAGE, spatial_merge_size=2), 4, "sized"),
}


# Packages beyond transformers that a family's vision tower is built with.
TOWER_PACKAGES = {"gemma3n": "timm"}


def vlm_params(model_types=None) -> list:
    """`model_types` (default: every VLM family of SPECS) as pytest parameters, each skipped where
    transformers lacks it."""
    import importlib.util

    def missing(model_type: str) -> str | None:
        if importlib.util.find_spec(f"transformers.models.{model_type}.modeling_{model_type}") is None:
            return f"transformers has no {model_type}"
        package = TOWER_PACKAGES.get(model_type)
        try:
            importlib.import_module(package or "transformers")
        except ImportError as err:
            return f"{model_type}'s vision tower needs {package}: {err}"
        return None

    params = []
    for model_type in SPECS if model_types is None else model_types:
        reason = missing(model_type)
        params.append(pytest.param(model_type, marks=pytest.mark.skipif(reason is not None, reason=reason or "")))
    return params


def tiny_vlm(model_type: str, seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.for_model(model_type, **SPECS[model_type][0])
    config._attn_implementation = "eager"
    for sub in (config, config.get_text_config(), getattr(config, "vision_config", None)):
        if sub is not None:
            sub._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms away from 1 (or 0), so a wrong offset or rounding shows
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5 + 0.5)
    return model.to(dtype)


def vlm_batch(model_type: str, seed: int = 0, rows: int = 2, text: int = 9) -> dict:
    """Keyword arguments of one training forward: each row is text, one image's tokens, text;
    labels ignore the image tokens and the first text token."""
    _, tokens, layout = SPECS[model_type]
    gen = torch.Generator().manual_seed(seed)
    before = torch.randint(3, IMAGE - 10, (rows, 3), generator=gen)
    after = torch.randint(3, IMAGE - 10, (rows, text), generator=gen)
    image = torch.full((rows, tokens), IMAGE)
    if layout == "patches":
        image = torch.cat((torch.full((rows, 1), START), image, torch.full((rows, 1), END)), dim=1)
    ids = torch.cat((before, image, after), dim=1)
    labels = ids.masked_fill((ids == IMAGE) | (ids == START) | (ids == END), -100)
    labels[:, 0] = -100
    batch = dict(input_ids=ids, labels=labels)
    if layout == "patches":  # one 8 x 8 image: a 1 x 2 x 2 grid of merged 4 x 4 patches
        batch["pixel_values"] = torch.randn(rows * 16, 3 * 2 * 4 * 4, generator=gen)
        batch["image_grid_thw"] = torch.tensor([[1, 4, 4]] * rows)
    elif layout == "text":
        pass
    elif layout == "tiles":  # one 16 x 16 image of one tile, which the tokens after it attend to
        batch["pixel_values"] = torch.randn(rows, 1, 1, 3, 16, 16, generator=gen)
        batch["aspect_ratio_ids"] = torch.ones(rows, 1, dtype=torch.long)
        batch["aspect_ratio_mask"] = torch.ones(rows, 1, 1, dtype=torch.long)
        batch["cross_attention_mask"] = (torch.arange(ids.shape[1]) >= 3).long()[None, :, None, None].expand(
            rows, -1, 1, 1).contiguous()
    elif layout == "positioned":  # one 16 x 16 image: a 4 x 4 grid of 4 x 4 patches, with each one's (x, y)
        batch["pixel_values"] = torch.rand(rows, 16, 3 * 4 * 4, generator=gen)
        grid = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), dim=-1).reshape(16, 2)
        batch["image_position_ids"] = grid.expand(rows, 16, 2).contiguous()
        batch["mm_token_type_ids"] = (ids == IMAGE).int()
    elif layout == "images":
        batch["pixel_values"] = torch.randn(rows, 1, 3, 32, 32, generator=gen)
    elif layout == "wide":
        batch["pixel_values"] = torch.randn(rows, 3, 64, 64, generator=gen)
    else:
        batch["pixel_values"] = torch.randn(rows, 3, 32, 32, generator=gen)
    if layout == "sized":
        batch["image_sizes"] = torch.tensor([[32, 32]] * rows)
    if layout == "patches" and "mm_token_type_ids" in inspect.signature(_model_class(model_type).forward).parameters:
        batch["mm_token_type_ids"] = (ids == IMAGE).int()  # newer transformers: which tokens are an image's
    if model_type == "paligemma":
        batch["token_type_ids"] = (labels != -100).long()
    return batch


def _model_class(model_type: str) -> type:
    """The multimodal model class (under the *ForConditionalGeneration) of `model_type`."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    return MODEL_MAPPING[type(AutoConfig.for_model(model_type, **SPECS[model_type][0]))]
