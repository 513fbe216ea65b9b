"""Host-side launch-shape helpers agree with Triton's own (which cost microseconds per call), and
prebound launches take Triton's path exactly where its specialisation or hooks could differ."""

import types

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs

from tigon.ops import _launch
from tigon.ops._launch import cdiv, next_power_of_2


def test_cdiv_and_next_power_of_2_match_triton():
    for n in list(range(1, 2100)) + [65535, 65536, 65537, 128256, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for block in (1, 3, 16, 1000, 4096):
            assert cdiv(n, block) == triton.cdiv(n, block), (n, block)
    assert cdiv(0, 7) == 0


# --- PreboundKernel: the launch that skips Triton's per-call dispatch --------------------------


def _compiled_jit(fn):
    """`fn` as a compiled (not interpreted) JITFunction, whatever TRITON_INTERPRET says."""
    with knobs.runtime.scope():
        knobs.runtime.interpret = False
        return triton.jit(fn)


def _toy(x_ptr, y_ptr, n, scale, FLAG: tl.constexpr, BLOCK: tl.constexpr = 64):
    pass


class _FakeTriton:
    """Stands in for Triton's path (JITFunction.run) and its driver: records which path each
    launch took and what the launcher was given."""

    def __init__(self, kernel, monkeypatch):
        self.slow, self.fast = [], []
        self.compiled = types.SimpleNamespace(run=self._fast_run, function="fn-handle", packed_metadata="meta")
        monkeypatch.setattr(kernel.fn, "run", self._slow_run)
        active = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 77)
        monkeypatch.setattr(_launch, "_triton", types.SimpleNamespace(runtime=types.SimpleNamespace(
            driver=types.SimpleNamespace(active=active))))

    def _slow_run(self, *args, grid, warmup, **kwargs):
        self.slow.append((grid, args, kwargs))
        return self.compiled

    def _fast_run(self, *launch):
        self.fast.append(launch)


@pytest.fixture
def toy(monkeypatch):
    kernel = _launch.PreboundKernel(_compiled_jit(_toy))
    return kernel, _FakeTriton(kernel, monkeypatch)


def test_prebound_repeats_go_straight_to_the_launcher(toy):
    kernel, fake = toy
    x, y = torch.zeros(64), torch.zeros(64)
    kernel[(3,)](x, y, 10, 0.5, FLAG=True)
    assert len(fake.slow) == 1 and not fake.fast
    kernel[(3, 2)](x, y, 10, 0.25, FLAG=True)  # a float's value is not part of the specialisation
    assert len(fake.slow) == 1
    # grid padded to 3-D, the current stream, the compiled handles, no hooks, then every parameter
    # in order (the default BLOCK included), the new float among them
    assert fake.fast == [(3, 2, 1, 77, "fn-handle", "meta", None, None, None, x, y, 10, 0.25, True, 64)]


@pytest.mark.parametrize("change", ["int", "bool_for_int", "dtype", "alignment", "constexpr", "option", "none_pointer"])
def test_prebound_new_specialisation_goes_through_triton(toy, change):
    kernel, fake = toy
    x, y = torch.zeros(64), torch.zeros(64)
    args, kwargs = [x, y, 1, 0.5], {"FLAG": True}
    kernel[(1,)](*args, **kwargs)
    if change == "int":
        args[2] = 16
    elif change == "bool_for_int":  # True == 1 and hashes alike, but Triton types it i1
        args[2] = True
    elif change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float16)
    elif change == "alignment":
        args[0] = x[1:]
    elif change == "constexpr":
        kwargs["FLAG"] = False
    elif change == "option":
        kwargs["num_warps"] = 8
    else:
        args[1] = None
    kernel[(1,)](*args, **kwargs)
    assert len(fake.slow) == 2 and not fake.fast
    if change != "none_pointer":  # the new key is kept: its next call is a fast one
        kernel[(1,)](*args, **kwargs)
        assert len(fake.slow) == 2 and len(fake.fast) == 1


@pytest.mark.parametrize("hook", ["enter", "exit", "pre_run"])
def test_prebound_hooks_send_launches_through_triton(toy, hook):
    kernel, fake = toy
    x = torch.zeros(64)
    kernel[(1,)](x, x, 5, 1.0, FLAG=False)
    with knobs.runtime.scope():
        if hook == "pre_run":
            kernel.fn.pre_run_hooks.append(lambda *a, **k: None)
        else:
            getattr(knobs.runtime, f"launch_{hook}_hook").add(lambda *a: None)
        kernel[(1,)](x, x, 5, 1.0, FLAG=False)
        kernel.fn.pre_run_hooks.clear()
    assert len(fake.slow) == 2 and not fake.fast


def test_launched_leaves_interpreted_kernels_alone():
    with knobs.runtime.scope():
        knobs.runtime.interpret = True
        interpreted = triton.jit(_toy)
    assert _launch.launched(interpreted) is interpreted
    assert isinstance(_launch.launched(_compiled_jit(_toy)), _launch.PreboundKernel)


@pytest.mark.gpu
def test_prebound_rms_norm_matches_tritons_path_and_skips_it(monkeypatch):
    """On the GPU: after the first call, rms_norm's kernels launch without JITFunction.run, and
    give bit for bit what Triton's own path gives (also inside a CUDA graph)."""
    from tigon.functional import rms_norm
    from tigon.ops import rms_norm as module

    kernels = [module._rms_norm_fwd_kernel, module._rms_norm_bwd_kernel]
    assert all(isinstance(k, _launch.PreboundKernel) for k in kernels)
    x = torch.randn(37, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)

    def step():
        x.grad = w.grad = None
        rms_norm(x, w).backward(g)
        return x.grad.clone(), w.grad.clone()

    fast_first = step()
    calls = []
    for kernel in kernels:
        real = kernel.fn.run
        monkeypatch.setattr(kernel.fn, "run", lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    fast = step()
    assert not calls  # no launch went through Triton's path
    def noop(*args, **kwargs):  # a pre-run hook sends every launch down Triton's path
        pass

    for kernel in kernels:
        kernel.fn.pre_run_hooks.append(noop)
    try:
        slow = step()
    finally:
        for kernel in kernels:
            kernel.fn.pre_run_hooks.remove(noop)
    assert len(calls) == 2
    for a, b, c in zip(fast_first, fast, slow):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
        torch.testing.assert_close(b, c, rtol=0, atol=0)
    monkeypatch.undo()
    graph = torch.cuda.CUDAGraph()
    x.grad = w.grad = None
    with torch.cuda.graph(graph):
        rms_norm(x, w).backward(g)
    graph.replay()
    torch.testing.assert_close(x.grad, slow[0], rtol=0, atol=0)


def test_prebound_kernel_copies_and_forwards_attributes():
    import copy

    kernel = _launch.PreboundKernel(_compiled_jit(_toy))
    assert kernel.arg_names == ["x_ptr", "y_ptr", "n", "scale", "FLAG", "BLOCK"]
    assert copy.copy(kernel).fn is kernel.fn
