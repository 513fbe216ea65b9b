"""The README's table of supported families, rendered from tigon.patch's family table."""

from __future__ import annotations

from tigon.patch import FAMILIES, VLM_FAMILIES, VLM_OVER_TEXT
from tigon.patch.families import Family, Norm

BEGIN, END = "<!-- families: generated from src/tigon/patch/families.py -->", "<!-- /families -->"


def _norm(norm: Norm) -> str:
    kind = "RMSNorm" if norm.kind == "rms" else "LayerNorm"
    return f"{kind}{' (1 + w)' if norm.offset else ''}{'' if norm.weight else ', no weight'}"


def _mlp(family: Family) -> str:
    mlp = family.mlp
    if mlp is None:
        return "experts only"
    return mlp.switch or "not gated (HF's)"


def _rope(family: Family) -> str:
    if not family.ropes:
        return "HF's"
    return " + ".join("interleaved" if r.interleaved else "halves" for r in family.ropes)


def table() -> str:
    """The Markdown table between the README's markers."""
    rows = ["| model_type | transformers module | norm | MLP | MoE experts | RoPE pairs | add + norm fused |",
            "|---|---|---|---|---|---|---|"]
    for model_type, family in sorted({**FAMILIES, **VLM_FAMILIES}.items()):
        fused = family.layer.fuse or "no"
        rows.append(f"| `{model_type}` | `{family.module}` | {', '.join(dict.fromkeys(map(_norm, family.norms)))} "
                    f"| {_mlp(family)} | {'fused' if family.experts else '-'} | {_rope(family)} | {fused} |")
    over_text = ", ".join(f"`{t}`" for t in sorted(VLM_OVER_TEXT))
    rows += ["", f"Vision-language models whose language model is a text family's above (as their config's "
                 f"`text_config` says), with the vision tower's LayerNorms and GELU MLPs: {over_text}."]
    return "\n".join(rows)


if __name__ == "__main__":
    print(BEGIN, table(), END, sep="\n")
