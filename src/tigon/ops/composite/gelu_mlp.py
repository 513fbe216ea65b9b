"""The plain (ungated) MLP of ViT / SigLIP / CLIP vision towers and of the Qwen-VL patch mergers
around the GELU kernels (cuBLAS choreography).

    gelu_mlp(x, ...) = fc2(gelu(fc1(x)))

The two projections are torch matmuls around the kernels of :mod:`tigon.ops.gelu`. The op saves
the MLP input and ``h = fc1(x)`` only: the activation (fc2's input) is recomputed in backward by
the pass that computes h's gradient, written over the output gradient of fc2's input, while h's
gradient overwrites h. Eager PyTorch keeps both h and gelu(h).
"""

from __future__ import annotations

import torch
import torch.nn.functional as torch_f

from tigon.ops._checks import KERNEL_DTYPES, check_device, check_float, check_input
from tigon.ops._dispatch import Op, autocast_dtype, backward_fallback, empty_if, library_op
from tigon.ops.gelu import APPROXIMATIONS, check_approximate, gelu_backward, gelu_forward, gelu_reference


def gelu_mlp_reference(x: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor,
                       fc1_bias: torch.Tensor | None = None, fc2_bias: torch.Tensor | None = None,
                       approximate: str = "none") -> torch.Tensor:
    """The MLP as transformers' vision MLPs compute it (``fc2(act(fc1(x)))``)."""
    return torch_f.linear(gelu_reference(torch_f.linear(x, fc1_weight, fc1_bias), approximate), fc2_weight, fc2_bias)


def gelu_mlp_forward(x, fc1_weight, fc2_weight, fc1_bias, fc2_bias, activation):
    """``(out, h)`` outside autograd; h (fc1's output) is what :func:`gelu_mlp_backward` takes."""
    h = torch_f.linear(x, fc1_weight, fc1_bias)
    return torch_f.linear(gelu_forward(h, activation), fc2_weight, fc2_bias), h


def gelu_mlp_backward(grad_out, x, h, fc1_weight, fc2_weight, activation, needs, in_place):
    """Gradients for `needs` = (x, fc1_weight, fc2_weight, fc1_bias, fc2_bias), None where not
    needed. With `in_place` (h is the op's own) h's gradient overwrites h."""
    grad_out2d = grad_out.reshape(-1, grad_out.shape[-1])
    x2d = x.reshape(-1, x.shape[-1])
    # fc2's input gradient is ours alone: the recomputed activation overwrites it.
    grad_h, act = gelu_backward(torch.matmul(grad_out2d, fc2_weight), h.reshape(grad_out2d.shape[0], -1), activation,
                                store_y=needs[2], in_place=in_place)
    grad_x = torch.matmul(grad_h, fc1_weight).view(x.shape) if needs[0] else None
    return (
        grad_x,
        grad_h.t().matmul(x2d) if needs[1] else None,
        grad_out2d.t().matmul(act) if needs[2] else None,
        grad_h.sum(0) if needs[3] else None,
        grad_out2d.sum(0) if needs[4] else None,
    )


def _reference_point(ctx, saved):
    x, _, fc1_weight, fc2_weight, fc1_bias, fc2_bias = saved
    return GELU_MLP, gelu_mlp_reference, (x, fc1_weight, fc2_weight, fc1_bias, fc2_bias, ctx.approximate)


class _GeluMLPFunction(torch.autograd.Function):
    # custom_fwd/custom_bwd: under autocast the backward's matmuls run in the forward's precision.
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, fc1_weight, fc2_weight, fc1_bias, fc2_bias, approximate):
        out, h = gelu_mlp_forward(x, fc1_weight, fc2_weight, fc1_bias, fc2_bias, APPROXIMATIONS[approximate])
        ctx.save_for_backward(x, h, fc1_weight, fc2_weight, fc1_bias, fc2_bias)
        ctx.approximate = approximate
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_out):
        x, h, fc1_weight, fc2_weight = saved[:4]
        grads = gelu_mlp_backward(grad_out, x, h, fc1_weight, fc2_weight, APPROXIMATIONS[ctx.approximate],
                                  ctx.needs_input_grad[:5], in_place=True)
        return (*grads, None)


# Inside torch.compile: the same launchers as library ops (nothing overwritten: a library op
# mutates none of its inputs).
def _forward_fake(x, fc1_weight, fc2_weight, fc1_bias, fc2_bias, activation):
    lead = x.shape[:-1]
    return x.new_empty((*lead, fc2_weight.shape[0])), x.new_empty((*lead, fc1_weight.shape[0]))


@library_op(
    "gelu_mlp",
    "(Tensor x, Tensor fc1_weight, Tensor fc2_weight, Tensor? fc1_bias, Tensor? fc2_bias, str activation) "
    "-> (Tensor, Tensor)",
    _forward_fake,
)
def _forward_op(x, fc1_weight, fc2_weight, fc1_bias, fc2_bias, activation):
    return gelu_mlp_forward(x, fc1_weight, fc2_weight, fc1_bias, fc2_bias, activation)


def _grad_shapes(x, fc1_weight, fc2_weight):
    return x.shape, fc1_weight.shape, fc2_weight.shape, fc1_weight.shape[:1], fc2_weight.shape[:1]


