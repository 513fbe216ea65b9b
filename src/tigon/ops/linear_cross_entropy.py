"""Linear layer + cross-entropy (the LM head and its loss) without materialising the logits.

    linear_cross_entropy(h, W, t, b) = cross_entropy(h @ W.T + b, t)

The N tokens are processed in chunks of C rows, C chosen so that one (C, V) logits chunk in the
input dtype fits `max_chunk_bytes`. Per chunk, in forward:

    logits  = h_c @ W.T + b             cuBLAS, fp32 accumulation, rounded to the input dtype
                                        (exactly what F.linear gives the unfused loss)
    loss_c, and dlogits over the chunk  one Triton pass (cross_entropy's kernel, WRITE_GRAD), in
                                        place: the chunk buffer is private to this op
    grad_h_c  = dlogits @ W             straight into its rows of grad_h
    grad_W   += dlogits.T @ h_c         accumulated in W's dtype (an fp32 sum costs 2 bytes per
                                        weight more: opt in with fp32_weight_grad)
    grad_b   += dlogits.sum(0)          in fp32

Each GEMM runs only for a tensor that requires grad (a frozen W costs no weight-gradient GEMM).
The gradients are scaled in forward by 1 / (number of non-ignored targets, or num_items_in_batch)
as a device tensor, so nothing syncs with the host. Backward multiplies them by grad_output in
place, with a kernel that reads grad_output on the device and does nothing when it is 1 (the usual
``loss.backward()``). With reduction="none" the per-row grad_output is only known in backward,
which then recomputes the chunks (one GEMM more than the other reductions).

Extra memory, besides the gradients themselves: the logits chunk plus O(N + V) fp32 scalars.

NaN and inf behave as in ``cross_entropy(F.linear(h, W, b), t)`` (see tigon.ops.cross_entropy): a
NaN in a hidden row gives that row a NaN loss; a NaN in one row of W or one element of b is a NaN
logit in every row, so every row's loss, the mean and the gradients are NaN. A target outside
``[0, V)`` that is not ``ignore_index`` gives its row a NaN loss and gradient (``TIGON_DEBUG=1``:
a ValueError naming it).
"""

from __future__ import annotations

import torch

from tigon.ops._checks import check_device, check_target, rows_view
from tigon.ops._chunked_head import (
    autocast_head, backprop_head, check_chunk_bytes, check_head, chunk_rows, head_grad_needs, head_grads_fake,
    head_grads_out, logits_chunks, register_forward_grads_autograd, scale_in_place,
)
from tigon.ops._dispatch import Op, backward_fallback, debug_enabled, library_op
from tigon.ops.cross_entropy import (
    LossOptions, LossOutput, check_class_weight, check_flags, check_loss_options, check_target_range, class_weights,
    cross_entropy_reference, cross_entropy_rows, has_two_divisors, loss_output, mean_denominator,
)

