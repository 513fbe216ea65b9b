"""Where each op runs: its Triton kernel or its PyTorch reference, and why.

Every public op goes through :func:`dispatch`. The rules (shared/DESIGN.md):

* Triton runs on a CUDA device of compute capability >= 8.0 with a working Triton, or on any
  device when ``TRITON_INTERPRET=1`` was set before tigon was imported (the CPU test mode).
* Otherwise the op runs its PyTorch reference, and the first such call per op logs one warning
  naming the reason.
* ``TIGON_DISABLE=rms_norm,rope`` (or ``all``) forces the reference for those ops.
* A kernel that raises while compiling or launching is not used again for that op; the call falls
  back to the reference and says so once. ``TIGON_STRICT=1`` re-raises instead (tests use it so a
  kernel bug cannot hide behind the fallback).
* Inside ``torch.compile`` the reference is traced (inductor fuses it); see :func:`dispatch`.
* ``TIGON_DEBUG=1`` also runs the reference on each call and logs the max abs/rel error once per
  op and shape, raising if the kernel produced NaN/inf where the reference did not.
"""

from __future__ import annotations

import functools
import logging
import os
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch
import torch.utils.checkpoint

log = logging.getLogger("tigon")

# The interpreter is chosen when a kernel is decorated, so what counts is the value at import.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: str | None = None
except ImportError as err:  # macOS, Windows, or a broken install: every op runs its reference
    TRITON_IMPORT_ERROR = f"triton cannot be imported ({err})"

    def _jit_stub(fn: Callable | None = None, **_: Any) -> Callable:
        return fn if fn is not None else (lambda f: f)

    triton = SimpleNamespace(jit=_jit_stub)
    tl = SimpleNamespace(constexpr=Any)

# Ops that exist, filled in by each op module so `tigon env` can report on all of them.
OPS: list[str] = []
# Those among them with no Triton kernel: plain torch on any device (TIGON_DISABLE still applies).
TORCH_OPS: set[str] = set()
_warned: set[str] = set()
_broken: dict[str, str] = {}
_debug_seen: set[tuple] = set()


def register(op: str, *, triton: bool = True) -> str:
    """Record an op name for `tigon env` and TIGON_DISABLE (`triton`: whether it has a Triton
    kernel, or is plain torch that runs on any device); returns the name."""
    if op not in OPS:
        OPS.append(op)
    if not triton:
        TORCH_OPS.add(op)
    return op


# Every op call reads TIGON_DISABLE and TIGON_DEBUG, so that setting them takes effect at once, and
# host time per op is what a training step on a fast GPU waits for: `os.environ.get` of an unset
# name costs ~2 us (it raises and catches KeyError inside), the dict behind os.environ (CPython's
# os._Environ._data, keyed by encoded names) ~0.05 us. Elsewhere the public mapping is read.
_ENVIRON_DATA = getattr(os.environ, "_data", None)
_ENCODE_KEY = getattr(os.environ, "encodekey", None)
_DECODE_VALUE = getattr(os.environ, "decodevalue", None)
_FAST_ENVIRON = isinstance(_ENVIRON_DATA, dict) and callable(_ENCODE_KEY) and callable(_DECODE_VALUE)


@functools.lru_cache(maxsize=None)
def _environ_key(name: str) -> Any:
    return _ENCODE_KEY(name)


def _env(name: str) -> str:
    """``os.environ.get(name, "")``, read on every call, quickly."""
    if not _FAST_ENVIRON:
        return os.environ.get(name, "")
    raw = _ENVIRON_DATA.get(_environ_key(name))
    return "" if raw is None else _DECODE_VALUE(raw)


def _env_flag(name: str) -> bool:
    return _env(name).lower() not in ("", "0", "false", "no", "off")


def disabled_ops() -> frozenset[str]:
    """The op names listed in TIGON_DISABLE (``all`` stands for every op)."""
    return _parse_op_list(_env("TIGON_DISABLE"))


# Every op call asks where it runs, so the answers are cached: host time per op is what a training
# step on a fast GPU waits for.
@functools.lru_cache(maxsize=16)
def _parse_op_list(raw: str) -> frozenset[str]:
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors on `device`; a small number on CPU so persistent kernels still
    run several programs under the interpreter."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _device_reason(device_type: str, index: int | None, interpret: bool) -> str | None:
    if TRITON_IMPORT_ERROR is not None:
        return TRITON_IMPORT_ERROR
    if interpret:
        return None
    if device_type != "cuda":
        return (
            f"tensors are on {device_type}; Triton kernels need a CUDA GPU "
            "(or TRITON_INTERPRET=1 set before importing tigon)"
        )
    major, minor = _capability(index)
    if (major, minor) < (8, 0):
        return f"compute capability {major}.{minor} is below 8.0"
    return None


def disabled(op: str) -> bool:
    """Whether TIGON_DISABLE names `op` (or ``all``)."""
    names = disabled_ops()
    return bool(names) and (op in names or "all" in names)


def why_not_triton(op: str, device: torch.device) -> str | None:
    """None when `op` can run its Triton kernel on `device`, else the reason it cannot."""
    if disabled(op):
        return "disabled by TIGON_DISABLE"
    if op in _broken:
        return _broken[op]
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return _device_reason(device.type, index, INTERPRET)


