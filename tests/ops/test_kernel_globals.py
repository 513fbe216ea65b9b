"""Every @triton.jit function in tigon.ops reads only the module-level names Triton's compiler
accepts. The interpreter (the CPU tests) reads any Python global, so a kernel using a plain int
constant passes there and fails to compile on the GPU ("Cannot access global variable ... from
within @jit'ed function"); this reads the kernels' source instead of running them."""

import ast
import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest

import tigon.ops
from tigon.ops._launch import PreboundKernel

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

# What wraps a kernel's Python function: Triton's JITFunction / InterpretedFunction (and any
# autotuner or heuristics around them), and tigon's launcher for compiled kernels (@launched).
WRAPPERS = (triton.runtime.KernelInterface, PreboundKernel)
# The builtins triton.compiler.code_generator resolves (CodeGenerator.builtin_namespace); any
# other Python builtin is a NameError in compiled code.
TRITON_BUILTINS = {"len", "list", "range", "float", "int", "isinstance", "getattr", "hasattr", "print", "min", "max"}


def _jit_functions():
    """(qualified name, Python function) of every jit function defined in a tigon.ops module."""
    found = []
    for info in pkgutil.walk_packages(tigon.ops.__path__, "tigon.ops."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            fn = obj
            while isinstance(fn, WRAPPERS):
                fn = fn.fn
            if fn is not obj and getattr(fn, "__module__", None) == module.__name__:
                found.append((f"{module.__name__}.{name}", fn))
    return found


def _global_names(fn) -> set[str]:
    """Names the function's body reads that are neither its arguments nor its locals."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    names = {node.id for stmt in tree.body for node in ast.walk(stmt) if isinstance(node, ast.Name)}
    return names - set(fn.__code__.co_varnames)


def _allowed(fn, name: str) -> bool:
    """Whether compiled code may read the global `name` of `fn`: the rule of Triton's code
    generator (CodeGenerator's global lookup), less the opt-out environment variable. A kernel
    wrapped by @launched is no JITFunction there: only the host may launch one."""
    if name not in fn.__globals__:
        return name in TRITON_BUILTINS
    value = fn.__globals__[name]
    return (isinstance(value, (types.ModuleType, triton.runtime.KernelInterface, tl.constexpr, tl.dtype))
            or getattr(value, "__triton_builtin__", False)
            or str(getattr(value, "__module__", "")).startswith("triton.language"))


def test_jit_functions_read_only_constexpr_globals():
    functions = _jit_functions()
    # The walk found the kernels (a broken walk would make this test pass for nothing).
    assert {"tigon.ops.moe._gmm_rows_kernel", "tigon.ops.rms_norm._rms_norm_fwd_kernel",
            "tigon.ops.glu.activate"} <= {name for name, _ in functions}
    bad = sorted(f"{qualname} reads {name}" for qualname, fn in functions for name in _global_names(fn)
                 if not _allowed(fn, name))
    assert not bad, ("module-level names a compiled kernel cannot read (make them tl.constexpr, pass them "
                     f"as constexpr arguments, or use literals): {bad}")


def test_the_check_refuses_plain_globals_and_other_builtins():
    names = {"PLAIN": 1, "NAME": "gate_up", "CONSTEXPR": tl.constexpr(1), "tl": tl, "rsqrt": tl.rsqrt,
             "F32": tl.float32}
    fake = types.FunctionType((lambda: None).__code__, names)
    refused = [n for n in (*names, "range", "abs") if not _allowed(fake, n)]
    assert refused == ["PLAIN", "NAME", "abs"]
