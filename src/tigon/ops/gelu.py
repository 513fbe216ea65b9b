"""GELU activations, ungated: the MLP activations of ViT / SigLIP / CLIP vision towers.

    gelu(x, "none")     x Φ(x)                         (exact erf GELU; torch's default)
    gelu(x, "tanh")     gelu(x, approximate="tanh")    (SigLIP's gelu_pytorch_tanh)
    gelu(x, "sigmoid")  x σ(1.702 x)                   (QuickGELU: CLIP, Qwen2-VL's vision tower)

The erf and tanh forms are the gated kernels' activation table (:func:`tigon.ops.glu.activate`);
the sigmoid form is the paper's other approximation. The kernels compute in fp32 and round once.
Backward recomputes the activation from `x`, so only `x` is saved; the MLP around it
(:mod:`tigon.ops.composite.gelu_mlp`) uses the launchers :func:`gelu_forward` and
:func:`gelu_backward`, whose backward can also hand back the activation (the next linear's input,
for its weight gradient) so that the MLP need not keep it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as torch_f

from tigon.ops._checks import KERNEL_DTYPES, check_choice, check_float
from tigon.ops._dispatch import Op, backward_fallback, library_op, tl, triton
from tigon.ops._launch import cdiv, launched
from tigon.ops.glu import activate, activation_grad

# approximate -> the kernels' activation name
APPROXIMATIONS = {"none": "gelu", "tanh": "gelu_tanh", "sigmoid": "quick_gelu"}
QUICK_GELU_SCALE = 1.702

# Elements per program: each thread keeps four 16-byte bf16 vectors of every tensor in flight.
BLOCK_SIZE = 4096
NUM_WARPS = 8


@triton.jit
def _gelu_act(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == "quick_gelu":
        y = x * tl.sigmoid(1.702 * x)
    else:
        y = activate(x, ACTIVATION)
    return y


@triton.jit
def _gelu_grad(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == "quick_gelu":
        sig = tl.sigmoid(1.702 * x)
        g = sig + 1.702 * x * sig * (1.0 - sig)
    else:
        g = activation_grad(x, ACTIVATION)
    return g


@launched
@triton.jit
def _gelu_fwd_kernel(x_ptr, y_ptr, n, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, _gelu_act(x, ACTIVATION), mask=mask)


@launched
@triton.jit
def _gelu_bwd_kernel(
    grad_y_ptr, x_ptr, grad_x_ptr, y_ptr, n,
    ACTIVATION: tl.constexpr, STORE_Y: tl.constexpr, BLOCK: tl.constexpr,
):
    """grad_x = grad_y * act'(x), and with STORE_Y the forward's act(x) again. The outputs may
    overwrite the inputs: each element is read before it is written, by the same program."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    grad_y = tl.load(grad_y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(grad_x_ptr + offsets, grad_y * _gelu_grad(x, ACTIVATION), mask=mask)
    if STORE_Y:
        tl.store(y_ptr + offsets, _gelu_act(x, ACTIVATION), mask=mask)


