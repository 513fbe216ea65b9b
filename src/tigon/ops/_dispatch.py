"""Where each op runs (its kernels or its PyTorch reference), and why: one dispatcher for every op.

Each public op is an :class:`Op`. Its public function checks the arguments and calls the Op, which
applies these rules, the same for every op:

* An op with Triton kernels runs them on a CUDA device of compute capability >= 8.0 with a working
  Triton, or on any device when ``TRITON_INTERPRET=1`` was set before tigon was imported (the CPU
  test mode). An op that is torch calls only (cuBLAS choreography: LoRA, linear groups) runs its
  own code on any device.
* Otherwise the op runs its reference. The first fallback for each reason logs one line naming
  the ops the reason covers. An empty input runs the reference silently; float64 runs it always.
* ``TIGON_DISABLE=rms_norm,rope`` (or ``all``) forces the reference for those ops; a name that is
  no op raises ValueError.
* A kernel that raises while compiling or launching, in forward (here) or backward
  (:func:`backward_fallback`), is not used again for that op: the call falls back to the
  reference, said once. ``TIGON_STRICT=1`` re-raises instead (the tests set it, so a kernel bug
  cannot hide behind the fallback); running out of memory and checkpointing's early stop are never
  kernel failures.
* Ops whose operands the caller has cast for autocast run with autocast off
  (:meth:`Op.without_autocast`).
* Inside ``torch.compile`` an op runs its ``compiled`` path (its kernels as torch.library custom
  ops, :func:`library_op`, so compiled graphs keep them), or its reference if it has none; where it
  runs is decided once, when the graph is traced.
* ``TIGON_DEBUG=1`` also runs the reference on each call: it logs the max abs/rel error once per op
  and shape, logs once per op an input holding NaN/inf, and raises FloatingPointError where the
  kernel's output is NaN/inf and the reference's is not, or finite where the reference's is not.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.utils.checkpoint

from tigon.ops._checks import KERNEL_DTYPES

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

DISABLED = "disabled by TIGON_DISABLE"

# Every op call reads TIGON_DISABLE and TIGON_DEBUG, so that setting them takes effect at once, and
# host time per op is what a training step on a fast GPU waits for: `os.environ.get` of an unset
# name costs ~2 us (it raises and catches KeyError inside), the dict behind os.environ (CPython's
# os._Environ._data, keyed by encoded names) ~0.05 us. Elsewhere the public mapping is read.
_ENVIRON_DATA = getattr(os.environ, "_data", None)
_FAST_ENVIRON = isinstance(_ENVIRON_DATA, dict) and callable(getattr(os.environ, "encodekey", None))


def _reader(name: str) -> Callable[[], Any]:
    """A function returning the raw value of the environment variable `name` (None when unset;
    bytes or str), read on every call."""
    if _FAST_ENVIRON:
        return functools.partial(_ENVIRON_DATA.get, os.environ.encodekey(name))
    return functools.partial(os.environ.get, name)


_disable_value = _reader("TIGON_DISABLE")
_debug_value = _reader("TIGON_DEBUG")
_strict_value = _reader("TIGON_STRICT")


def _text(raw: Any) -> str:
    return os.fsdecode(raw) if isinstance(raw, bytes) else raw


@functools.lru_cache(maxsize=16)
def _flag(raw: Any) -> bool:
    return raw is not None and _text(raw).strip().lower() not in ("", "0", "false", "no", "off")


# name -> Op, in the order the op modules define them (tigon.ops imports every one, in the order of
# its op table).
_OPS: dict[str, "Op"] = {}


def debug_enabled() -> bool:
    """Whether TIGON_DEBUG is set now (read on every call, cheaply): ops with host-side checks too
    costly for the hot path (a device-to-host read) run them only then. Never inside
    torch.compile: those checks would break its graph where it traces them, and so would reading
    the environment itself (torch 2.11's dynamo cannot trace the dict lookup)."""
    if torch.compiler.is_compiling():
        return False
    raw = _debug_value()
    return raw is not None and _flag(raw)


@functools.lru_cache(maxsize=16)  # read on every op call: each distinct value is parsed once
def _disabled_names(raw: Any) -> frozenset[str]:
    """The op names a TIGON_DISABLE value lists, ``all`` standing for every op."""
    names = {name.strip() for name in _text(raw).split(",") if name.strip()}
    unknown = sorted(names - set(_OPS) - {"all"})
    if unknown:
        raise ValueError(
            f"TIGON_DISABLE names {', '.join(map(repr, unknown))}, which {'is no op' if len(unknown) == 1 else 'are no ops'}: "
            f"it takes op names ({', '.join(_OPS)}) or 'all'; switch names (qkv_group, lora, ...) "
            "go to `tigon sft --kernels-off` or tigon.patch(model, <switch>=False)"
        )
    return frozenset(_OPS) if "all" in names else frozenset(names)


def _disabled_now() -> frozenset[str]:
    raw = _disable_value()
    return frozenset() if raw is None else _disabled_names(raw)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


_DEVICE_REASONS: set[str] = set()  # reasons that hold for every op with kernels on a device


@functools.lru_cache(maxsize=None)
def _device_reason(device: torch.device, interpret: bool) -> str | None:
    if TRITON_IMPORT_ERROR is not None:
        reason = TRITON_IMPORT_ERROR
    elif interpret:
        return None
    elif device.type != "cuda":
        reason = (
            f"tensors are on {device.type}; Triton kernels need a CUDA GPU "
            "(or TRITON_INTERPRET=1 set before importing tigon)"
        )
    else:
        major, minor = _capability(device.index)
        if (major, minor) >= (8, 0):
            return None
        reason = f"compute capability {major}.{minor} is below 8.0"
    _DEVICE_REASONS.add(reason)
    return reason


@functools.lru_cache(maxsize=None)  # every op call asks: one cached lookup answers
def _placement_reason(device: torch.device, dtype: torch.dtype, uses_triton: bool, interpret: bool) -> str | None:
    """Why an op cannot run its own code on tensors of `dtype` on `device` (None if it can)."""
    if dtype not in KERNEL_DTYPES:
        return f"{dtype} runs on the reference"
    return _device_reason(device, interpret) if uses_triton else None


_noted: set[str] = set()  # fallback reasons already logged
_debug_seen: set[tuple] = set()


class Op:
    """One op's dispatch: its kernel path, its PyTorch reference, and its path inside torch.compile.

    Args:
        name: the op's name (what TIGON_DISABLE and ``tigon env`` say).
        kernel: the op's own path (an autograd Function's apply).
        reference: the pure-PyTorch reference, with the kernel's arguments.
        compiled: what runs inside torch.compile (the kernels as library ops, see
            :func:`library_op`); None runs the reference there.
        uses_triton: False for an op of torch calls only, which runs its own code on any device.
        parts: the other ops whose kernels this op runs: TIGON_DISABLE naming one of them
            disables this op too.
    """

    __slots__ = ("name", "kernel", "reference", "compiled", "uses_triton", "names", "broken")

    def __init__(
        self,
        name: str,
        kernel: Callable[..., Any],
        reference: Callable[..., Any],
        *,
        compiled: Callable[..., Any] | None = None,
        uses_triton: bool = True,
        parts: Iterable[Op] = (),
    ) -> None:
        self.name, self.kernel, self.reference, self.compiled = name, kernel, reference, compiled
        self.uses_triton = uses_triton
        self.names = frozenset([name, *(part.name for part in parts)])
        self.broken: str | None = None  # why its kernel is not used any more
        _OPS[name] = self
        _disabled_names.cache_clear()

    def __call__(self, unsupported: str | None, *args: Any) -> Any:
        """Run the op on `args` (the first a tensor, whose device, dtype and size decide), by its
        own path where it can run, else by its reference. `unsupported` is an op-specific reason
        the kernel cannot take these arguments (a size or dtype it does not handle), or None."""
        if torch.compiler.is_compiling():
            return self._traced(unsupported, args)
        lead = args[0]
        if not lead.numel():  # nothing to compute, nothing to say
            return self.reference(*args)
        reason = unsupported or self.reason(lead.device, lead.dtype)
        if reason is not None:
            if reason not in _noted:
                _note_fallback(self, reason)
            return self.reference(*args)
        try:
            out = self.kernel(*args)
        except Exception as err:  # compile or launch failure: this op stays on the reference
            if not self.falls_back(err):
                raise
            return self.reference(*args)
        if debug_enabled():
            _debug_check(self, out, args)
        return out

    def reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this op runs its reference on tensors of `dtype` on `device` (None if it need not)."""
        if self.broken is not None:
            return self.broken
        raw = _disable_value()
        if raw is not None and not self.names.isdisjoint(_disabled_names(raw)):
            return DISABLED
        return _placement_reason(device, dtype, self.uses_triton, INTERPRET)

    def without_autocast(self, autocast: torch.dtype | None, unsupported: str | None, *args: Any) -> Any:
        """:meth:`__call__` with autocast off when `autocast` (the dtype it would run in) is set:
        for ops whose caller has already cast the operands as autocast would, so that the GEMMs
        inside run in the dtype the operands have."""
        if autocast is None:
            return self(unsupported, *args)
        with torch.autocast(args[0].device.type, enabled=False):
            return self(unsupported, *args)

    def _traced(self, unsupported: str | None, args: Sequence[Any]) -> Any:
        lead = args[0]
        reason = unsupported or _compiled_reason(self.name, lead.device, lead.dtype)
        if reason is None and self.compiled is not None and lead.numel():
            return self.compiled(*args)
        return self.reference(*args)

    def falls_back(self, err: BaseException, stage: str = "") -> bool:
        """Whether this op falls back for an error its kernel path raised (`stage`: "" or
        "backward "): not under TIGON_STRICT nor for an error that is not the kernel's failure,
        which the caller re-raises; else the op runs its reference from now on, said once.

        The caller re-raises with a bare ``raise`` in its ``except`` block: an exception raised
        again from a function holding it (``raise err`` here) would keep that frame, and through
        the traceback every frame it passed with their tensors, in a reference cycle until the
        garbage collector runs. Checkpointing's early stop passes through every fused op of a
        recomputed layer: that cycle kept whole layers of activations alive (gc only runs every
        so many Python allocations, and a GPU step makes few)."""
        if _flag(_strict_value()) or not is_kernel_failure(err):
            return False
        self.broken = f"its {stage}kernel failed ({type(err).__name__}: {err})"
        _noted.add(self.broken)  # the warning below is this reason's one message
        log.warning("tigon: %s %skernel failed, falling back to the PyTorch reference: %r", self.name, stage, err)
        return True


def _covered(op: Op, reason: str) -> list[str]:
    """The ops a fallback reason holds for: every op with kernels (not disabled) for a device's
    reason, the disabled ops for TIGON_DISABLE, else `op` alone."""
    if reason in _DEVICE_REASONS:
        disabled = _disabled_now()
        return [name for name, other in _OPS.items() if other.uses_triton and name not in disabled]
    if reason == DISABLED:
        disabled = _disabled_now()
        return [name for name, other in _OPS.items() if not other.names.isdisjoint(disabled)]
    return [op.name]


def _name_list(names: Sequence[str], shown: int = 3) -> str:
    """``a, b, c and 4 more`` (or ``a and b``)."""
    if len(names) <= shown + 1:
        return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    return f"{', '.join(names[:shown])} and {len(names) - shown} more"


def _note_fallback(op: Op, reason: str) -> None:
    _noted.add(reason)
    names = _covered(op, reason) or [op.name]
    verb = "runs its PyTorch reference" if len(names) == 1 else "run their PyTorch references"
    log.warning("tigon: %s %s: %s", _name_list(names), verb, reason)


@torch.compiler.assume_constant_result  # decided when the graph is traced, not on every call
def _compiled_reason(name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    op = _OPS[name]
    reason = op.reason(device, dtype)
    if reason is not None and reason not in _noted:
        _note_fallback(op, reason)
    return reason


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


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if isinstance(t, torch.Tensor)]


def reference_grads(
    reference: Callable[..., Any],
    inputs: Sequence[Any],
    grad_outputs: Sequence[torch.Tensor | None],
    needs_input_grad: Sequence[bool],
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of ``reference(*inputs)`` for `grad_outputs` (one per output; None for an output
    without one), by autograd: one per input, None where `needs_input_grad` is False."""
    leaves = [
        a.detach().requires_grad_(True) if need and isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a, need in zip(inputs, needs_input_grad)
    ]
    wanted = [a for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]
    if not wanted:
        return (None,) * len(leaves)
    with torch.enable_grad():
        outs = reference(*leaves)
        outs = [outs] if isinstance(outs, torch.Tensor) else list(outs)
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o is not None and o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
    by_leaf = iter(grads)
    return tuple(next(by_leaf) if isinstance(a, torch.Tensor) and a.requires_grad else None for a in leaves)


def backward_fallback(
    reference_point: Callable[[Any, tuple], tuple[Op, Callable[..., Any], Sequence[Any]]],
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate an autograd Function's ``backward(ctx, saved, *grads)`` (`saved`: its saved
    tensors, unpacked once, before a backward that overwrites some of them in place) into a
    ``backward(ctx, *grads)`` that, when it raises (a backward kernel that fails to compile or
    launch), returns the reference's gradients, by autograd, with the rules of :meth:`Op.falls_back`
    (said once, TIGON_STRICT re-raises, out of memory propagates).

    `reference_point(ctx, saved)` gives ``(op, reference, inputs)``: `inputs` line up with the
    Function's forward arguments and ``reference(*inputs)`` returns what its forward returns (the
    tensors the output gradients belong to), so the reference's input gradients are the results.
    """

    def decorate(backward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(backward)
        def guarded(ctx: Any, *grads: Any) -> Any:
            saved = ctx.saved_tensors
            try:
                return backward(ctx, saved, *grads)
            except Exception as err:
                op, reference, inputs = reference_point(ctx, saved)
                if not op.falls_back(err, "backward "):
                    raise
                return reference_grads(reference, inputs, grads, ctx.needs_input_grad)

        return guarded

    return decorate


LIBRARY_OPS: dict[str, Any] = {}  # name -> the torch.library op tigon::<name>


def library_op(name: str, schema: str, fake: Callable[..., Any]) -> Callable[[Callable[..., Any]], Any]:
    """Register the decorated function as the custom op ``tigon::<name>`` (torch.library) with
    `schema` and the fake (meta) implementation `fake`, which gives outputs of the right shapes,
    dtypes and strides without computing them.

    These ops are what compiled graphs call: opaque to torch.compile, they run tigon's kernels
    (the same launchers as the eager autograd Functions) on the real tensors, so a symbolic width
    or row count costs nothing (the kernels' constexpr block sizes are picked from the real sizes
    at run time). Eager code calls the Functions directly: a custom op's dispatch costs the host
    several times an autograd Function's.
    """

    def decorate(impl: Callable[..., Any]) -> Any:
        op = torch.library.custom_op(f"tigon::{name}", impl, mutates_args=(), schema=schema)
        op.register_fake(fake)
        LIBRARY_OPS[name] = op
        return op

    return decorate


def empty_if(needed: bool, like: torch.Tensor, shape: Sequence[int] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh tensor of `shape` (default `like`'s) when `needed`, else an empty one: what a
    library op returns for a gradient nobody asked for (its outputs cannot be None)."""
    shape = like.shape if shape is None else shape
    return like.new_empty(shape if needed else (0,), dtype=dtype or like.dtype)


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a linear in on `x`'s device, or None when autocast is off."""
    device_type = x.device.type
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def capturing(device: torch.device | None = None) -> bool:
    """Whether the current CUDA stream (of `device`, if given) is capturing a CUDA graph: the one
    place tigon asks, for the ops that keep a buffer across calls and for tigon.patch, whose
    captured steps may skip what transformers does for a graph of any shape."""
    if device is not None and device.type != "cuda":
        return False
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _shape_key(args: Sequence[Any]) -> tuple:
    return tuple((tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor))


