"""Launch shapes shared by the kernels."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

try:
    import triton as _triton
    import triton.runtime.jit  # noqa: F401  (the JITFunction class)
    from triton import knobs as _knobs
except ImportError:  # no Triton, or one from before triton.knobs: kernels launch through Triton's own path
    _triton = _knobs = None


# Host-side integer helpers for launch shapes. triton.cdiv / triton.next_power_of_2 are constexpr
# functions whose wrapper costs microseconds per call (4 us on a 2026 CPU), several times per op.
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= `n` (n >= 1)."""
    return 1 << (int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)  # called on every launch; a pure function of the width
def row_block_config(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_COLS, num_warps) for a kernel that holds whole rows in registers.

    Narrow rows are batched so each program moves at least ~2K elements; warps grow with the tile
    so each thread keeps a few 16-byte vectors in flight. On the H200 (2026-11-29 sweep,
    scripts/tune_norm_backward.py) 16 warps beat 32 up to 16K-wide rows; only wider rows need 32
    to keep the row in registers.
    """
    block_cols = next_power_of_2(n_cols)
    block_rows = max(1, 2048 // block_cols)
    max_warps = 16 if block_cols <= 16384 else 32
    num_warps = min(max_warps, max(1, block_rows * block_cols // 512))
    return block_rows, block_cols, num_warps


# Vocab elements per loop step, and per thread, of the kernels that walk a row of logits: the pass
# that only reads the row keeps 32 elements per thread in flight, a pass that also writes the
# gradient 16. Tuned on the H200 with scripts/tune_cross_entropy.py.
VOCAB_MAX_BLOCK = 8192
VOCAB_ELEMENTS_PER_THREAD = {False: 32, True: 16}


def vocab_block_config(n_cols: int, writes_grad: bool) -> tuple[int, int]:
    """(BLOCK, num_warps) for a kernel that walks a row of `n_cols` logits block by block, and
    writes the row's gradient too if `writes_grad`."""
    block = min(VOCAB_MAX_BLOCK, next_power_of_2(n_cols))
    return block, max(1, min(16, block // (32 * VOCAB_ELEMENTS_PER_THREAD[writes_grad])))


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors on `device`; a small number on CPU so persistent kernels still
    run several programs under the interpreter."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def persistent_programs(n_blocks: int, device: torch.device) -> int:
    """Programs for a persistent kernel over `n_blocks` row blocks: two per multiprocessor at most."""
    return max(1, min(n_blocks, 2 * multiprocessor_count(device)))


# --- Launching a compiled kernel without Triton's per-call dispatch ----------------------------
#
# `kernel[grid](*args)` on a JITFunction works out, on every call, the argument specialisation
# (each tensor's dtype and 16-byte alignment, each int's type, divisibility by 16 and equality to
# 1), a string key of it and of the options, looks the compiled kernel up, builds its launch
# metadata and calls the (empty) launch hooks: in Triton 3.6 about as many host instructions per
# launch as a whole empty autograd Function's forward and backward. A `launched` kernel keeps the
# compiled kernel Triton chose under a key of its own: the exact value (and type) of every int or
# bool, the dtype and address mod 16 of every tensor, the value of every constexpr and option, and
# of a float only that it is one. That key is finer than Triton's, so the kernel found through
# Triton's own path at a key's first call is the one Triton would pick for every later call of it.
# Not in the key: Triton's debug and instrumentation knobs, which a training run does not flip.

_PREBOUND_LIMIT = 4096  # keys kept per kernel: a run whose sizes never repeat starts over, not grows


def _hook_set(hook: Any) -> bool:
    """Whether a Triton launch hook is set (Triton >= 3.5 holds a chain of them, empty by default)."""
    return bool(getattr(hook, "calls", hook))


def _binder(fn: Any, tensors: frozenset[str]) -> Callable[..., tuple[tuple, tuple]]:
    """A function of ``(device, *args, **kwargs)`` as the kernel `fn` takes them, returning the
    key of the call and every parameter's value in order (what the compiled kernel's launcher
    takes). `tensors` names the parameters passed tensors. Generated, like Triton's own binder, so
    that a launch costs no Python call per argument."""
    names = fn.arg_names
    defaults = {f"_default_{p.name}": p.default for p in fn.params if p.default is not inspect.Parameter.empty}
    signature = ", ".join(f"{n}=_default_{n}" if f"_default_{n}" in defaults else n for n in names)
    parts = []
    for name in names:
        if name in tensors:
            parts += [f"{name}.dtype", f"{name}.data_ptr() & 15"]
        else:  # an int is itself; a float stands for its type (Triton passes any as fp32); else (type, value)
            parts.append(f"({name} if {name}.__class__ is int else "
                         f"float if {name}.__class__ is float else ({name}.__class__, {name}))")
    source = (f"def bind(_device, {signature}, **_options):\n"
              f"    return (_device, {', '.join(parts)}, *_options.items()), ({', '.join(names)},)\n")
    namespace = dict(defaults)
    exec(source, namespace)
    return namespace["bind"]


class PreboundKernel:
    """A ``@triton.jit`` kernel whose ``kernel[grid](*args, **kwargs)`` goes straight to the
    compiled kernel's launcher once a call of the same key (see above) has gone through Triton's
    own path. Launch hooks (a profiler's) and the kernel's pre-run hooks send every call down
    Triton's path, which calls them; so does a call whose tensors sit where the first call had
    none (an optional pointer given at times)."""

    __slots__ = ("_bind", "_compiled", "_driver", "_tensors", "fn")

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._compiled: dict[tuple, tuple] = {}
        self._bind: Callable[..., tuple[tuple, tuple]] | None = None
        self._tensors: frozenset[str] = frozenset()
        # (current device, stream of a device): Triton's active driver, known once it has launched
        self._driver: tuple[Callable[[], int], Callable[[int], int]] | None = None

    def __getattr__(self, name: str) -> Any:  # the JITFunction's attributes (fn, arg_names, warmup, ...)
        if name == "fn":  # not set yet (a copy being made): no recursion through self.fn
            raise AttributeError(name)
        return getattr(self.fn, name)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return functools.partial(self._launch, grid)

    def _launch(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        bind = self._bind
        if bind is None:
            self._slow_launch(grid, args, kwargs)
            return
        device = self._driver[0]()
        try:
            key, values = bind(device, *args, **kwargs)
        except AttributeError:  # a tensor's parameter given something else (None): Triton's path
            entry = None
        else:
            entry = self._compiled.get(key)
        runtime = _knobs.runtime
        if (entry is None or self.fn.pre_run_hooks or _hook_set(runtime.launch_enter_hook)
                or _hook_set(runtime.launch_exit_hook)):
            self._slow_launch(grid, args, kwargs)
            return
        run, function, metadata = entry
        run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, self._driver[1](device),
            function, metadata, None, None, None, *values)

    def _tensor_params(self, args: tuple, kwargs: dict) -> frozenset[str]:
        given = {**dict(zip(self.fn.arg_names, args)), **kwargs}
        return frozenset(name for name, value in given.items() if isinstance(value, torch.Tensor))

    def _slow_launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        """Launch through Triton's own path, and keep the compiled kernel it used under the key."""
        compiled = self.fn.run(*args, grid=grid, warmup=False, **kwargs)
        if self._bind is None:
            active = _triton.runtime.driver.active  # set up once a kernel has gone through Triton's path
            self._driver = (active.get_current_device, active.get_current_stream)
            self._tensors = self._tensor_params(args, kwargs)
            self._bind = _binder(self.fn, self._tensors)
        if (compiled is None or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))
                or self._tensor_params(args, kwargs) != self._tensors):
            return  # an asynchronous compile's future, or tensors where the binder has none: no shortcut
        if len(self._compiled) >= _PREBOUND_LIMIT:
            self._compiled.clear()
        key, _ = self._bind(self._driver[0](), *args, **kwargs)
        self._compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata)


def launched(kernel: Any) -> Any:
    """Decorate a ``@triton.jit`` kernel that the host launches (not a helper that kernels call)
    so that its launches skip Triton's per-call dispatch (see :class:`PreboundKernel`). Under the
    interpreter, or with a Triton without ``triton.knobs`` (before 3.4), the kernel is returned as
    it is."""
    if _knobs is None or not isinstance(kernel, _triton.runtime.jit.JITFunction):
        return kernel
    return PreboundKernel(kernel)