def gelu_reference(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """The activation as transformers writes it (``nn.GELU``, ``gelu_pytorch_tanh``,
    ``QuickGELUActivation``): the test oracle and the fallback."""
    if approximate == "sigmoid":
        return x * torch.sigmoid(QUICK_GELU_SCALE * x)
    return torch_f.gelu(x, approximate=approximate)


def _grid(n: int) -> tuple[int]:
    return (cdiv(n, BLOCK_SIZE),)


def gelu_forward(x: torch.Tensor, activation: str) -> torch.Tensor:
    """act(x) by the forward kernel, outside autograd: contiguous, x's dtype (`activation` is a
    value of :data:`APPROXIMATIONS`)."""
    x = x.contiguous()
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    _gelu_fwd_kernel[_grid(x.numel())](x, y, x.numel(), ACTIVATION=activation, BLOCK=BLOCK_SIZE, num_warps=NUM_WARPS)
    return y


def gelu_backward(
    grad_y: torch.Tensor, x: torch.Tensor, activation: str, store_y: bool, in_place: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(grad_x, act(x) or None) by the backward kernel.

    With `in_place` (for a caller whose `x` and `grad_y` are its own intermediates, which nobody
    else reads) grad_x overwrites x and act(x) overwrites grad_y: the backward allocates nothing
    of their size. x is then bumped to a new version, so a second backward through a retained
    graph fails in autograd instead of reading a gradient as x.
    """
    in_place = in_place and x.is_contiguous() and grad_y.is_contiguous() and grad_y.dtype == x.dtype
    grad_y, x = grad_y.contiguous(), x.contiguous()
    if in_place:
        grad_x, y = x, (grad_y if store_y else None)
    else:
        grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
        y = torch.empty_like(x, memory_format=torch.contiguous_format) if store_y else None
    _gelu_bwd_kernel[_grid(x.numel())](
        grad_y, x, grad_x, y if store_y else grad_x, x.numel(),
        ACTIVATION=activation, STORE_Y=store_y, BLOCK=BLOCK_SIZE, num_warps=NUM_WARPS,
    )
    if in_place:
        torch.autograd.graph.increment_version(x)
    return grad_x, y


def _reference_point(ctx, saved):
    return GELU, gelu_reference, (saved[0], ctx.approximate)


class _GeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, approximate):
        ctx.save_for_backward(x)
        ctx.approximate = approximate
        return gelu_forward(x, APPROXIMATIONS[approximate])

    @staticmethod
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_y):
        grad_x, _ = gelu_backward(grad_y, saved[0], APPROXIMATIONS[ctx.approximate], store_y=False, in_place=False)
        return grad_x.view(saved[0].shape), None


# Inside torch.compile: the same launchers as library ops.
@library_op("gelu", "(Tensor x, str activation) -> Tensor",
            lambda x, activation: torch.empty(x.shape, dtype=x.dtype, device=x.device))
def gelu_op(x, activation):
    """act(x) as the library op ``tigon::gelu`` (what compiled graphs call)."""
    return gelu_forward(x, activation)


@library_op("gelu_backward", "(Tensor grad_y, Tensor x, str activation) -> Tensor",
            lambda grad_y, x, activation: torch.empty(x.shape, dtype=x.dtype, device=x.device))
def _backward_op(grad_y, x, activation):
    return gelu_backward(grad_y, x, activation, store_y=False, in_place=False)[0].view(x.shape)


def _setup_context(ctx, inputs, output):
    x, activation = inputs
    ctx.save_for_backward(x)
    ctx.activation = activation


gelu_op.register_autograd(
    lambda ctx, grad_y: (_backward_op(grad_y, ctx.saved_tensors[0], ctx.activation), None),
    setup_context=_setup_context,
)

GELU = Op(
    "gelu", _GeluFunction.apply, gelu_reference,
    compiled=lambda x, approximate: gelu_op(x, APPROXIMATIONS[approximate]),
)


def check_approximate(approximate: str) -> None:
    check_choice("approximate", approximate, APPROXIMATIONS)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU in one pass; backward saves only `x`.

    Args:
        x: any shape, float16/bfloat16/float32 (float64 runs the reference).
        approximate: ``"none"`` (exact erf, ``nn.GELU()``), ``"tanh"`` (``gelu_pytorch_tanh``) or
            ``"sigmoid"`` (QuickGELU, ``x * sigmoid(1.702 * x)``, transformers' ``quick_gelu``).

    Returns:
        A contiguous tensor of x's shape and dtype.
    """
    check_float("x", x)
    check_approximate(approximate)
    unsupported = None if x.dtype in KERNEL_DTYPES else f"dtype {x.dtype} runs on the reference"
    return GELU(unsupported, x, approximate)
