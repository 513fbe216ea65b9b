"""Dispatch rules: Triton where it can run, the reference otherwise, loudly; switches and debug."""

import logging

import pytest
import torch

import tigon.functional as F
from tigon import _backend
from tigon.ops import rms_norm as rms_norm_module
from tigon.ops.rms_norm import rms_norm_reference


@pytest.fixture
def spy_kernel(monkeypatch):
    """Counts calls to the RMSNorm kernel Function."""
    calls = []
    real = rms_norm_module._RMSNormFunction.apply

    def apply(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(rms_norm_module._RMSNormFunction, "apply", apply)
    return calls


def _inputs():
    return torch.randn(4, 33), torch.randn(33)


def test_interpreter_runs_the_kernel(spy_kernel):
    assert _backend.INTERPRET, "the suite runs with TRITON_INTERPRET=1"
    F.rms_norm(*_inputs())
    assert len(spy_kernel) == 1


def test_cpu_without_interpreter_falls_back_and_warns_once(monkeypatch, caplog, spy_kernel):
    monkeypatch.setattr(_backend, "INTERPRET", False)
    x, w = _inputs()
    with caplog.at_level(logging.WARNING, logger="tigon"):
        out = F.rms_norm(x, w)
        F.rms_norm(x, w)
    assert not spy_kernel
    torch.testing.assert_close(out, rms_norm_reference(x, w))
    warnings = [r.getMessage() for r in caplog.records if "rms_norm runs its PyTorch reference" in r.getMessage()]
    assert len(warnings) == 1 and "tensors are on cpu" in warnings[0]


@pytest.mark.parametrize("value", ["rms_norm", "layer_norm, rms_norm", "all"])
def test_tigon_disable_forces_reference(monkeypatch, spy_kernel, value):
    monkeypatch.setenv("TIGON_DISABLE", value)
    F.rms_norm(*_inputs())
    assert not spy_kernel
    assert _backend.why_not_triton("rms_norm", torch.device("cpu")) == "disabled by TIGON_DISABLE"


def test_tigon_disable_of_other_op_keeps_kernel(monkeypatch, spy_kernel):
    monkeypatch.setenv("TIGON_DISABLE", "layer_norm")
    F.rms_norm(*_inputs())
    assert len(spy_kernel) == 1


def test_switches_follow_the_environment_call_by_call(monkeypatch, spy_kernel):
    """The fast read of TIGON_* sees every change made through os.environ, unset included."""
    assert _backend._FAST_ENVIRON, "CPython's os.environ keeps its values in a dict, _data"
    monkeypatch.delenv("TIGON_DISABLE", raising=False)
    assert _backend._env("TIGON_DISABLE") == ""
    F.rms_norm(*_inputs())
    monkeypatch.setenv("TIGON_DISABLE", "rms_norm")
    assert _backend._env("TIGON_DISABLE") == "rms_norm"
    F.rms_norm(*_inputs())
    monkeypatch.delenv("TIGON_DISABLE")
    F.rms_norm(*_inputs())
    assert len(spy_kernel) == 2
    monkeypatch.setenv("TIGON_DEBUG", "yes")
    assert _backend._env_flag("TIGON_DEBUG")
    monkeypatch.setenv("TIGON_DEBUG", "off")
    assert not _backend._env_flag("TIGON_DEBUG")


def _broken_kernel(*args, **kwargs):
    raise RuntimeError("simulated compile failure")


def test_failing_kernel_falls_back_once_and_stays_off(monkeypatch, caplog):
    monkeypatch.delenv("TIGON_STRICT")
    monkeypatch.setattr(rms_norm_module._RMSNormFunction, "apply", _broken_kernel)
    x, w = _inputs()
    with caplog.at_level(logging.WARNING, logger="tigon"):
        out = F.rms_norm(x, w)
        F.rms_norm(x, w)
    torch.testing.assert_close(out, rms_norm_reference(x, w))
    failures = [r for r in caplog.records if "kernel failed" in r.getMessage()]
    assert len(failures) == 1
    assert "simulated compile failure" in _backend.why_not_triton("rms_norm", x.device)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("simulated"), torch.utils.checkpoint._StopRecomputationError()])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_errors_not_from_the_kernel_propagate_and_keep_it_on(monkeypatch, error, where):
    # Out of memory, or checkpointing's early stop raised from a pack hook inside the op's forward:
    # not the kernel's failure, so no fallback and the kernel stays on.
    monkeypatch.delenv("TIGON_STRICT")

    def raising(*args, **kwargs):
        raise error

    monkeypatch.setattr(rms_norm_module._RMSNormFunction if where == "forward" else rms_norm_module,
                        "apply" if where == "forward" else "rms_norm_backward", raising)
    x, w = _inputs()
    with pytest.raises(type(error)):
        out = F.rms_norm(x.requires_grad_(), w)
        out.sum().backward()
    assert _backend.why_not_triton("rms_norm", x.device) is None