# The logits chunk's budget: 512 rows at V = 128256 in bf16 (125 MiB), the op's extra memory. A
# larger chunk makes the weight-gradient GEMM (K = chunk rows) more efficient: see BENCHMARKS.md
# for the time/memory curve.
DEFAULT_MAX_CHUNK_BYTES = 128 * 2**20


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    class_weight: torch.Tensor | None = None,
    token_scaling: bool = False,
    return_z_loss: bool = False,
    return_argmax: bool = False,
) -> torch.Tensor | LossOutput:
    """``cross_entropy(F.linear(hidden, weight, bias), target)`` with the whole logits in memory:
    the test oracle and the fallback."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return cross_entropy_reference(
        logits, target, ignore_index, reduction, label_smoothing, z_loss_scale, softcap, class_weight, token_scaling,
        return_z_loss, return_argmax, num_items_in_batch,
    )


def _chunked_loss_and_grads(
    hidden2d, weight, bias, target1d, options, chunk, scale, need_hidden, need_weight, need_bias,
    class_weight=None, argmax=None, z_loss=None, fp32_weight_grad=False, z_ratio=None,
):
    """Per-row fp32 losses and, for the tensors that need them, the gradients of
    ``sum(scale * losses)`` (`scale` is 0-dim or one value per row; None when no gradient is
    needed; the z-loss terms' scale times `z_ratio` if given). With `argmax` / `z_loss` (one per
    row), also each row's argmax and z-loss term, in the same pass. `fp32_weight_grad`: the
    chunks' weight gradients are summed in fp32 and rounded to the weight's dtype once, at the
    end."""
    n_rows = hidden2d.shape[0]
    vocab = weight.shape[0]
    device = hidden2d.device
    write_grad = need_hidden or need_weight or need_bias
    losses = torch.empty(n_rows, dtype=torch.float32, device=device)
    lse = torch.empty(min(chunk, n_rows), dtype=torch.float32, device=device)
    grad_hidden = torch.empty((n_rows, hidden2d.shape[1]), dtype=hidden2d.dtype, device=device) if need_hidden else None
    grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=device) if need_weight else None
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if need_bias else None
    per_row_scale = scale is not None and scale.dim() == 1
    weight_grad_sum = None  # fp32, with fp32_weight_grad
    fp32_weight_grad = fp32_weight_grad and need_weight and weight.dtype != torch.float32

    for start, end, logits in logits_chunks(hidden2d, weight, bias, chunk):
        cross_entropy_rows(
            logits, target1d[start:end], losses[start:end], lse[: end - start], options,
            grad=logits if write_grad else None,
            scale=scale[start:end] if per_row_scale else scale,
            class_weight=class_weight,
            argmax=None if argmax is None else argmax[start:end],
            z_loss=None if z_loss is None else z_loss[start:end],
            z_ratio=z_ratio,
        )
        # `logits` now holds d loss / d logits for this chunk. With fp32_weight_grad each chunk's
        # share is written, rounded once (cuBLAS sums it in fp32), and added to the fp32 sum.
        backprop_head(
            logits, hidden2d[start:end], weight, grad_hidden[start:end] if need_hidden else None, grad_weight,
            grad_bias, first=start == 0 or fp32_weight_grad,
        )
        if fp32_weight_grad:
            if start == 0:
                weight_grad_sum = grad_weight.float()
            else:
                weight_grad_sum += grad_weight
    if weight_grad_sum is not None:
        grad_weight.copy_(weight_grad_sum)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return losses, grad_hidden, grad_weight, grad_bias


def _reference(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss_scale, softcap,
               num_items_in_batch, max_chunk_bytes, class_weight=None, token_scaling=False, return_z_loss=False,
               return_argmax=False, fp32_weight_grad=False):
    """:func:`linear_cross_entropy_reference` with the public function's arguments."""
    return linear_cross_entropy_reference(
        hidden, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss_scale, softcap, num_items_in_batch,
        class_weight, token_scaling, return_z_loss, return_argmax,
    )


def _reference_in_function_order(hidden, weight, bias, target, num_items_in_batch, options, reduction, max_chunk_bytes,
                                 grad_enabled, class_weight, wanted, fp32_weight_grad):
    out = linear_cross_entropy_reference(
        hidden, weight, target, bias, options.ignore_index, reduction, options.label_smoothing, options.z_loss_scale,
        options.softcap, num_items_in_batch, None if class_weight is None else class_weight.weight,
        options.token_scaling, True, True,
    )
    return out.loss, out.z_loss, out.argmax


def _reference_point(ctx, saved):
    hidden, weight, bias, target = saved
    options, reduction, _, class_weight, wanted, fp32_weight_grad = ctx.config
    inputs = (hidden, weight, bias, target, ctx.num_items_in_batch, options, reduction, None, None, class_weight, wanted,
              fp32_weight_grad)
    return LINEAR_CROSS_ENTROPY, _reference_in_function_order, inputs


