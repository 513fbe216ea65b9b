"""The FP8 rows of ``tigon bench --e2e`` (issue #40): full fine-tuning with FP8 linears.

Implementations (``--e2e-impls``), each on a fresh model as the bf16 rows:

* ``torchao-fp8`` / ``torchao-fp8-rowwise``: torchao's float8 training on the unpatched model,
  the same projections swapped (:func:`tigon.patch.fp8.candidates`: attention and MLP, not the LM
  head), what a user of torchao alone gets; ``torchao-fp8+compile`` the same model under
  ``torch.compile``, as torchao's own documentation runs it;
* ``tigon+fp8`` / ``tigon+fp8-rowwise``: ``tigon.patch(model, fp8=...)``, tigon's kernels around
  torchao's FP8 linears; ``tigon+fp8+graphs`` the tensorwise one replayed from CUDA graphs as
  ``tigon+graphs`` is (``tigon sft --fp8 tensorwise --cuda-graphs``);
* ``tigon+scaled-mm``: tigon's kernels around :class:`ScaledMMLinear`, rowwise scales straight
  through ``torch._scaled_mm`` with the quantisation in plain PyTorch: what the library's own
  overhead costs, measured against the same GEMMs.

Every CUDA row (the bf16 ones too) reports ``floor %``: its tokens/s over the matmul floor, the
model's training FLOPs per token (:func:`tigon.train.modeling.flops_per_token`) at the dense
matmul rates measured in the same run, bf16 (``a @ b``, as the op benchmarks' roofline) for
everything but the FP8 GEMMs, FP8 (``torch._scaled_mm``, e4m3) for those (:func:`fp8_flops_per_token`:
the FP8 linears', and the frozen FP8 bases' of LoRA on an FP8 base).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

import tigon
from tigon.patch import fp8
from tigon.timing import measure_matmul_rate, time_ms

# impl -> (recipe, on tigon's kernels)
IMPLS = {
    "torchao-fp8": ("tensorwise", False),
    "torchao-fp8-rowwise": ("rowwise", False),
    "torchao-fp8+compile": ("tensorwise", False),
    "tigon+fp8": ("tensorwise", True),
    "tigon+fp8-rowwise": ("rowwise", True),
    "tigon+fp8+graphs": ("tensorwise", True),
    "tigon+scaled-mm": ("rowwise", True),
}
E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max


def quantize_rowwise(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` in e4m3 scaled by the largest power of two that keeps each slice along `dim` in range
    (torchao's rowwise recipe rounds its scales so too), and the float32 factor that undoes it
    (keeping `dim`, as ``_scaled_mm`` takes it). NaN in a slice makes that slice NaN."""
    amax = t.abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    return (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale.reciprocal()


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


class _ScaledMM(torch.autograd.Function):
    """``x Wᵀ`` with all three GEMMs in e4m3, scales per row of each operand's contracted side."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        xq, x_scale = quantize_rowwise(x, 1)
        wq, w_scale = quantize_rowwise(weight, 1)
        return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        gq, g_scale = quantize_rowwise(grad_out, 1)
        wq, w_scale = quantize_rowwise(weight, 0)
        grad_x = torch._scaled_mm(gq, _column_major(wq), scale_a=g_scale, scale_b=w_scale, out_dtype=x.dtype)
        gtq, gt_scale = quantize_rowwise(grad_out.t().contiguous(), 1)
        xq, x_scale = quantize_rowwise(x, 0)
        grad_w = torch._scaled_mm(gtq, _column_major(xq), scale_a=gt_scale, scale_b=x_scale, out_dtype=weight.dtype)
        return grad_x, grad_w


class ScaledMMLinear(torch.nn.Linear):
    """A bias-free linear of rowwise-scaled FP8 GEMMs through ``torch._scaled_mm`` (bench only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def run(rows: torch.Tensor) -> torch.Tensor:
            flat = rows.reshape(-1, rows.shape[-1]).contiguous()  # _scaled_mm takes a row-major first operand
            return _ScaledMM.apply(flat, self.weight).reshape(*rows.shape[:-1], self.out_features)

        return fp8.padded_rows(run, x, self.out_features)


def _layers(model: torch.nn.Module) -> tuple[list[torch.nn.Module], type]:
    """The Llama decoder layers of `model` and its MLP class."""
    from transformers.models.llama import modeling_llama

    return [m for m in model.modules() if isinstance(m, modeling_llama.LlamaDecoderLayer)], modeling_llama.LlamaMLP


def prepare(model: torch.nn.Module, impl: str) -> str:
    """Make `model` run `impl` (one of :data:`IMPLS`), in place; what was applied, in one line."""
    recipe, kernels = IMPLS[impl]
    if impl == "tigon+scaled-mm":
        line = str(tigon.patch(model))
        layers, mlp_cls = _layers(model)
        swapped = 0
        for _, parent, attr, linear in list(fp8.candidates(model, layers, ("self_attn",), mlp_cls)):
            if linear.bias is not None or linear.in_features % fp8.ALIGN or linear.out_features % fp8.ALIGN:
                continue
            with torch.device("meta"):
                replacement = ScaledMMLinear(linear.in_features, linear.out_features, bias=False)
            replacement.weight = linear.weight
            setattr(parent, attr, replacement)
            swapped += 1
        return f"{line}, torch._scaled_mm rowwise ({swapped} linears)"
    if kernels:
        return str(tigon.patch(model, fp8=recipe))
    layers, mlp_cls = _layers(model)
    return f"torchao {fp8.convert(model, layers, ('self_attn',), mlp_cls, recipe, what=impl)} on the unpatched model"


def fp8_matmul_rate(device: torch.device) -> float:
    """Dense e4m3 matmul FLOP/s on `device` (``torch._scaled_mm``, tensorwise scales), measured now."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device).to(E4M3)
    b = torch.randn(n, n, device=device).to(E4M3).t()
    one = torch.ones((), device=device)
    ms = time_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), device)
    return 2 * n**3 / (ms * 1e-3)


@functools.cache
def matmul_rates(device: torch.device) -> tuple[float, float | None]:
    """(bf16, FP8) dense matmul FLOP/s on `device`, measured once per run (FP8: None on a GPU
    without it, whose bf16 rows still get their floor)."""
    fp8_rate = fp8_matmul_rate(device) if fp8.unsupported(device) is None else None
    return measure_matmul_rate(device, torch.bfloat16), fp8_rate


def is_fp8_linear(module: torch.nn.Module) -> bool:
    """torchao's Float8Linear or :class:`ScaledMMLinear`."""
    return isinstance(module, torch.nn.Linear) and type(module).__name__ in ("Float8Linear", "ScaledMMLinear")


def fp8_flops_per_token(model: torch.nn.Module) -> float:
    """The FLOPs per token of `model`'s step that run in FP8: the three GEMMs of each trained FP8
    linear, and the forward and input-gradient GEMMs of each frozen FP8 base with one scale per
    row (:class:`tigon.nn.Fp8Linear`, LoRA on an FP8 base; a block-scaled one is dequantised for
    bf16 GEMMs)."""
    from tigon.nn import Fp8Linear

    flops = 0.0
    for module in model.modules():
        if is_fp8_linear(module):
            flops += 6.0 * module.weight.numel()
        elif isinstance(module, Fp8Linear) and module.block_size == (1, module.in_features):
            flops += 4.0 * module.weight.numel()
    return flops


def floor_tokens_per_s(model: torch.nn.Module, seq: int, rates: tuple[float, float | None]) -> float:
    """Tokens/s at which `model`'s training step would run its FLOPs at `rates` (bf16, FP8): what
    :func:`fp8_flops_per_token` counts at the FP8 rate, the rest at bf16's."""
    from tigon.train.modeling import flops_per_token

    total = flops_per_token(model, seq)
    in_fp8 = fp8_flops_per_token(model) if rates[1] else 0.0
    return 1.0 / ((total - in_fp8) / rates[0] + (in_fp8 / rates[1] if in_fp8 else 0.0))


def floor_pct(model: torch.nn.Module, seq: int, tokens_per_s: float, device: torch.device) -> dict[str, Any]:
    """The record's floor fields for a run of `model` at `tokens_per_s` (none off CUDA)."""
    if device.type != "cuda":
        return {}
    rates = matmul_rates(device)
    floor = floor_tokens_per_s(model, seq, rates)
    record = {"floor_tokens_per_s": floor, "floor_pct": 100 * tokens_per_s / floor, "bf16_tflops": rates[0] / 1e12}
    return record if rates[1] is None else {**record, "fp8_tflops": rates[1] / 1e12}