@functools.lru_cache(maxsize=None)
def _argument_names(reference: Callable[..., Any], count: int) -> tuple[str, ...]:
    """Names of the first `count` positional arguments of `reference` (``flat[i]`` for the items
    of a ``*flat``)."""
    names: list[str] = []
    try:
        parameters = list(inspect.signature(reference).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    for parameter in parameters:
        if parameter.kind == parameter.VAR_POSITIONAL:
            names += [f"{parameter.name}[{i}]" for i in range(count - len(names))]
            break
        names.append(parameter.name)
    return tuple(names[:count]) + tuple(f"argument {i}" for i in range(len(names), count))


def _debug_check(op: Op, out: Any, args: Sequence[Any]) -> None:
    """TIGON_DEBUG=1: the kernel's output against the reference's (see the module docstring)."""
    if (op.name, "inputs") not in _debug_seen:
        for name, a in zip(_argument_names(op.reference, len(args)), args):
            if isinstance(a, torch.Tensor) and a.is_floating_point() and not torch.isfinite(a).all():
                _debug_seen.add((op.name, "inputs"))
                log.warning("tigon debug: %s: argument %s holds NaN/inf", op.name, name)
                break
    with torch.no_grad():
        expected = _tensors(op.reference(*args))
    got = _tensors(out)
    for i, (ours, want) in enumerate(zip(got, expected)):
        ours, want = ours.detach().float(), want.detach().float()
        ours_finite, want_finite = torch.isfinite(ours), torch.isfinite(want)
        if (~ours_finite & want_finite).any():
            raise FloatingPointError(
                f"tigon: {op.name} kernel produced NaN/inf where the reference did not "
                f"(output {i}, shapes {_shape_key(args)})"
            )
        if (ours_finite & ~want_finite).any():
            raise FloatingPointError(
                f"tigon: {op.name} kernel produced a finite number where the reference gives NaN/inf "
                f"(output {i}, shapes {_shape_key(args)}): a silent wrong number"
            )
    key = (op.name, _shape_key(args))
    if key in _debug_seen:
        return
    _debug_seen.add(key)
    for i, (ours, want) in enumerate(zip(got, expected)):
        diff = (ours.detach().float() - want.detach().float()).abs()
        both = torch.isfinite(diff)
        diff = diff[both]
        scale = want.detach().float().abs()[both].clamp_min(1e-6)
        max_abs = diff.max().item() if diff.numel() else 0.0
        max_rel = (diff / scale).max().item() if diff.numel() else 0.0
        log.warning(
            "tigon debug: %s output %d shapes %s: max abs err %.3e, max rel err %.3e",
            op.name, i, key[1], max_abs, max_rel,
        )


def _op(name: str) -> Op:
    if name not in _OPS:
        raise ValueError(f"op must be one of {', '.join(_OPS)}, got {name!r}")
    return _OPS[name]


def op_names() -> tuple[str, ...]:
    """Every op's name, in the order tigon.ops defines them (what TIGON_DISABLE takes)."""
    return tuple(_OPS)


def disabled(op: str) -> bool:
    """Whether TIGON_DISABLE disables `op` (it, one of the ops whose kernels it runs, or ``all``)."""
    return not _op(op).names.isdisjoint(_disabled_now())


def why_not_triton(op: str, device: torch.device) -> str | None:
    """None when `op` runs its own code on `device` (its Triton kernels, or the torch calls of an
    op without any), else why it runs its reference there."""
    entry = _op(op)
    if disabled(op):
        return DISABLED
    if entry.broken is not None:
        return entry.broken
    if not entry.uses_triton:
        return None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _device_reason(device, INTERPRET)


def placement(op: str, device: torch.device) -> tuple[str, str | None]:
    """Where `op` runs on `device`: ``("triton", None)``, ``("torch", None)`` for an op of torch
    calls only, or ``("reference", why)``."""
    reason = why_not_triton(op, device)
    if reason is not None:
        return "reference", reason
    return ("triton" if _OPS[op].uses_triton else "torch"), None


def reset() -> None:
    """Forget logged fallbacks, broken kernels and debug reports (for tests and long-lived processes)."""
    _noted.clear()
    _debug_seen.clear()
    for op in _OPS.values():
        op.broken = None
    _device_reason.cache_clear()
    _placement_reason.cache_clear()
    _disabled_names.cache_clear()