class _LinearCrossEntropyFunction(torch.autograd.Function):
    """Returns (loss, z_loss, argmax), the last two empty unless `wanted` (a pair of bools) asks
    for them; neither has a gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, num_items_in_batch, options, reduction, max_chunk_bytes, grad_enabled,
                class_weight, wanted, fp32_weight_grad):
        hidden2d, target1d = rows_view(hidden), target.reshape(-1)
        chunk = chunk_rows(max_chunk_bytes, weight.shape[0], hidden.dtype)
        # needs_input_grad follows requires_grad even under no_grad, when no backward can come.
        needs = [grad_enabled and need for need in ctx.needs_input_grad[:3]]
        ctx.save_for_backward(hidden, weight, bias, target)
        ctx.config = (options, reduction, chunk, class_weight, wanted, fp32_weight_grad)
        ctx.num_items_in_batch = num_items_in_batch
        ctx.grads = None
        ctx.z_ratio = None
        want_z_loss, want_argmax = wanted
        # A weighted mean divides the z-loss by the rows' count, not their weights (see
        # tigon.ops.cross_entropy), unless num_items_in_batch is both divisors.
        two_divisors = has_two_divisors(reduction, class_weight, options) and num_items_in_batch is None
        z_rows = want_z_loss or two_divisors
        z_loss = torch.empty(target1d.shape[0] if z_rows else 0, dtype=torch.float32, device=hidden.device)
        argmax = torch.empty(target1d.shape[0] if want_argmax else 0, dtype=torch.int64, device=hidden.device)
        extras = dict(
            class_weight=class_weight, argmax=argmax if want_argmax else None, z_loss=z_loss if z_rows else None,
            fp32_weight_grad=fp32_weight_grad,
        )
        argmax = argmax.view(target.shape) if want_argmax else argmax
        if reduction == "none":
            # The per-row grad_output arrives in backward, which recomputes the chunks with it.
            losses = _chunked_loss_and_grads(
                hidden2d, weight, bias, target1d, options, chunk, None, False, False, False, **extras
            )[0]
            z_loss = z_loss.view(target.shape) if want_z_loss else z_loss
            ctx.mark_non_differentiable(z_loss, argmax)
            return losses.view(target.shape), z_loss, argmax
        if reduction == "mean":
            ctx.inverse_denominator = 1.0 / mean_denominator(
                target1d, options.ignore_index, num_items_in_batch, torch.float32,
                None if class_weight is None else class_weight.weight,
            )
        else:
            ctx.inverse_denominator = torch.ones((), dtype=torch.float32, device=hidden.device)
        z_inverse_denominator = ctx.inverse_denominator
        if two_divisors:
            z_inverse_denominator = 1.0 / mean_denominator(target1d, options.ignore_index, None, torch.float32)
            ctx.z_ratio = z_inverse_denominator / ctx.inverse_denominator
        losses, *grads = _chunked_loss_and_grads(
            hidden2d, weight, bias, target1d, options, chunk,
            ctx.inverse_denominator if any(needs) else None, *needs, z_ratio=ctx.z_ratio, **extras,
        )
        ctx.grads = grads if any(needs) else None
        loss = losses.sum() * ctx.inverse_denominator
        if two_divisors:
            z_sum = z_loss.sum()
            loss = loss + z_sum * (z_inverse_denominator - ctx.inverse_denominator)
        z_loss = z_loss.sum() * z_inverse_denominator if want_z_loss else z_loss
        ctx.mark_non_differentiable(z_loss, argmax)
        return loss, z_loss, argmax

    @staticmethod
    @torch.autograd.function.once_differentiable
    @backward_fallback(_reference_point)
    def backward(ctx, saved, grad_output, *_):
        hidden, weight, bias, target = saved
        options, reduction, chunk, class_weight, _, fp32_weight_grad = ctx.config
        if ctx.grads is not None:
            # Computed in forward for grad_output = 1. Handed over once: a second backward
            # (retain_graph=True) recomputes below.
            grads, ctx.grads = ctx.grads, None
            for grad in grads:
                if grad is not None:
                    scale_in_place(grad, grad_output)
        else:
            scale = grad_output.reshape(-1) if reduction == "none" else grad_output * ctx.inverse_denominator
            grads = _chunked_loss_and_grads(
                rows_view(hidden), weight, bias, target.reshape(-1), options, chunk, scale,
                *ctx.needs_input_grad[:3], class_weight=class_weight, fp32_weight_grad=fp32_weight_grad,
                z_ratio=None if reduction == "none" else ctx.z_ratio,
            )[1:]
        grad_hidden, grad_weight, grad_bias = grads
        if grad_hidden is not None:
            grad_hidden = grad_hidden.view(hidden.shape)
        return grad_hidden, grad_weight, grad_bias, *[None] * 9


def _check(hidden, weight, target, bias, options, reduction, num_items_in_batch, max_chunk_bytes, class_weight) -> None:
    check_head(hidden, weight, bias, ("hidden", "weight", "bias"))
    check_target(target, hidden.shape[:-1], hidden.device, "hidden")
    check_loss_options(options, reduction)
    if num_items_in_batch is not None:
        if reduction != "mean":
            raise ValueError(f"num_items_in_batch replaces the mean's divisor: reduction must be 'mean', got {reduction!r}")
        is_int = isinstance(num_items_in_batch, int) and not isinstance(num_items_in_batch, bool)
        is_scalar_tensor = isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.dim() == 0
        if not (is_int or is_scalar_tensor):
            raise ValueError(f"num_items_in_batch must be an int or a 0-dim tensor, got {num_items_in_batch!r}")
        if is_scalar_tensor and num_items_in_batch.device.type != "cpu":
            check_device("num_items_in_batch", num_items_in_batch, hidden.device)
    check_chunk_bytes(max_chunk_bytes)
    check_class_weight("class_weight", class_weight, weight.shape[0], hidden.device)


def _linear_cross_entropy_kernel(
    hidden, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss_scale, softcap,
    num_items_in_batch, max_chunk_bytes, class_weight, token_scaling, return_z_loss, return_argmax, fp32_weight_grad,
):
    options = LossOptions(ignore_index, label_smoothing, z_loss_scale, softcap, token_scaling)
    wanted = (return_z_loss, return_argmax)
    loss, z_loss, argmax = _LinearCrossEntropyFunction.apply(
        hidden, weight, bias, target, num_items_in_batch, options, reduction, max_chunk_bytes,
        torch.is_grad_enabled(), class_weights(class_weight), wanted, fp32_weight_grad,
    )
    return loss_output(loss, z_loss, argmax, target, ignore_index, wanted)


# Inside torch.compile: the chunk loop as library ops (opaque, so the loop's count can follow a
# symbolic row count), the reduction's divisor and the gradients' scaling as torch ops around them.
_OPTIONS_SCHEMA = "int ignore_index, float label_smoothing, float z_loss_scale, float? softcap, int chunk"


def _loss_fake(hidden, weight, bias, target, scale, ignore_index, label_smoothing, z_loss_scale, softcap, chunk,
               need_hidden, need_weight, need_bias):
    needs = (need_hidden, need_weight, need_bias)
    return hidden.new_empty((), dtype=torch.float32), *head_grads_fake(hidden, weight, bias, needs)


@library_op(
    "linear_cross_entropy",
    f"(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor scale, {_OPTIONS_SCHEMA}, bool need_hidden, "
    "bool need_weight, bool need_bias) -> (Tensor, Tensor, Tensor, Tensor)",
    _loss_fake,
)
def _loss_op(hidden, weight, bias, target, scale, ignore_index, label_smoothing, z_loss_scale, softcap, chunk,
             need_hidden, need_weight, need_bias):
    """``sum(scale * losses)`` (`scale` 0-dim or one value per row) and its gradients."""
    options = LossOptions(ignore_index, label_smoothing, z_loss_scale, softcap)
    losses, *grads = _chunked_loss_and_grads(
        rows_view(hidden), weight, bias, target.reshape(-1), options, chunk, scale, need_hidden, need_weight, need_bias
    )
    loss = losses.sum() * scale if scale.dim() == 0 else (losses * scale).sum()
    return loss, *head_grads_out(hidden, grads)


register_forward_grads_autograd(_loss_op)


@library_op(
    "linear_cross_entropy_rows",
    f"(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, {_OPTIONS_SCHEMA}) -> Tensor",
    lambda hidden, weight, bias, target, *_: hidden.new_empty(target.shape, dtype=torch.float32),
)
def _rows_op(hidden, weight, bias, target, ignore_index, label_smoothing, z_loss_scale, softcap, chunk):
    """Each row's loss (reduction "none"); backward recomputes the chunks with their gradients."""
    options = LossOptions(ignore_index, label_smoothing, z_loss_scale, softcap)
    losses = _chunked_loss_and_grads(
        rows_view(hidden), weight, bias, target.reshape(-1), options, chunk, None, False, False, False
    )[0]
    return losses.view(target.shape)