@library_op(
    "gelu_mlp_backward",
    "(Tensor grad_out, Tensor x, Tensor h, Tensor fc1_weight, Tensor fc2_weight, str activation, bool[] needs) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    lambda grad_out, x, h, fc1_weight, fc2_weight, activation, needs: tuple(
        empty_if(need, x, shape) for need, shape in zip(needs, _grad_shapes(x, fc1_weight, fc2_weight))
    ),
)
def _backward_op(grad_out, x, h, fc1_weight, fc2_weight, activation, needs):
    grads = gelu_mlp_backward(grad_out, x, h, fc1_weight, fc2_weight, activation, needs, in_place=False)
    return tuple(x.new_empty(0) if g is None else g.view(shape)
                 for g, shape in zip(grads, _grad_shapes(x, fc1_weight, fc2_weight)))


def _setup_context(ctx, inputs, output):
    x, fc1_weight, fc2_weight, _, _, activation = inputs
    ctx.save_for_backward(x, output[1], fc1_weight, fc2_weight)
    ctx.activation = activation


def _op_backward(ctx, grad_out, _):
    needs = list(ctx.needs_input_grad[:5])
    grads = _backward_op(grad_out, *ctx.saved_tensors, ctx.activation, needs)
    return (*(g if need else None for g, need in zip(grads, needs)), None)


_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


def _compiled(x, fc1_weight, fc2_weight, fc1_bias, fc2_bias, approximate):
    dtype = autocast_dtype(x)
    args = (x, fc1_weight, fc2_weight, fc1_bias, fc2_bias)
    if dtype is None:
        return _forward_op(*args, APPROXIMATIONS[approximate])[0]
    # As autocast casts a linear's operands; the library op then runs with autocast off.
    with torch.autocast(x.device.type, enabled=False):
        return _forward_op(*(t if t is None else t.to(dtype) for t in args), APPROXIMATIONS[approximate])[0]


GELU_MLP = Op("gelu_mlp", _GeluMLPFunction.apply, gelu_mlp_reference, compiled=_compiled)


def _check(x, fc1_weight, fc2_weight, fc1_bias, fc2_bias) -> str | None:
    """Validate gelu_mlp's tensors; return why the kernel path cannot take them, if it cannot."""
    check_input(x)
    for name, weight in (("fc1_weight", fc1_weight), ("fc2_weight", fc2_weight)):
        check_float(name, weight)
        check_device(name, weight, x.device)
    intermediate = fc1_weight.shape[0] if fc1_weight.dim() == 2 else "intermediate"
    # each weight's expected shape, "out" standing for a size the weight itself sets
    expected = {"fc1_weight": (intermediate, x.shape[-1]), "fc2_weight": (fc2_weight.shape[0], intermediate)}
    for name, weight in (("fc1_weight", fc1_weight), ("fc2_weight", fc2_weight)):
        if weight.dim() != 2 or tuple(weight.shape) != expected[name]:
            want = ", ".join(map(str, expected[name] if weight.dim() == 2 else ("out", intermediate)))
            raise ValueError(f"{name} must have shape ({want}) (nn.Linear's layout, chained from x), got {tuple(weight.shape)}")
    for name, bias, length in (("fc1_bias", fc1_bias, intermediate), ("fc2_bias", fc2_bias, fc2_weight.shape[0])):
        if bias is not None:
            check_float(name, bias)
            check_device(name, bias, x.device)
            if tuple(bias.shape) != (length,):
                raise ValueError(f"{name} must have shape ({length},) to match its weight, got {tuple(bias.shape)}")
    dtypes = {x.dtype, fc1_weight.dtype, fc2_weight.dtype}
    if not dtypes <= set(KERNEL_DTYPES):
        return f"dtypes {sorted(map(str, dtypes))} run on the reference"
    return None


def gelu_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None = None,
    fc2_bias: torch.Tensor | None = None,
    *,
    approximate: str = "none",
) -> torch.Tensor:
    """The vision towers' MLP ``fc2(gelu(fc1(x)))``, saving x and fc1(x) only.

    The activation is recomputed in backward (one intermediate-sized tensor less than the unfused
    module keeps), and backward allocates no intermediate-sized buffer beyond fc2's input
    gradient. Works under autocast.

    Args:
        x: ``(..., hidden)`` input.
        fc1_weight: ``(intermediate, hidden)``; fc2_weight: ``(out, intermediate)`` (``nn.Linear``
            layout; out is hidden in a ViT block, the language model's width in a projector).
        fc1_bias, fc2_bias: optional biases.
        approximate: ``"none"`` (erf GELU), ``"tanh"`` (``gelu_pytorch_tanh``: SigLIP, Qwen3-VL's
            tower) or ``"sigmoid"`` (QuickGELU: CLIP, Qwen2-VL's tower).

    Returns:
        ``(..., out)``.
    """
    check_approximate(approximate)
    unsupported = _check(x, fc1_weight, fc2_weight, fc1_bias, fc2_bias)
    return GELU_MLP(unsupported, x, fc1_weight, fc2_weight, fc1_bias, fc2_bias, approximate)
