"""The scripts in ``scripts/`` use tigon's public names only: a private name they reach into can
change or go with no caller in ``src/`` or ``tests/`` noticing. The GPU-only ones refuse a machine
without a GPU in one line."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _private(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def private_uses(source: str) -> list[str]:
    """Each import of, or attribute access to, a private tigon name in `source`, as a readable line."""
    tree = ast.parse(source)
    tigon_names: set[str] = set()  # the names an import binds to something of tigon's
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tigon":
                    tigon_names.add(alias.asname or "tigon")
                    if _private(alias.name):
                        found.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tigon":
            for alias in node.names:
                tigon_names.add(alias.asname or alias.name)
                if _private(f"{node.module}.{alias.name}"):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in tigon_names:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_script_uses_a_private_tigon_name():
    bad = [f"scripts/{path.name}: {use}" for path in sorted(SCRIPTS.glob("*.py"))
           for use in private_uses(path.read_text())]
    assert not bad, "private tigon names used by scripts:\n" + "\n".join(bad)


def test_private_imports_and_attributes_are_found():
    source = (
        "import torch\nfrom tigon.ops import _checks, rope\nimport tigon.bench.harness as harness\n"
        "rope._launch(1)\nharness.fwd_bwd_step\ntorch.cuda._sleep(1)\n"
    )
    assert private_uses(source) == ["line 2: from tigon.ops import _checks", "line 4: rope._launch"]


@pytest.mark.parametrize("script,args", [("fp8_transpose_bench.py", []), ("low_rank_bench.py", []),
                                         ("profile_e2e.py", ["lora-fp8", "--host"])])
def test_gpu_scripts_refuse_without_a_gpu_in_one_line(script, args):
    """Run as a user would on a machine without a CUDA GPU: one line naming the need, a non-zero
    exit, no traceback."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible here")
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS.parent / "src")}
    done = subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode != 0
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert lines == [f"{script}: needs a CUDA GPU (none is visible here)"], lines