def _rows_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.options = inputs[4:]


def _rows_backward(ctx, grad_losses):
    needs = ctx.needs_input_grad[:3]
    _, *grads = _loss_op(*ctx.saved_tensors, grad_losses.reshape(-1), *ctx.options, *needs)
    return (*(g if need else None for g, need in zip(grads, needs)), *[None] * 6)


_rows_op.register_autograd(_rows_backward, setup_context=_rows_setup_context)


def _linear_cross_entropy_compiled(
    hidden, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss_scale, softcap,
    num_items_in_batch, max_chunk_bytes, class_weight, token_scaling, return_z_loss, return_argmax, fp32_weight_grad,
):
    if class_weight is not None or token_scaling or return_z_loss or return_argmax or fp32_weight_grad:
        # Not library ops yet: inside torch.compile these options run the reference.
        return linear_cross_entropy_reference(
            hidden, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss_scale, softcap,
            num_items_in_batch, class_weight, token_scaling, return_z_loss, return_argmax,
        )
    chunk = chunk_rows(max_chunk_bytes, weight.shape[0], hidden.dtype)
    options = (ignore_index, float(label_smoothing), float(z_loss_scale), None if softcap is None else float(softcap), chunk)
    if reduction == "none":
        return _rows_op(hidden, weight, bias, target, *options)
    if reduction == "mean":
        scale = 1.0 / mean_denominator(target, ignore_index, num_items_in_batch, torch.float32)
    else:
        scale = torch.ones((), dtype=torch.float32, device=hidden.device)
    return _loss_op(hidden, weight, bias, target, scale, *options, *head_grad_needs(hidden, weight, bias))[0]


