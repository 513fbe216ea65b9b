"""Argument checks shared by the ops: each raises ValueError naming the argument and what was
expected, before any kernel runs."""

from __future__ import annotations

from typing import Collection

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# dtypes the kernels take; float64 is accepted by the ops but runs on the reference.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TARGET_DTYPES = (torch.int64, torch.int32)


def is_number(x: object) -> bool:
    """Whether `x` is an int or a float (a bool is neither)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{name} must be a floating-point tensor (float16, bfloat16, float32 or float64), "
            f"got {t.dtype}"
        )


def check_input(x: torch.Tensor) -> None:
    """`x` is a float tensor with a last dim (the features of a linear layer)."""
    check_float("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the features), got a scalar")


def check_vector(name: str, t: torch.Tensor, length: int, device: torch.device) -> None:
    """`t` is a 1-D float tensor of `length` elements on `device`."""
    check_float(name, t)
    if t.dim() != 1 or t.shape[0] != length:
        raise ValueError(
            f"{name} must have shape ({length},) to match the last dim of the input, "
            f"got {tuple(t.shape)}"
        )
    check_device(name, t, device)


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the input")


def check_choice(name: str, value: object, choices: Collection[object]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def check_target(target: torch.Tensor, rows_shape: torch.Size, device: torch.device, of: str) -> None:
    """`target` holds class indices with shape `rows_shape` (that of `of` without its last dim)."""
    if not isinstance(target, torch.Tensor):
        raise ValueError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in TARGET_DTYPES:
        raise ValueError(f"target must hold class indices as int64 or int32, got {target.dtype}")
    if target.shape != rows_shape:
        raise ValueError(
            f"target must have shape {tuple(rows_shape)} ({of} without its last dim), got {tuple(target.shape)}"
        )
    check_device("target", target, device)


def check_ignore_index(ignore_index: int) -> None:
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")


def check_divisor(name: str, value: object) -> None:
    """`value` is a loss's divisor: a positive number or a 0-dim tensor (not read: no host sync)."""
    is_scalar_tensor = isinstance(value, torch.Tensor) and value.dim() == 0
    if not ((is_number(value) and value > 0) or is_scalar_tensor):
        raise ValueError(f"{name} must be a positive number or a 0-dim tensor, got {value!r}")


def check_eps(eps: float) -> None:
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")


def input_grad_rows(grad_out: torch.Tensor, grad_out2d: torch.Tensor, x2d: torch.Tensor, in_place: bool) -> torch.Tensor:
    """Where a norm's backward writes dx (rows shaped as `x2d`): with `in_place`, over the output
    gradient's rows `grad_out2d` when they can hold it (`grad_out` contiguous, of x's dtype), else
    a buffer of its own. The kernels read each element of grad_out before writing it, in the same
    program; whether anyone else still reads grad_out is the caller's promise (see
    :func:`tigon.ops.rms_norm.rms_norm`)."""
    if in_place and grad_out.is_contiguous() and grad_out.dtype == x2d.dtype:
        return grad_out2d
    return torch.empty_like(x2d)


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """`x` as a 2-D (rows, last dim) tensor whose last dim is contiguous.

    A view when the strides allow one (so sliced or batch-strided inputs are not copied), else a
    contiguous copy.
    """
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    return x2d
