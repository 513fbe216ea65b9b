"""Comparison helpers shared by the tests."""

import collections
import contextlib
import functools
import sys

import pytest

import torch

# Relative error ‖got − want‖ / ‖want‖ allowed per dtype (fp32 arithmetic lands far below 1e-3).
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype | None = None, name: str = "",
                 tol: float | None = None) -> None:
    """Same shape and dtype, finite where `want` is, and ‖got − want‖ / ‖want‖ within the dtype's
    bound (or every element within that bound absolutely, for values that are ~0)."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    got64, want64 = got.detach().double().cpu(), want.detach().double().cpu()
    assert (torch.isfinite(got64) | ~torch.isfinite(want64)).all(), f"{name}: NaN/inf where the reference is finite"
    diff = (got64 - want64).nan_to_num(nan=float("inf"))
    rel = (diff.norm() / want64.norm().clamp_min(1e-30)).item()
    tol = tol or REL_TOL[dtype or want.dtype]
    # Values that are ~0 (a width-1 row's input gradient) have no meaningful relative error.
    tiny = diff.numel() == 0 or diff.abs().max().item() <= tol
    assert rel <= tol or tiny, f"{name}: relative error {rel:.3e} > {tol:.0e}"


def _leaves(args, dtype=None):
    return [
        a.detach().to(dtype or a.dtype).requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
        for a in args
    ]


def _as_list(out):
    return [out] if isinstance(out, torch.Tensor) else [o for o in out if isinstance(o, torch.Tensor)]


def compare_fwd_bwd(fn, reference, args, dtype=None, name="", tol=None):
    """Run `fn` on copies of `args` and `reference` on float64 copies (the oracle), backpropagate
    the same random output gradients through both, and assert that outputs and every input
    gradient agree within the tolerance of `dtype` (default: the least precise input dtype).
    Returns fn's outputs."""
    floats = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    dtype = dtype or max(floats, key=lambda d: REL_TOL[d])
    ours, theirs = _leaves(args), _leaves(args, torch.float64)
    out, ref = _as_list(fn(*ours)), _as_list(reference(*theirs))
    assert len(out) == len(ref), f"{name}: {len(out)} outputs, reference has {len(ref)}"
    for i, (o, r) in enumerate(zip(out, ref)):
        assert_close(o, r.to(o.dtype), dtype, f"{name} output {i}", tol)
    # Both get the same output gradients, rounded to the op's dtype: a sum of a few of them (a
    # width-1 norm's weight gradient) can cancel to far below its terms, and the rounding of the
    # terms would then show as a large relative error that no code could avoid.
    grads = [torch.randn_like(o) for o in out]
    torch.autograd.backward(out, grads)
    torch.autograd.backward(ref, [g.to(r.dtype) for g, r in zip(grads, ref)])
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            assert a.grad is not None, f"{name}: no gradient for argument {i}"
            assert_close(a.grad, b.grad.to(a.grad.dtype), dtype, f"{name} grad of argument {i}", tol)
    return out


def saved_activation_bytes(module: torch.nn.Module, *args, **kwargs) -> tuple[int, object]:
    """Bytes of the tensors autograd saves for backward during ``module(*args, **kwargs)``,
    parameters excluded and each storage counted once; and what the call returned."""
    params = {p.data_ptr() for p in module.parameters()}
    storages = {}

    def pack(t):
        if t.data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*args, **kwargs)
    return sum(storages.values()), out


def autograd_nodes(out: torch.Tensor) -> set:
    """Every node of the autograd graph that produced `out`."""
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack += [next_node for next_node, _ in node.next_functions]
    return seen


