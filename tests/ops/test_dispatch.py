"""Dispatch rules: Triton where it can run, the reference otherwise, loudly; switches and debug."""

import ast
import importlib
import inspect
import logging
import pkgutil

import pytest
import torch

import tigon.functional as F
from tigon import ops
from tigon.ops import _dispatch
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


def _messages(caplog, part):
    return [r.getMessage() for r in caplog.records if part in r.getMessage()]


def test_interpreter_runs_the_kernel(spy_kernel):
    assert ops.INTERPRET, "the suite runs with TRITON_INTERPRET=1"
    F.rms_norm(*_inputs())
    assert len(spy_kernel) == 1


def test_cpu_without_interpreter_falls_back_with_one_line_for_every_op(monkeypatch, caplog, spy_kernel):
    monkeypatch.setattr(_dispatch, "INTERPRET", False)
    x, w = _inputs()
    with caplog.at_level(logging.WARNING, logger="tigon"):
        out = F.rms_norm(x, w)
        F.rms_norm(x, w)
        F.swiglu(x, x)
        F.layer_norm(x, w, None)
    assert not spy_kernel
    torch.testing.assert_close(out, rms_norm_reference(x, w))
    lines = _messages(caplog, "PyTorch reference")
    with_kernels = [op for op in ops.op_names() if ops.placement(op, x.device)[0] == "reference"]
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"tigon: {', '.join(with_kernels[:3])} and {len(with_kernels) - 3} more run their PyTorch references: "
    )
    assert "tensors are on cpu" in lines[0]
    # Ops of torch calls only run their own code on any device.
    assert ops.placement("linear_group", x.device) == ("torch", None)
    assert ops.placement("rms_norm", x.device)[0] == "reference"


def test_op_specific_reasons_are_said_once_per_reason(caplog):
    x, w = _inputs()
    with caplog.at_level(logging.WARNING, logger="tigon"):
        for _ in range(2):
            F.rms_norm(x.double(), w.double())
            F.swiglu(x.double(), x.double())
    lines = _messages(caplog, "PyTorch reference")
    assert lines == ["tigon: rms_norm runs its PyTorch reference: weight dtype torch.float64 runs on the reference",
                     "tigon: swiglu runs its PyTorch reference: torch.float64 runs on the reference"]


@pytest.mark.parametrize("value", ["rms_norm", "layer_norm, rms_norm", "all"])
def test_tigon_disable_forces_reference(monkeypatch, spy_kernel, caplog, value):
    monkeypatch.setenv("TIGON_DISABLE", value)
    with caplog.at_level(logging.WARNING, logger="tigon"):
        F.rms_norm(*_inputs())
        F.layer_norm(*_inputs(), None)
    assert not spy_kernel
    assert ops.why_not_triton("rms_norm", torch.device("cpu")) == "disabled by TIGON_DISABLE"
    lines = _messages(caplog, "disabled by TIGON_DISABLE")
    said = {
        "rms_norm": "rms_norm runs its PyTorch reference",
        "layer_norm, rms_norm": "rms_norm and layer_norm run their PyTorch references",
        "all": f"rms_norm, add_rms_norm, layer_norm and {len(ops.op_names()) - 3} more run their PyTorch references",
    }
    assert lines == [f"tigon: {said[value]}: disabled by TIGON_DISABLE"]


def test_tigon_disable_of_other_op_keeps_kernel(monkeypatch, spy_kernel):
    monkeypatch.setenv("TIGON_DISABLE", "layer_norm")
    F.rms_norm(*_inputs())
    assert len(spy_kernel) == 1


@pytest.mark.parametrize("value", ["qkv_group", "rms_norm,rmsnorm"])
def test_tigon_disable_rejects_names_that_are_no_op(monkeypatch, value):
    monkeypatch.setenv("TIGON_DISABLE", value)
    with pytest.raises(ValueError, match=r"TIGON_DISABLE names '(qkv_group|rmsnorm)', which is no op") as err:
        F.rms_norm(*_inputs())
    message = str(err.value)
    assert all(name in message for name in ops.op_names()) and "--kernels-off" in message and "tigon.patch" in message


def test_tigon_disable_is_parsed_once_per_value(monkeypatch):
    monkeypatch.setenv("TIGON_DISABLE", "rope")
    F.rms_norm(*_inputs())
    misses = _dispatch._disabled_names.cache_info().misses
    for _ in range(3):
        F.rms_norm(*_inputs())
    assert _dispatch._disabled_names.cache_info().misses == misses


def test_switches_follow_the_environment_call_by_call(monkeypatch, spy_kernel):
    """The fast read of TIGON_* sees every change made through os.environ, unset included."""
    assert _dispatch._FAST_ENVIRON, "CPython's os.environ keeps its values in a dict, _data"
    monkeypatch.delenv("TIGON_DISABLE", raising=False)
    assert _dispatch._disable_value() is None
    F.rms_norm(*_inputs())
    monkeypatch.setenv("TIGON_DISABLE", "rms_norm")
    assert _dispatch._text(_dispatch._disable_value()) == "rms_norm"
    F.rms_norm(*_inputs())
    monkeypatch.delenv("TIGON_DISABLE")
    F.rms_norm(*_inputs())
    assert len(spy_kernel) == 2
    monkeypatch.setenv("TIGON_DEBUG", "yes")
    assert _dispatch._flag(_dispatch._debug_value())
    monkeypatch.setenv("TIGON_DEBUG", "off")
    assert not _dispatch._flag(_dispatch._debug_value())


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
    assert len(_messages(caplog, "rms_norm")) == 1
    assert "simulated compile failure" in ops.why_not_triton("rms_norm", x.device)


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
    assert ops.why_not_triton("rms_norm", x.device) is None


