"""Which parts of each Hugging Face decoder family tigon replaces, as data.

One entry per ``config.model_type``. Names refer to attributes of
``transformers.models.<module>.modeling_<module>``; :mod:`tigon.patch.apply` walks this table for
every family alike, so adding a family is adding an entry here. Nothing is imported from
transformers here: a family's module is looked up only when it is patched, so an entry whose
module a given transformers lacks costs nothing until then (:func:`available` says which do).

Mixture-of-experts families name their dense MLP (used by shared experts and dense layers) as
`mlp`, and, as `experts`, the experts class transformers dispatches through its experts interface
(``@use_experts_implementation``): the ``moe_experts`` switch sends those to tigon's fused experts
op (:mod:`tigon.patch.moe`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

# `Norm.cls` of torch's own LayerNorm, which families build directly.
TORCH_LAYER_NORM = "torch.nn.LayerNorm"


@dataclass(frozen=True)
class Norm:
    """A family's norm class and how its arithmetic rounds (see :func:`tigon.functional.rms_norm`).

    Attributes:
        cls: the class name; :data:`TORCH_LAYER_NORM` for torch's ``nn.LayerNorm``, which the
            family's modules build directly (only a patched model instance has those replaced: a
            class patch of torch's would reach every LayerNorm in the process).
        kind: ``"rms"`` (the ``rms_norm`` switch) or ``"layer"`` (``layer_norm``).
        offset: added to the weight (Gemma's ``1 + weight``; Nemotron's LayerNorm1P).
        casting: the RMSNorm's rounding; for a LayerNorm class of the family's own, which computes in
            float32 and rounds once (OLMo, Cohere), ``"float32"``; for a subclass of torch's
            LayerNorm that follows autocast as torch's does (Nemotron), ``"torch"``.
        eps: the attribute holding epsilon (Llama's modules call it `variance_epsilon`), several
            names where transformers renamed it between releases (the first the module has is
            read), or the value itself where the module hard-codes it (OLMo's LayerNorm).
        weight: False for a norm with no weight (Llama 4's QK L2 norm, OLMo's LayerNorm).
    """

    cls: str
    offset: float = 0.0
    casting: str = "llama"
    eps: str | tuple[str, ...] | float = "variance_epsilon"
    kind: str = "rms"
    weight: bool = True

    @property
    def switch(self) -> str:
        return "layer_norm" if self.kind == "layer" else "rms_norm"

    @property
    def in_torch(self) -> bool:
        """Whether the class is torch's nn.LayerNorm, not one of the family's module."""
        return self.cls == TORCH_LAYER_NORM


# Where the residual adds of a decoder layer feed RMSNorms: the attributes of its norms.
PRE_NORM = ("input_layernorm", "post_attention_layernorm")
SANDWICH = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


@dataclass(frozen=True)
class Layer:
    """A decoder-layer class and where a residual add feeds an RMSNorm inside it.

    Attributes:
        cls: the class name.
        norms: the norm attributes, for a layer whose forward is fused: two for a pre-norm layer,
            ``(input norm, norm before the MLP)``, whose add is ``norm_2(residual + attn)``
            (Llama); four for a sandwich layer, ``(input norm, attention-output norm, norm before
            the MLP, MLP-output norm)``, whose add is ``norm_3(residual + norm_2(attn))`` (Gemma
            2/3, GLM-4). None when no add feeds an RMSNorm (OLMo 2 normalises the sublayer outputs,
            not the sums; Cohere runs attention and MLP in parallel; LayerNorm families).
        scale: attribute multiplying each sublayer's output before the add (Granite).
        dropout: the modules applied to the attention and MLP outputs before the add (Phi-3).
        mixers: the attributes that may hold the layer's token mixer, the first one the layer has
            being called (hybrid models hold ``linear_attn`` in some layers, ``self_attn`` in the
            others); one returning a tuple gives its first element.
        feed_forward: the attribute holding the MLP (or the mixture-of-experts block, whose output
            may be a tuple: its first element is the hidden states).
    """

    cls: str
    norms: tuple[str, ...] | None = PRE_NORM
    scale: str | None = None
    dropout: tuple[str, str] | None = None
    mixers: tuple[str, ...] = ("self_attn",)
    feed_forward: str = "mlp"

    @property
    def fuse(self) -> str | None:
        """``"pre_norm"``, ``"sandwich"`` or None (see `norms`)."""
        if self.norms is None:
            return None
        return "sandwich" if len(self.norms) == 4 else "pre_norm"


@dataclass(frozen=True)
class MLP:
    """A family's MLP class.

    Attributes:
        cls: the class name.
        switch: for a gated MLP, ``down(act(gate) * up)``, the switch of its activation:
            ``"swiglu"`` (SiLU gate) or ``"geglu"`` (GELU gate); a module whose activation turns out
            to be another keeps HF's forward. None for an MLP that is not gated (no kernel of
            tigon's computes it; ``tiled_mlp`` still wraps it).
        act: the attribute holding the activation module.
        projections: the attributes of its linears: gate, up and down; or one packed
            ``gate_up_proj`` whose output is ``[gate, up]`` (Phi-3, GLM) and down; for an MLP that
            is not gated, in the order it calls them.
        multipliers: attributes of the scalars the gate's pre-activation and the output are
            multiplied by, ``down(up * act(gate * m_gate)) * m_down`` (Falcon-H1).
        dropout: attribute of the dropout probability applied to the output in training (Seed-OSS).
        module: the modeling module (directory under ``transformers.models``) holding `cls` where it
            is not the family's: a vision tower of a model type of its own (SigLIP, CLIP).
        sparsity: attribute of a module's activation sparsity (Gemma 3n), a Gaussian top-k cut of
            the gate before its activation, which no kernel computes: a module where it is not 0
            keeps HF's forward, the others run tigon's.

    A vision tower's MLP that is not gated, ``fc2(gelu(fc1(x)))``, has the switch ``"gelu_mlp"``.
    """

    cls: str
    switch: str | None = "swiglu"
    act: str = "act_fn"
    projections: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    multipliers: tuple[str, str] | None = None
    dropout: str | None = None
    module: str | None = None
    sparsity: str | None = None

    @property
    def gated(self) -> bool:
        return self.switch in ("swiglu", "geglu")

    @property
    def packed(self) -> bool:
        return self.gated and len(self.projections) == 2


@dataclass(frozen=True)
class Attention:
    """An attention class whose forward calls its projections on its `hidden_states`
    (``self.q_proj(hidden_states)``, ...), and the attributes holding them: q, k and v, or whichever
    linears read the hidden states (DeepSeek's MLA: the query and the compressed key/value ones)."""

    cls: str
    projections: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")


@dataclass(frozen=True)
class Rope:
    """A module-level rotary-embedding function of the family.

    Attributes:
        function: its name in the modeling module.
        form: its arguments: ``"cos_sin"``, ``(q, k, cos, sin, unsqueeze_dim=1)`` as Llama's
            ``apply_rotary_pos_emb``; ``"complex"``, ``(q, k, freqs_cis)`` with each frequency
            once, as a complex number rotating a pair (2i, 2i + 1) (Llama 4, DeepSeek-V2: entries
            with `interleaved`); or ``"vision"``, ``(q, k, cos, sin)`` with q and k as
            ``(patches, heads, head_dim)`` and cos/sin ``(patches, head_dim)``, computed in float32
            and rounded to q's dtype (the vision towers' 2-D rotary of Qwen-VL and GLM-4V).
        interleaved: the pairs rotated are (2i, 2i + 1) (GPT-J, GLM), not (i, i + R/2).
        cos: how cos/sin hold the R/2 frequencies: ``"cat"`` (``cat(f, f)``, Llama), ``"once"``
            (``f``, GPT-OSS) or ``"pairs"`` (``repeat_interleave(f, 2)``, Cohere).
        keep_dtype: the result is cast back to q's and k's dtypes (OLMo 2, Cohere, ERNIE, the
            complex form).
        tokens_first: q and k are ``(batch, tokens, heads, head_dim)`` (Llama 4's complex form).
        halves: the pairs (2i, 2i + 1) rotated are written back as two halves, evens first
            (DeepSeek-V3's ``apply_rotary_pos_emb_interleave``).
    """

    function: str = "apply_rotary_pos_emb"
    form: str = "cos_sin"
    interleaved: bool = False
    cos: str = "cat"
    keep_dtype: bool = False
    tokens_first: bool = False
    halves: bool = False


@dataclass(frozen=True)
class Head:
    """What the ``*ForCausalLM`` forward does between the last hidden state and the loss.

    Attributes:
        softcap: config attribute of the final-logit softcap, ``cap * tanh(logits / cap)``, None
            when unset (Gemma 2/3).
        scale: config attribute that the logits are divided by (Granite).
        multiplier: config attribute that the logits are multiplied by (Cohere, Falcon-H1).
        aux_loss: module-level router load-balancing loss added when router logits are output
            (the MoE families).
        positions: False where the model derives the positions of a batch given none itself, as
            the M-RoPE models do (Qwen-VL, GLM-4V: 3-D positions from the images' grids), so
            none may be made up for it.

    The config attributes are read from the text config of a multimodal model.
    """

    softcap: str | None = None
    scale: str | None = None
    multiplier: str | None = None
    aux_loss: str | None = None
    positions: bool = True


# Norm variants shared by several families.
LLAMA_NORM = "llama"
GEMMA_NORM = "gemma"


@dataclass(frozen=True)
class Family:
    """What to replace in one family's modeling module.

    Attributes:
        module: the modeling module's directory under ``transformers.models``.
        causal_lm: the ``*ForCausalLM`` class.
        layer: the decoder-layer class and its residual structure.
        norm: the norm class of the decoder layers, with its rounding.
        mlp: the dense MLP, if the family has one (MoE experts keep HF's code).
        attention: the attention, if it calls separate projections on its input (Phi-3 packs q, k
            and v into one ``qkv_proj``).
        ropes: the rotary-embedding functions.
        head: the causal-LM head's extras.
        other_norms: further norm classes the family builds (Llama 4's weightless QK norm), on the
            same switches as `norm`.
        experts: the mixture-of-experts experts class, if transformers dispatches it through its
            experts interface (Llama 4's experts are not, and keep their code).
        other_mlps: further MLP classes (a vision tower's), gated ones on the same switches as
            `mlp` but never joined with a decoder layer's add + RMSNorm, GELU ones on ``gelu_mlp``.
        head_module: the modeling module (directory) holding `causal_lm`, where it is not
            `module`: a multimodal model's ``*ForConditionalGeneration`` over a language model
            of a text family (:data:`VLM_OVER_TEXT`).
        patch_embed: a vision tower's patch-embedding class whose ``proj`` is a Conv3d with its
            stride equal to its kernel over patches the processor already cut (Qwen-VL, GLM-4V):
            one GEMM over the flattened patches, on switch ``patch_embed``.
        vision_attention: a vision tower's attention class over images packed into one sequence
            (``cu_seqlens`` bounds each image's tokens; Qwen-VL, GLM-4V), on switch
            ``vision_attention``.
    """

    module: str
    causal_lm: str
    layer: Layer
    norm: Norm
    mlp: MLP | None
    attention: Attention | None
    ropes: tuple[Rope, ...]
    head: Head
    other_norms: tuple[Norm, ...] = ()
    experts: str | None = None
    other_mlps: tuple[MLP, ...] = ()
    head_module: str | None = None
    patch_embed: str | None = None
    vision_attention: str | None = None

    @property
    def mlps(self) -> tuple[MLP, ...]:
        return (self.mlp, *self.other_mlps) if self.mlp is not None else self.other_mlps

    @property
    def norms(self) -> tuple[Norm, ...]:
        return (self.norm, *self.other_norms)


def _norm(prefix: str, kind: str = LLAMA_NORM) -> Norm:
    if kind == GEMMA_NORM:
        return Norm(f"{prefix}RMSNorm", offset=1.0, casting="gemma", eps="eps")
    return Norm(f"{prefix}RMSNorm")


LAYER_NORM = Norm(TORCH_LAYER_NORM, eps="eps", kind="layer")
MOE_HEAD = Head(aux_loss="load_balancing_loss_func")
SOFTCAP_HEAD = Head(softcap="final_logit_softcapping")
M_ROPE_HEAD = Head(positions=False)


def _gelu_mlp(cls: str, act: str = "activation_fn", fc: tuple[str, str] = ("fc1", "fc2"), module: str | None = None) -> MLP:
    return MLP(cls, "gelu_mlp", act=act, projections=fc, module=module)


SIGLIP_MLP = _gelu_mlp("SiglipMLP", module="siglip")
CLIP_MLP = _gelu_mlp("CLIPMLP", module="clip")
VISION_ROPE = Rope("apply_rotary_pos_emb_vision", form="vision", keep_dtype=True)
# (x * w) rounded once, as Gemma's, without the +1 (OLMo 2, GPT-OSS, Helium).
FLOAT_WEIGHT = "gemma"
_DEFAULT = object()


def _family(
    module: str,
    prefix: str,
    *,
    norm: Norm | None = None,
    mlp: MLP | None | object = _DEFAULT,
    attention: Attention | None | object = _DEFAULT,
    rope: Rope | tuple[Rope, ...] = Rope(),
    head: Head = Head(),
    causal_lm: str | None = None,
    other_norms: tuple[Norm, ...] = (),
    experts: bool = False,
    other_mlps: tuple[MLP, ...] = (),
    patch_embed: str | None = None,
    vision_attention: str | None = None,
    **layer,
) -> Family:
    return Family(
        module=module,
        causal_lm=causal_lm or f"{prefix}ForCausalLM",
        layer=Layer(f"{prefix}DecoderLayer", **layer),
        norm=norm or _norm(prefix),
        mlp=MLP(f"{prefix}MLP") if mlp is _DEFAULT else mlp,
        attention=Attention(f"{prefix}Attention") if attention is _DEFAULT else attention,
        ropes=rope if isinstance(rope, tuple) else (rope,),
        head=head,
        other_norms=other_norms,
        experts=f"{prefix}Experts" if experts else None,
        other_mlps=other_mlps,
        patch_embed=patch_embed,
        vision_attention=vision_attention,
    )


FAMILIES: dict[str, Family] = {
    "llama": _family("llama", "Llama"),
    "mistral": _family("mistral", "Mistral"),
    "ministral": _family("ministral", "Ministral"),
    "ministral3": _family("ministral3", "Ministral3"),
    "mixtral": _family("mixtral", "Mixtral", experts=True, mlp=None, head=MOE_HEAD),
    "qwen2": _family("qwen2", "Qwen2"),
    # The dense MLP of the shared expert and of the layers listed in `mlp_only_layers`; the experts
    # keep HF's code.
    "qwen2_moe": _family("qwen2_moe", "Qwen2Moe", experts=True, head=MOE_HEAD),
    "qwen3": _family("qwen3", "Qwen3"),
    "qwen3_moe": _family("qwen3_moe", "Qwen3Moe", experts=True, head=MOE_HEAD),
    # Hybrid: gated delta-net layers (linear_attn, HF's code) between attention layers; zero-centred
    # norms in float32; partial rotary.
    "qwen3_next": _family(
        "qwen3_next", "Qwen3Next", experts=True, norm=_norm("Qwen3Next", GEMMA_NORM), head=MOE_HEAD,
        mixers=("linear_attn", "self_attn"),
    ),
    "qwen3_5_text": _family(
        "qwen3_5", "Qwen3_5", norm=_norm("Qwen3_5", GEMMA_NORM), mixers=("linear_attn", "self_attn"),
    ),
    "qwen3_5_moe_text": _family(
        "qwen3_5_moe", "Qwen3_5Moe", experts=True, norm=_norm("Qwen3_5Moe", GEMMA_NORM), head=MOE_HEAD,
        mixers=("linear_attn", "self_attn"),
    ),
    "phi3": _family(
        "phi3", "Phi3", mlp=MLP("Phi3MLP", act="activation_fn", projections=("gate_up_proj", "down_proj")),
        attention=None, dropout=("resid_attn_dropout", "resid_mlp_dropout"),
    ),
    # LayerNorm, partial rotary (the attention rotates a slice), one norm feeding attention and MLP in
    # parallel, an MLP that is not gated, a biased lm_head.
    "phi": _family(
        "phi", "Phi", norm=LAYER_NORM, mlp=MLP("PhiMLP", None, act="activation_fn", projections=("fc1", "fc2")),
        norms=None,
    ),
    "gemma": _family("gemma", "Gemma", norm=_norm("Gemma", GEMMA_NORM), mlp=MLP("GemmaMLP", "geglu")),
    "gemma2": _family(
        "gemma2", "Gemma2", norm=_norm("Gemma2", GEMMA_NORM), mlp=MLP("Gemma2MLP", "geglu"), head=SOFTCAP_HEAD,
        norms=SANDWICH,
    ),
    "gemma3_text": _family(
        "gemma3", "Gemma3", norm=_norm("Gemma3", GEMMA_NORM), mlp=MLP("Gemma3MLP", "geglu"), head=SOFTCAP_HEAD,
        norms=SANDWICH,
    ),
    # A layer of its own (per-layer inputs, an optional expert block beside the MLP, a layer scalar)
    # and a RoPE applied to q and k apart keep HF's code; norms with and without a weight.
    "gemma4_text": _family(
        "gemma4", "Gemma4Text", experts=True,
        norm=Norm("Gemma4RMSNorm", casting=FLOAT_WEIGHT, eps=("eps", "variance_epsilon")),  # 5.25 renamed it
        mlp=MLP("Gemma4TextMLP", "geglu"), rope=(), head=SOFTCAP_HEAD, causal_lm="Gemma4ForCausalLM", norms=None,
    ),
    # AltUp's predict/correct around each layer, a Laurel block beside attention and per-layer inputs
    # keep the layer HF's; so do the MLPs whose gate has activation sparsity, the RoPE applied to q
    # and k apart and the attention of layers that reuse an earlier layer's keys and values.
    "gemma3n_text": _family(
        "gemma3n", "Gemma3nText", norm=Norm("Gemma3nRMSNorm", casting=FLOAT_WEIGHT, eps=("eps", "variance_epsilon")),
        mlp=MLP("Gemma3nTextMLP", "geglu", sparsity="activation_sparsity"), rope=(), head=SOFTCAP_HEAD,
        causal_lm="Gemma3nForCausalLM", norms=None,
    ),
    "granite": _family("granite", "Granite", head=Head(scale="logits_scaling"), scale="residual_multiplier"),
    "granitemoe": _family(
        "granitemoe", "GraniteMoe", experts=True, mlp=None, head=Head(scale="logits_scaling", aux_loss="load_balancing_loss_func"),
        scale="residual_multiplier", feed_forward="block_sparse_moe",
    ),
    # OLMo's LayerNorm has neither weight nor bias and a fixed epsilon.
    "olmo": _family(
        "olmo", "Olmo", norm=Norm("OlmoLayerNorm", casting="float32", eps=1e-5, kind="layer", weight=False),
        rope=Rope(keep_dtype=True), norms=None,
    ),
    # OLMo 2 multiplies by the weight in fp32 and rounds once, as Gemma does, but without the +1.
    "olmo2": _family(
        "olmo2", "Olmo2", norm=Norm("Olmo2RMSNorm", casting=FLOAT_WEIGHT), rope=Rope(keep_dtype=True), norms=None
    ),
    "olmo3": _family(
        "olmo3", "Olmo3", norm=Norm("Olmo3RMSNorm", casting=FLOAT_WEIGHT), rope=Rope(keep_dtype=True), norms=None
    ),
    "olmoe": _family("olmoe", "Olmoe", experts=True, mlp=None, head=MOE_HEAD),
    "glm": _family(
        "glm", "Glm", mlp=MLP("GlmMLP", act="activation_fn", projections=("gate_up_proj", "down_proj")),
        rope=Rope(interleaved=True),
    ),
    "glm4": _family(
        "glm4", "Glm4", mlp=MLP("Glm4MLP", act="activation_fn", projections=("gate_up_proj", "down_proj")),
        rope=Rope(interleaved=True),
        norms=("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"),
    ),
    "glm4_moe": _family("glm4_moe", "Glm4Moe", experts=True),
    "smollm3": _family("smollm3", "SmolLM3"),
    # Post-norm as OLMo 2, with per-head QK norms.
    "exaone4": _family("exaone4", "Exaone4", norms=None),
    "hunyuan_v1_dense": _family("hunyuan_v1_dense", "HunYuanDenseV1"),
    "hunyuan_v1_moe": _family("hunyuan_v1_moe", "HunYuanMoEV1", experts=True),
    # The MLP is the router and experts, returning (hidden states, router scores); its attention
    # (sinks, sliding window) stays HF's.
    "gpt_oss": _family(
        "gpt_oss", "GptOss", experts=True, norm=Norm("GptOssRMSNorm", casting=FLOAT_WEIGHT), mlp=None,
        rope=Rope(cos="once"), head=MOE_HEAD,
    ),
    # Complex-number RoPE on (batch, tokens, heads, head_dim); weightless L2 norm of q and k; MoE
    # layers return (hidden states, router logits).
    "llama4_text": _family(
        "llama4", "Llama4Text", norm=Norm("Llama4TextRMSNorm", eps=("eps", "variance_epsilon")),  # 5.25 renamed it
        mlp=MLP("Llama4TextMLP", act="activation_fn"), attention=Attention("Llama4TextAttention"),
        rope=Rope("apply_rotary_emb", form="complex", interleaved=True, keep_dtype=True, tokens_first=True),
        causal_lm="Llama4ForCausalLM",
        other_norms=(Norm("Llama4TextL2Norm", eps=("eps", "variance_epsilon"), weight=False),),
        feed_forward="feed_forward",
    ),
    "starcoder2": _family(
        "starcoder2", "Starcoder2", norm=LAYER_NORM, mlp=MLP("Starcoder2MLP", None, act="act", projections=("c_fc", "c_proj")),
        norms=None,
    ),
    # Parallel attention and MLP from one LayerNorm (no bias, float32); interleaved RoPE whose cos/sin
    # repeat each frequency twice; logits multiplied by `logit_scale`.
    "cohere": _family(
        "cohere", "Cohere", norm=Norm("CohereLayerNorm", casting="float32", kind="layer"),
        rope=Rope(interleaved=True, cos="pairs", keep_dtype=True), head=Head(multiplier="logit_scale"), norms=None,
    ),
    "cohere2": _family(
        "cohere2", "Cohere2", norm=Norm("Cohere2LayerNorm", casting="float32", kind="layer"),
        rope=Rope(interleaved=True, cos="pairs", keep_dtype=True), head=Head(multiplier="logit_scale"), norms=None,
    ),
    # MLA attention stays HF's but for its two input projections, grouped; RoPE on the rotated slice,
    # in DeepSeek's interleaved-weights form by default (rope_interleave).
    "deepseek_v3": _family(
        "deepseek_v3", "DeepseekV3", experts=True, attention=Attention("DeepseekV3Attention", ("q_a_proj", "kv_a_proj_with_mqa")),
        rope=(Rope(), Rope("apply_rotary_pos_emb_interleave", interleaved=True, halves=True)),
    ),
    "deepseek_v2": _family(
        "deepseek_v2", "DeepseekV2", experts=True, attention=Attention("DeepseekV2Attention", ("q_a_proj", "kv_a_proj_with_mqa")),
        rope=Rope("apply_rotary_emb", form="complex", interleaved=True, keep_dtype=True),
    ),
    "dots1": _family("dots1", "Dots1", experts=True),
    # Scaled SwiGLU; a Mamba mixer beside the attention; a layer forward that is its own; the logits
    # multiplied by `lm_head_multiplier`.
    "falcon_h1": _family(
        "falcon_h1", "FalconH1", mlp=MLP("FalconH1MLP", multipliers=("gate_multiplier", "down_multiplier")),
        head=Head(multiplier="lm_head_multiplier"), norms=None,
    ),
    "seed_oss": _family("seed_oss", "SeedOss", mlp=MLP("SeedOssMLP", dropout="residual_dropout")),
    # Non-gated xIELU MLP; its norms are named for what they feed.
    "apertus": _family(
        "apertus", "Apertus", mlp=MLP("ApertusMLP", None, projections=("up_proj", "down_proj")),
        norms=("attention_layernorm", "feedforward_layernorm"),
    ),
    "arcee": _family("arcee", "Arcee", mlp=MLP("ArceeMLP", None, projections=("up_proj", "down_proj"))),
    "ernie4_5": _family("ernie4_5", "Ernie4_5", rope=Rope(interleaved=True, keep_dtype=True)),
    "ernie4_5_moe": _family("ernie4_5_moe", "Ernie4_5_Moe", experts=True, rope=Rope(interleaved=True, keep_dtype=True), head=MOE_HEAD),
    "helium": _family("helium", "Helium", norm=Norm("HeliumRMSNorm", casting=FLOAT_WEIGHT), rope=Rope(interleaved=True)),
    # Linear ("lightning") attention in some layers stays HF's.
    # Its residuals are the normed inputs, weighted (alpha, beta factors): no add feeds a norm.
    "minimax": _family("minimax", "MiniMax", experts=True, mlp=None, head=MOE_HEAD, norms=None),
    # LayerNorm1P: a torch LayerNorm scaled by 1 + weight; a non-gated relu² MLP.
    "nemotron": _family(
        "nemotron", "Nemotron", norm=Norm("NemotronLayerNorm1P", offset=1.0, casting="torch", eps="eps", kind="layer"),
        mlp=MLP("NemotronMLP", None, projections=("up_proj", "down_proj")), norms=None,
    ),
}

# Vision-language models with a language model of their own classes: its decoder patched as a text
# family's, the loss on the *ForConditionalGeneration's head, and the vision tower's LayerNorms
# (torch's), gated MLPs and 2-D rotary.
VLM_FAMILIES: dict[str, Family] = {
    "qwen2_vl": _family(
        "qwen2_vl", "Qwen2VL", mlp=MLP("Qwen2MLP"), causal_lm="Qwen2VLForConditionalGeneration",
        rope=(Rope(), VISION_ROPE), head=M_ROPE_HEAD, other_norms=(LAYER_NORM,),
        other_mlps=(_gelu_mlp("VisionMlp", act="act"),), patch_embed="PatchEmbed", vision_attention="VisionAttention",
    ),
    "qwen2_5_vl": _family(
        "qwen2_5_vl", "Qwen2_5_VL", mlp=MLP("Qwen2MLP"), causal_lm="Qwen2_5_VLForConditionalGeneration",
        rope=(Rope(), VISION_ROPE), head=M_ROPE_HEAD, other_mlps=(MLP("Qwen2_5_VLMLP"),),
        patch_embed="Qwen2_5_VisionPatchEmbed", vision_attention="Qwen2_5_VLVisionAttention",
    ),
    "qwen3_vl": _family(
        "qwen3_vl", "Qwen3VLText", causal_lm="Qwen3VLForConditionalGeneration", rope=(Rope(), VISION_ROPE),
        head=M_ROPE_HEAD, other_norms=(LAYER_NORM,),
        other_mlps=(_gelu_mlp("Qwen3VLVisionMLP", act="act_fn", fc=("linear_fc1", "linear_fc2")),),
        patch_embed="Qwen3VLVisionPatchEmbed", vision_attention="Qwen3VLVisionAttention",
    ),
    # Qwen3-VL's language model with Qwen3-MoE's sparse layers (experts through transformers'
    # experts interface, as qwen3_moe's; the dense MLP of its `mlp_only_layers`).
    "qwen3_vl_moe": _family(
        "qwen3_vl_moe", "Qwen3VLMoeText", causal_lm="Qwen3VLMoeForConditionalGeneration", rope=(Rope(), VISION_ROPE),
        head=Head(aux_loss="load_balancing_loss_func", positions=False), experts=True, other_norms=(LAYER_NORM,),
        other_mlps=(_gelu_mlp("Qwen3VLMoeVisionMLP", act="act_fn", fc=("linear_fc1", "linear_fc2")),),
        patch_embed="Qwen3VLMoeVisionPatchEmbed", vision_attention="Qwen3VLMoeVisionAttention",
    ),
    # Llama 3.2 Vision: self-attention decoder layers (their forward, which carries the
    # cross-attention inputs along, stays HF's: no add + norm fused) between cross-attention ones,
    # whose norms and MLPs are the same classes and run the same kernels; a CLIP-like tower.
    "mllama": dataclasses.replace(
        _family("mllama", "MllamaText", causal_lm="MllamaForConditionalGeneration",
                attention=Attention("MllamaTextSelfAttention"), other_norms=(LAYER_NORM,),
                other_mlps=(_gelu_mlp("MllamaVisionMLP"),)),
        layer=Layer("MllamaSelfAttentionDecoderLayer", norms=None),
    ),
    "glm4v": _family(
        "glm4v", "Glm4vText", norm=Norm("Glm4vRMSNorm"), causal_lm="Glm4vForConditionalGeneration",
        mlp=MLP("Glm4vTextMLP", act="activation_fn", projections=("gate_up_proj", "down_proj")),
        rope=(Rope(interleaved=True, cos="pairs"), VISION_ROPE), head=M_ROPE_HEAD, other_norms=(LAYER_NORM,),
        other_mlps=(MLP("Glm4VisionMlp"),), patch_embed="Glm4vVisionPatchEmbed",
        vision_attention="Glm4vVisionAttention",
        norms=("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"),
    ),
    # (Its multimodal head applies no final-logit softcap, as the text-only one does.)
    "gemma3": _family(
        "gemma3", "Gemma3", norm=_norm("Gemma3", GEMMA_NORM), mlp=MLP("Gemma3MLP", "geglu"),
        norms=SANDWICH, causal_lm="Gemma3ForConditionalGeneration", other_norms=(LAYER_NORM,), other_mlps=(SIGLIP_MLP,),
    ),
    # Gemma 3n's language model as gemma3n_text's, its head's softcap too; the MobileNet vision
    # tower is timm's (its norms and blocks are not transformers' classes) and stays as it is.
    "gemma3n": dataclasses.replace(FAMILIES["gemma3n_text"], causal_lm="Gemma3nForConditionalGeneration"),
    # Gemma 4's language model as gemma4_text's; its head applies the final-logit softcap as the
    # text-only one does. The vision tower's norms are the decoder's class (the RMSNorm before the
    # projector, of no weight, too); its gated MLP calls clippable linears (a clamp around each
    # nn.Linear), which run their own forwards around tigon's GeGLU. Its 2-D rotary stays HF's.
    "gemma4": dataclasses.replace(
        FAMILIES["gemma4_text"], causal_lm="Gemma4ForConditionalGeneration",
        other_mlps=(MLP("Gemma4VisionMLP", "geglu"),),
    ),
}


@dataclass(frozen=True)
class VisionOverText:
    """A vision-language model whose language model is a text family's model (LLaVA's a Llama,
    Mistral 3's a Mistral, ...), named by its config's ``text_config``: that family's entry patches
    the decoder, and this one adds the ``*ForConditionalGeneration`` head over it (the loss on
    the language head) and the vision tower's norms.

    Attributes:
        module: the modeling module of the multimodal classes.
        causal_lm: the ``*ForConditionalGeneration`` class.
        vision_norms: the vision tower's norms (torch's LayerNorm for CLIP and SigLIP towers).
        vision_mlps: the vision tower's MLPs (in `module` unless they name theirs).
    """

    module: str
    causal_lm: str
    vision_norms: tuple[Norm, ...] = (LAYER_NORM,)
    vision_mlps: tuple[MLP, ...] = ()


VLM_OVER_TEXT: dict[str, VisionOverText] = {
    "llava": VisionOverText("llava", "LlavaForConditionalGeneration", vision_mlps=(CLIP_MLP,)),
    "llava_next": VisionOverText("llava_next", "LlavaNextForConditionalGeneration", vision_mlps=(CLIP_MLP,)),
    "llava_onevision": VisionOverText("llava_onevision", "LlavaOnevisionForConditionalGeneration", vision_mlps=(SIGLIP_MLP,)),
    "idefics3": VisionOverText("idefics3", "Idefics3ForConditionalGeneration", vision_mlps=(_gelu_mlp("Idefics3VisionMLP"),)),
    "smolvlm": VisionOverText("smolvlm", "SmolVLMForConditionalGeneration", vision_mlps=(_gelu_mlp("SmolVLMVisionMLP"),)),
    "paligemma": VisionOverText("paligemma", "PaliGemmaForConditionalGeneration", vision_mlps=(SIGLIP_MLP,)),
    "internvl": VisionOverText("internvl", "InternVLForConditionalGeneration", vision_mlps=(_gelu_mlp("InternVLVisionMLP"),)),
    # Pixtral's tower normalises with an RMSNorm of its own module: left as it is.
    "mistral3": VisionOverText("mistral3", "Mistral3ForConditionalGeneration", vision_norms=()),
}


def vision_over_text(model_type: str, text: Family) -> Family:
    """The family of a :data:`VLM_OVER_TEXT` model of `model_type` whose language model is of family
    `text`: `text`'s decoder, the multimodal head, the vision tower's norms besides."""
    entry = VLM_OVER_TEXT[model_type]
    mlps = tuple(mlp if mlp.module else dataclasses.replace(mlp, module=entry.module) for mlp in entry.vision_mlps)
    return dataclasses.replace(
        text, causal_lm=entry.causal_lm, head_module=entry.module, other_norms=(*text.other_norms, *entry.vision_norms),
        other_mlps=(*text.other_mlps, *mlps),
    )


def modeling_module(family: Family | MLP | str) -> str:
    """The import path of `family`'s modeling module (or an MLP's own, or the one of a directory)."""
    name = family if isinstance(family, str) else family.module
    return f"transformers.models.{name}.modeling_{name}"


def available(model_type: str) -> bool:
    """Whether the installed transformers ships the modeling module of `model_type`'s family."""
    try:
        return importlib.util.find_spec(modeling_module(FAMILIES[model_type])) is not None
    except ModuleNotFoundError:  # no transformers, or no such package under it
        return False