LINEAR_CROSS_ENTROPY = Op(
    "linear_cross_entropy", _linear_cross_entropy_kernel, _reference, compiled=_linear_cross_entropy_compiled
)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    max_chunk_bytes: int | None = None,
    class_weight: torch.Tensor | None = None,
    token_scaling: bool = False,
    return_z_loss: bool = False,
    return_argmax: bool = False,
    fp32_weight_grad: bool = False,
) -> torch.Tensor | LossOutput:
    """``cross_entropy(hidden @ weight.T + bias, target)`` without ever holding the (N, V) logits.

    Args:
        hidden: ``(..., H)`` float16/bfloat16/float32 (float64 runs the reference).
        weight: ``(V, H)`` (the LM head), dtype of `hidden`; under autocast any float dtype: `hidden`,
            `weight` and `bias` are cast to autocast's dtype as ``F.linear``'s operands would be.
        target: ``(...)`` int64/int32 class indices (shape of `hidden` without its last dim). A
            target outside ``[0, V)`` that is not `ignore_index` gives its row a NaN loss and
            gradient, checked on the device (``TIGON_DEBUG=1`` raises a ValueError naming it).
        bias: optional ``(V,)``.
        ignore_index, reduction, label_smoothing, z_loss_scale, softcap: as in
            :func:`tigon.functional.cross_entropy`.
        num_items_in_batch: an int or 0-dim tensor; the loss becomes ``sum / num_items_in_batch``
            (gradient accumulation that matches one large batch). Needs reduction="mean".
        max_chunk_bytes: the most bytes one chunk of logits may take (at least one row);
            default ``DEFAULT_MAX_CHUNK_BYTES``. Larger is faster and uses more memory.
        class_weight: ``(V,)`` float class weights, as `weight` of
            :func:`tigon.functional.cross_entropy` (torch's `weight`; the z-loss is not weighted
            and its mean divides by the count of rows): named apart because `weight` here is the
            LM head. With `num_items_in_batch` that count is the divisor of both terms.
        token_scaling, return_z_loss, return_argmax: as in
            :func:`tigon.functional.cross_entropy`; the argmax is taken over each chunk's logits
            in the pass that computes its loss: the logits still never exist as a whole.
        fp32_weight_grad: for fp16/bf16 weights, sum the chunks' weight gradients in fp32 and
            round once at the end (each chunk's share is rounded to the weight's dtype once), not
            in the weight's dtype after every chunk: closer to the exact gradient over many chunks,
            for an fp32 buffer of the weight's size more. No effect on fp32 weights.

    Returns:
        The loss in fp32 (shape of `target` for reduction="none"); with `return_z_loss` or
        `return_argmax`, a :class:`~tigon.ops.cross_entropy.LossOutput` holding it. An all-ignored batch gives 0
        and zero gradients. NaN/inf in `hidden`, `weight` or `bias` give NaN where the unfused
        loss does (the module docstring has the details). Gradients are computed in forward, for
        the tensors that require grad, and backward only scales them; no host sync in either.
    """
    if max_chunk_bytes is None:
        max_chunk_bytes = DEFAULT_MAX_CHUNK_BYTES
    options = LossOptions(ignore_index, label_smoothing, z_loss_scale, softcap, token_scaling)
    autocast, hidden, weight, bias = autocast_head(hidden, weight, bias)
    _check(hidden, weight, target, bias, options, reduction, num_items_in_batch, max_chunk_bytes, class_weight)
    check_flags(return_z_loss=return_z_loss, return_argmax=return_argmax, fp32_weight_grad=fp32_weight_grad)
    if debug_enabled():
        check_target_range(target, weight.shape[0], ignore_index)
    return LINEAR_CROSS_ENTROPY.without_autocast(
        autocast, None, hidden, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss_scale, softcap,
        num_items_in_batch, max_chunk_bytes, class_weight, token_scaling, return_z_loss, return_argmax, fp32_weight_grad,
    )