def _warn_once(op: str, message: str) -> None:
    if op not in _warned:
        _warned.add(op)
        log.warning("tigon: %s runs its PyTorch reference: %s", op, message)


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if isinstance(t, torch.Tensor)]


def _shape_key(args: Sequence[Any]) -> tuple:
    return tuple((tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor))


def _compare_with_reference(op: str, out: Any, expected: Any, args: Sequence[Any]) -> None:
    for got, want in zip(_tensors(out), _tensors(expected)):
        got32, want32 = got.detach().float(), want.detach().float()
        bad = ~torch.isfinite(got32) & torch.isfinite(want32)
        if bad.any():
            raise FloatingPointError(
                f"tigon: {op} kernel produced NaN/inf where the reference did not "
                f"(shapes {_shape_key(args)})"
            )
    key = (op, _shape_key(args))
    if key in _debug_seen:
        return
    _debug_seen.add(key)
    for i, (got, want) in enumerate(zip(_tensors(out), _tensors(expected))):
        diff = (got.detach().float() - want.detach().float()).abs()
        scale = want.detach().float().abs().clamp_min(1e-6)
        max_abs = diff.max().item() if diff.numel() else 0.0
        max_rel = (diff / scale).max().item() if diff.numel() else 0.0
        log.warning(
            "tigon debug: %s output %d shapes %s: max abs err %.3e, max rel err %.3e",
            op, i, key[1], max_abs, max_rel,
        )


def dispatch(
    op: str,
    kernel: Callable[..., Any],
    reference: Callable[..., Any],
    *args: Any,
    device: torch.device,
    unsupported: str | None = None,
) -> Any:
    """Run ``kernel(*args)`` where Triton can run it, else ``reference(*args)``.

    `unsupported` is an op-specific reason the kernel cannot take these inputs (a dtype or size it
    does not handle); it falls back like any other reason.
    """
    if torch.compiler.is_compiling():
        # Inside torch.compile the reference is traced and inductor fuses it: dynamo cannot launch
        # our kernels once a width is symbolic (dynamic=True, or a frame recompiled for a second
        # width, as Qwen3's per-head q/k norms cause), and for these ops inductor's fused kernels
        # time like ours. Ops that must stay ours under compile (the fused losses) are wrapped in
        # torch.compiler.disable, so they run eagerly and never reach this branch.
        return reference(*args)
    reason = unsupported or why_not_triton(op, device)
    if reason is not None:
        _warn_once(op, reason)
        return reference(*args)
    try:
        out = kernel(*args)
    except Exception as err:  # compile or launch failure: this op stays on the reference
        if _env_flag("TIGON_STRICT") or not is_kernel_failure(err):
            raise
        _broken[op] = f"its kernel failed ({type(err).__name__}: {err})"
        _warned.add(op)  # this warning is the op's one fallback message
        log.warning("tigon: %s kernel failed, falling back to the PyTorch reference: %r", op, err)
        return reference(*args)
    if _env_flag("TIGON_DEBUG"):
        with torch.no_grad():
            _compare_with_reference(op, out, reference(*args), args)
    return out


# Raised through an op's forward by others, not by its kernel: running out of memory, and the
# signal with which non-reentrant checkpointing stops a layer's recomputation once the tensors it
# needs are back (from the pack hook that the op's save_for_backward calls). Falling back on those
# would switch a working kernel off, or run the reference in the middle of a recomputation and save
# other tensors than the first pass did.
_STOP_RECOMPUTATION = getattr(torch.utils.checkpoint, "_StopRecomputationError", None)  # private to torch
_NOT_KERNEL_FAILURES: tuple[type[BaseException], ...] = (torch.OutOfMemoryError,) + (
    (_STOP_RECOMPUTATION,) if _STOP_RECOMPUTATION is not None else ()
)


def is_kernel_failure(err: BaseException) -> bool:
    """Whether `err`, raised from a kernel path, means the kernel cannot run (so falling back to
    the reference is right), rather than an error or signal that must reach the caller."""
    return not isinstance(err, _NOT_KERNEL_FAILURES)


def reference_backward(
    op: str,
    err: Exception,
    reference: Callable[..., Any],
    inputs: Sequence[Any],
    grad_outputs: Sequence[torch.Tensor | None],
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of `reference` at `inputs`, for a backward kernel that failed to compile or launch.

    Returns one gradient per input (None where an input is not a tensor that needs one).
    """
    if _env_flag("TIGON_STRICT") or not is_kernel_failure(err):
        raise err
    _broken[op] = f"its backward kernel failed ({type(err).__name__}: {err})"
    _warned.add(op)
    log.warning("tigon: %s backward kernel failed, using the PyTorch reference: %r", op, err)
    leaves = [
        a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a in inputs
    ]
    with torch.enable_grad():
        outs = _tensors(reference(*leaves))
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.requires_grad]
        wrt = [a for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]
        grads = torch.autograd.grad(
            [o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True
        )
    by_leaf = iter(grads)
    return tuple(next(by_leaf) if isinstance(a, torch.Tensor) and a.requires_grad else None for a in leaves)


def reset() -> None:
    """Forget warnings, broken kernels and debug reports (for tests and long-lived processes)."""
    _warned.clear()
    _broken.clear()
    _debug_seen.clear()
    _device_reason.cache_clear()