def head_inputs(lead, hidden, vocab, dtype, device, bias=True, ignore_index=-100):
    """Hidden states ``(*lead, hidden)``, an LM head (weight, optional bias), all requiring grad,
    and targets of shape `lead` with a quarter of them `ignore_index`: inputs of the fused head ops."""
    h = torch.randn(*lead, hidden, device=device).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device) * 2 * hidden**-0.5).to(dtype).requires_grad_()
    b = (0.5 * torch.randn(vocab, device=device)).to(dtype).requires_grad_() if bias else None
    target = torch.randint(0, vocab, lead, device=device)
    flat = target.view(-1)
    flat[torch.randperm(flat.numel(), device=device)[: max(1, flat.numel() // 4)]] = ignore_index
    return h, w, b, target


def count_gemms(monkeypatch):
    """Record the output shape of every torch.mm / addmm / addmm_ the op runs."""
    shapes = []
    real_mm, real_addmm, real_addmm_ = torch.mm, torch.addmm, torch.Tensor.addmm_

    def mm(*a, **k):
        out = real_mm(*a, **k)
        shapes.append(tuple(out.shape))
        return out

    def addmm(*a, **k):
        out = real_addmm(*a, **k)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "addmm", addmm)
    monkeypatch.setattr(torch.Tensor, "addmm_", lambda self, *a, **k: shapes.append(tuple(self.shape)) or real_addmm_(self, *a, **k))
    return shapes


def peak_bytes_beyond_grads(step, leaves) -> int:
    """CUDA bytes one call of `step` (a fwd+bwd, run once before to warm up) allocates at its peak
    beyond what was allocated before it, less the `.grad` buffers of `leaves` it produces: the
    peak the op benchmarks report (`tigon.bench.harness`)."""
    step()
    for leaf in leaves:
        leaf.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base - sum(leaf.grad.nbytes for leaf in leaves if leaf.grad is not None)


def run_without_host_sync(step) -> None:
    """Run `step` once to warm up, then again with CUDA's sync debug mode raising on any host sync."""
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def tigon_kernels() -> dict[str, object]:
    """Every Triton kernel object of tigon.ops, by kernel name (for counting launches): a
    ``@triton.jit`` function, or the :class:`~tigon.ops._launch.PreboundKernel` wrapping one on a
    GPU (the interpreter keeps the plain function)."""
    from triton.runtime.jit import KernelInterface

    from tigon.ops._launch import PreboundKernel

    return {
        value.fn.__name__: value
        for name, module in list(sys.modules.items()) if name.startswith("tigon.ops.")
        for value in vars(module).values() if isinstance(value, (KernelInterface, PreboundKernel))
    }


@contextlib.contextmanager
def kernel_launches():
    """Count the launches of tigon's Triton kernels, by kernel name, while the block runs: whoever
    launches them (an eager autograd Function, or a compiled graph's library op)."""
    counts = collections.Counter()
    ours = {id(kernel) for kernel in tigon_kernels().values()}
    patched = {}
    for cls in {type(kernel) for kernel in tigon_kernels().values()}:
        launch = cls.__getitem__

        def counted(kernel, grid, launch=launch):
            if id(kernel) in ours:
                counts[kernel.fn.__name__] += 1
            return launch(kernel, grid)

        patched[cls] = cls.__dict__.get("__getitem__")
        cls.__getitem__ = counted
    try:
        yield counts
    finally:
        for cls, own in patched.items():
            if own is None:
                del cls.__getitem__
            else:
                cls.__getitem__ = own


def save_tiny_vlm(path, seed: int = 1):
    """The built-in tiny Qwen2-VL with its processor, saved to `path`: random weights drawn wider
    than the default (which answer every image with newlines), so that greedy answers are words
    that change with the image."""
    from transformers import AutoModelForImageTextToText

    from tigon.train import tiny, tiny_vlm

    processor = tiny_vlm.build_processor()
    config = tiny_vlm.build_model(processor, seed).config
    for part in (config, config.text_config, config.vision_config):
        part.initializer_range = 0.2
    tiny.random_model(config, seed, auto=AutoModelForImageTextToText).save_pretrained(path)
    processor.save_pretrained(path)
    return path


def record_offload_sessions(monkeypatch) -> list:
    """Every tigon.patch.offload.ActivationOffload opened from now on (this test's), to see what
    it moved."""
    from tigon.patch import offload

    opened = []

    class Recording(offload.ActivationOffload):
        def __init__(self, *args):
            super().__init__(*args)
            opened.append(self)

    monkeypatch.setattr(offload, "ActivationOffload", Recording)
    return opened


@functools.cache
def _cpu_rowwise_scaled_mm_error() -> str | None:
    e4m3 = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(e4m3, e4m3.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as err:
        return (str(err).splitlines() or [type(err).__name__])[0][:200]
    return None


def skip_without_cpu_rowwise_scaled_mm() -> None:
    """Skip the calling test where this torch's CPU ``torch._scaled_mm`` takes no scale per row
    (FP8's rowwise recipe emulated on the CPU; older torch releases have tensorwise scales only)."""
    error = _cpu_rowwise_scaled_mm_error()
    if error is not None:
        pytest.skip(f"this torch's CPU _scaled_mm refuses row scales: {error}")


# What a process of a multi-process test imports before it does anything (about 8 s of a CPU
# core each, mostly transformers' Trainer): imported once, by the fork server that then forks
# every such process of this test process. A name that does not import is passed over.
SPAWN_PRELOAD = ["torch", "transformers", "transformers.trainer", "peft", "tigon.train.trainer", "tigon.train.run",
                 "tigon.cli", "tests.helpers"]


def _spawned(rank: int, fn, env: dict[str, str], args: tuple) -> None:
    # The fork server's environment is the one it started with: the test's own now (a
    # monkeypatched variable included), as a spawned process would have it.
    import os

    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)


def spawn(fn, args: tuple = (), nprocs: int = 2) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``: `nprocs` fresh processes, each calling
    ``fn(rank, *args)``, joined, one's exception raised here. They are forked from Python's fork
    server, which imported SPAWN_PRELOAD once (nothing run, no thread started, no state set up),
    instead of each starting Python and importing them again."""
    import multiprocessing
    import os

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(SPAWN_PRELOAD)  # before it starts; then kept
    mp.start_processes(_spawned, args=(fn, dict(os.environ), args), nprocs=nprocs, join=True,
                       start_method="forkserver")