def test_strict_mode_reraises(monkeypatch):
    monkeypatch.setattr(rms_norm_module._RMSNormFunction, "apply", _broken_kernel)
    with pytest.raises(RuntimeError, match="simulated"):
        F.rms_norm(*_inputs())


def test_debug_mode_logs_error_once_per_shape(monkeypatch, caplog):
    monkeypatch.setenv("TIGON_DEBUG", "1")
    x, w = _inputs()
    with caplog.at_level(logging.WARNING, logger="tigon"):
        F.rms_norm(x, w)
        F.rms_norm(x, w)
        F.rms_norm(torch.randn(2, 33), w)
    reports = _messages(caplog, "tigon debug: rms_norm output")
    assert len(reports) == 2
    assert "max abs err" in reports[0] and "max rel err" in reports[0]


def test_debug_mode_raises_on_nan_the_reference_does_not_have(monkeypatch):
    monkeypatch.setenv("TIGON_DEBUG", "1")
    monkeypatch.setattr(
        rms_norm_module._RMSNormFunction, "apply", lambda x, *a: (torch.full_like(x, float("nan")), None)
    )
    with pytest.raises(FloatingPointError, match="rms_norm kernel produced NaN"):
        F.rms_norm(*_inputs())


def test_debug_mode_raises_on_a_finite_number_where_the_reference_gives_nan(monkeypatch):
    # The silent wrong number: a NaN in a row that the kernel reduced to a finite value.
    monkeypatch.setenv("TIGON_DEBUG", "1")
    monkeypatch.setattr(rms_norm_module._RMSNormFunction, "apply", lambda x, *a: (torch.zeros_like(x), None))
    x, w = _inputs()
    x[1, 3] = float("nan")
    with pytest.raises(FloatingPointError, match="rms_norm kernel produced a finite number where the reference gives NaN/inf"):
        F.rms_norm(x, w)


def test_debug_mode_names_an_input_holding_nan_once_per_op(monkeypatch, caplog):
    monkeypatch.setenv("TIGON_DEBUG", "1")
    x, w = _inputs()
    w[5] = float("inf")
    gate, up = torch.randn(3, 5), torch.randn(3, 5)
    up[0, 0] = float("nan")
    with caplog.at_level(logging.WARNING, logger="tigon"):
        for _ in range(2):
            F.rms_norm(x, w)
            F.swiglu(gate, up)
        F.rms_norm(x, torch.randn(33))
    assert _messages(caplog, "holds NaN/inf") == [
        "tigon debug: rms_norm: argument weight holds NaN/inf", "tigon debug: swiglu: argument up holds NaN/inf",
    ]


def test_why_not_triton_names_old_gpus(monkeypatch):
    monkeypatch.setattr(_dispatch, "INTERPRET", False)
    monkeypatch.setattr(_dispatch, "_capability", lambda index: (7, 5))
    reason = ops.why_not_triton("rms_norm", torch.device("cuda", 0))
    assert reason == "compute capability 7.5 is below 8.0"
    assert ops.why_not_triton("linear_group", torch.device("cuda", 0)) is None


def test_unknown_op_name_is_a_value_error():
    with pytest.raises(ValueError, match="op must be one of rms_norm, add_rms_norm"):
        ops.why_not_triton("rmsnorm", torch.device("cpu"))


def _op_imports(module: str) -> list[tuple[str, list[str]]]:
    """(module below tigon.ops, names) of each ``from tigon.ops.<module> import ...`` in a module of
    tigon.ops."""
    tree = ast.parse(inspect.getsource(importlib.import_module(f"tigon.ops.{module}")))
    return [(node.module.removeprefix("tigon.ops."), [alias.name for alias in node.names])
            for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tigon.ops.")]


def test_op_modules_import_only_public_names_of_the_ops_above_them():
    table = list(ops.OP_MODULES)
    private = [info.name for info in pkgutil.iter_modules(ops.__path__) if info.name.startswith("_")]
    assert "_chunked_head" in private and "_dispatch" in private
    for module in private:  # the shared floor (dispatch, checks, launch shapes, the chunked head) imports no op
        assert all(imported.startswith("_") for imported, _ in _op_imports(module)), module
    for index, module in enumerate(table):
        for imported, names in _op_imports(module):
            assert not [name for name in names if name.startswith("_")], f"{module} imports {names} from {imported}"
            assert imported.startswith("_") or imported in table[:index], f"{module} imports {imported}, not above it"


def test_the_op_table_is_the_dispatch_order_and_tigon_functional():
    assert F.__all__ == [name for names in ops.OP_MODULES.values() for name in names]
    assert F.rms_norm is rms_norm_module.rms_norm and F.linear_distill_loss is ops.FUNCTIONS["linear_distill_loss"]
    assert ops.op_names()[:4] == ("rms_norm", "add_rms_norm", "layer_norm", "rope")
    assert ops.op_names()[-1] == "moe_experts"