def test_strict_mode_reraises(monkeypatch):
    monkeypatch.setattr(rms_norm_module._RMSNormFunction, "apply", _broken_kernel)
    with pytest.raises(RuntimeError, match="simulated"):
        F.rms_norm(*_inputs())


def test_failing_backward_kernel_uses_reference_gradients(monkeypatch, caplog):
    monkeypatch.delenv("TIGON_STRICT")
    monkeypatch.setattr(rms_norm_module, "rms_norm_backward", _broken_kernel)
    x = torch.randn(4, 33, requires_grad=True)
    r = torch.randn(4, 33, requires_grad=True)
    w = torch.randn(33, requires_grad=True)
    normed, total = F.add_rms_norm(x, r, w)
    grads = torch.randn_like(normed), torch.randn_like(total)
    torch.autograd.backward([normed, total], grads)
    leaves = [t.detach().clone().requires_grad_() for t in (x, r, w)]
    torch.autograd.backward(list(rms_norm_module.add_rms_norm_reference(*leaves)), grads)
    for ours, ref in zip((x, r, w), leaves):
        torch.testing.assert_close(ours.grad, ref.grad)
    assert any("backward kernel failed" in rec.getMessage() for rec in caplog.records)


def test_debug_mode_logs_error_once_per_shape(monkeypatch, caplog):
    monkeypatch.setenv("TIGON_DEBUG", "1")
    x, w = _inputs()
    with caplog.at_level(logging.WARNING, logger="tigon"):
        F.rms_norm(x, w)
        F.rms_norm(x, w)
        F.rms_norm(torch.randn(2, 33), w)
    reports = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tigon debug: rms_norm")]
    assert len(reports) == 2
    assert "max abs err" in reports[0] and "max rel err" in reports[0]


def test_debug_mode_raises_on_nan_the_reference_does_not_have(monkeypatch):
    monkeypatch.setenv("TIGON_DEBUG", "1")
    monkeypatch.setattr(
        rms_norm_module._RMSNormFunction, "apply", lambda x, *a: (torch.full_like(x, float("nan")), None)
    )
    with pytest.raises(FloatingPointError, match="rms_norm kernel produced NaN"):
        F.rms_norm(*_inputs())


def test_why_not_triton_names_old_gpus(monkeypatch):
    monkeypatch.setattr(_backend, "INTERPRET", False)
    monkeypatch.setattr(_backend, "_capability", lambda index: (7, 5))
    reason = _backend.why_not_triton("rms_norm", torch.device("cuda", 0))
    assert reason == "compute capability 7.5 is below 8.0"


def test_torch_compile_traces_the_reference_even_for_symbolic_widths(spy_kernel):
    # dynamic=True makes the width symbolic, as recompiling a frame for a second width does; the
    # kernels' constexpr block sizes cannot be built from it, so the traced path is the reference.
    compiled = torch.compile(lambda x, w: F.rms_norm(x, w), dynamic=True)
    x = torch.randn(3, 5, 24, requires_grad=True)
    w = torch.randn(24, requires_grad=True)
    out = compiled(x, w)
    out.sum().backward()
    assert not spy_kernel
    torch.testing.assert_close(out, rms_norm_reference(x, w))
    ref_x, ref_w = x.detach().requires_grad_(), w.detach().requires_grad_()
    rms_norm_reference(ref_x, ref_w).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
