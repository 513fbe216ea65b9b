"""Which parts of each Hugging Face decoder family tigon replaces, as data.

One entry per ``config.model_type``. Names refer to attributes of
``transformers.models.<module>.modeling_<module>``; :mod:`tigon.patch.apply` walks this table for
every family alike, so adding a family is adding an entry here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Norm:
    """A family's norm class and how its arithmetic rounds (see :func:`tigon.functional.rms_norm`).

    Attributes:
        cls: the class name; for ``kind="layer"``, torch's ``nn.LayerNorm``, which the family's
            modules build directly (only a patched model instance has its LayerNorms replaced: a
            class patch of torch's would reach every LayerNorm in the process).
        kind: ``"rms"`` (the ``rms_norm`` switch) or ``"layer"`` (``layer_norm``).
        offset, casting: the RMSNorm variant.
        eps: the attribute holding epsilon (Llama's modules call it `variance_epsilon`).
    """

    cls: str
    offset: float = 0.0
    casting: str = "llama"
    eps: str = "variance_epsilon"
    kind: str = "rms"

    @property
    def switch(self) -> str:
        return "layer_norm" if self.kind == "layer" else "rms_norm"


@dataclass(frozen=True)
class Layer:
    """A decoder-layer class and where a residual add feeds an RMSNorm inside it.

    Attributes:
        cls: the class name.
        fuse: ``"pre_norm"`` (Llama: ``post_attention_layernorm(residual + attn)``),
            ``"sandwich"`` (Gemma 2/3: ``pre_feedforward_layernorm(residual +
            post_attention_layernorm(attn))``), or None when no add feeds an RMSNorm (OLMo 2
            normalises the sublayer outputs, not the sums; Phi's norms are LayerNorms).
        scale: attribute multiplying each sublayer's output before the add (Granite).
        dropout: the modules applied to the attention and MLP outputs before the add (Phi-3).
    """

    cls: str
    fuse: str | None = "pre_norm"
    scale: str | None = None
    dropout: tuple[str, str] | None = None


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
            ``gate_up_proj`` whose output is ``[gate, up]`` (Phi-3) and down; for an MLP that is
            not gated, in the order it calls them.
    """

    cls: str
    switch: str | None = "swiglu"
    act: str = "act_fn"
    projections: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")

    @property
    def gated(self) -> bool:
        return self.switch is not None

    @property
    def packed(self) -> bool:
        return self.gated and len(self.projections) == 2


@dataclass(frozen=True)
class Attention:
    """An attention class whose forward calls its q, k and v projections, in that order, on its
    `hidden_states` (``self.q_proj(hidden_states)``, ...), and the attributes holding them."""

    cls: str
    projections: tuple[str, str, str] = ("q_proj", "k_proj", "v_proj")


@dataclass(frozen=True)
class Rope:
    """The module-level ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``.

    Attributes:
        function: its name in the modeling module.
        keep_dtype: the result is cast back to q's and k's dtypes (OLMo 2).
    """

    function: str = "apply_rotary_pos_emb"
    keep_dtype: bool = False


@dataclass(frozen=True)
class Head:
    """What the ``*ForCausalLM`` forward does between the last hidden state and the loss.

    Attributes:
        softcap: config attribute of the final-logit softcap, ``cap * tanh(logits / cap)``, None
            when unset (Gemma 2/3).
        scale: config attribute that the logits are divided by (Granite).
        aux_loss: module-level router load-balancing loss added when router logits are output
            (the MoE families).
    """

    softcap: str | None = None
    scale: str | None = None
    aux_loss: str | None = None


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
        norm: the norm class with its rounding.
        mlp: the dense MLP, if the family has one (MoE experts keep HF's code).
        attention: the attention, if it calls separate q/k/v projections (Phi-3 packs them into
            one ``qkv_proj``).
        rope: the rotary-embedding function.
        head: the causal-LM head's extras.
    """

    module: str
    causal_lm: str
    layer: Layer
    norm: Norm
    mlp: MLP | None
    attention: Attention | None
    rope: Rope
    head: Head


def _norm(prefix: str, kind: str = LLAMA_NORM) -> Norm:
    if kind == GEMMA_NORM:
        return Norm(f"{prefix}RMSNorm", offset=1.0, casting="gemma", eps="eps")
    return Norm(f"{prefix}RMSNorm")


LAYER_NORM = Norm("LayerNorm", eps="eps", kind="layer")
MOE_HEAD = Head(aux_loss="load_balancing_loss_func")
SOFTCAP_HEAD = Head(softcap="final_logit_softcapping")
_DEFAULT = object()


def _family(
    module: str,
    prefix: str,
    *,
    norm: Norm | None = None,
    mlp: MLP | None | object = _DEFAULT,
    attention: Attention | None | object = _DEFAULT,
    rope: Rope = Rope(),
    head: Head = Head(),
    **layer,
) -> Family:
    return Family(
        module=module,
        causal_lm=f"{prefix}ForCausalLM",
        layer=Layer(f"{prefix}DecoderLayer", **layer),
        norm=norm or _norm(prefix),
        mlp=MLP(f"{prefix}MLP") if mlp is _DEFAULT else mlp,
        attention=Attention(f"{prefix}Attention") if attention is _DEFAULT else attention,
        rope=rope,
        head=head,
    )


FAMILIES: dict[str, Family] = {
    "llama": _family("llama", "Llama"),
    "mistral": _family("mistral", "Mistral"),
    "mixtral": _family("mixtral", "Mixtral", mlp=None, head=MOE_HEAD),
    "qwen2": _family("qwen2", "Qwen2"),
    "qwen3": _family("qwen3", "Qwen3"),
    # The dense MLP of the layers listed in `mlp_only_layers`; the experts keep HF's code.
    "qwen3_moe": _family("qwen3_moe", "Qwen3Moe", head=MOE_HEAD),
    "phi3": _family(
        "phi3", "Phi3", mlp=MLP("Phi3MLP", act="activation_fn", projections=("gate_up_proj", "down_proj")),
        attention=None, dropout=("resid_attn_dropout", "resid_mlp_dropout"),
    ),
    # LayerNorm, partial rotary (the attention rotates a slice), one norm feeding attention and MLP in
    # parallel, an MLP that is not gated, a biased lm_head.
    "phi": _family(
        "phi", "Phi", norm=LAYER_NORM, mlp=MLP("PhiMLP", None, act="activation_fn", projections=("fc1", "fc2")),
        fuse=None,
    ),
    "gemma": _family("gemma", "Gemma", norm=_norm("Gemma", GEMMA_NORM), mlp=MLP("GemmaMLP", "geglu")),
    "gemma2": _family(
        "gemma2", "Gemma2", norm=_norm("Gemma2", GEMMA_NORM), mlp=MLP("Gemma2MLP", "geglu"), head=SOFTCAP_HEAD,
        fuse="sandwich",
    ),
    "gemma3_text": _family(
        "gemma3", "Gemma3", norm=_norm("Gemma3", GEMMA_NORM), mlp=MLP("Gemma3MLP", "geglu"), head=SOFTCAP_HEAD,
        fuse="sandwich",
    ),
    "granite": _family("granite", "Granite", head=Head(scale="logits_scaling"), scale="residual_multiplier"),
    # OLMo 2 multiplies by the weight in fp32 and rounds once, as Gemma does, but without the +1.
    "olmo2": _family(
        "olmo2", "Olmo2", norm=Norm("Olmo2RMSNorm", casting="gemma"), rope=Rope(keep_dtype=True), fuse=None
    ),
}
