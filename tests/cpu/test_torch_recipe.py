"""The torch recipe of docs/EMBEDDING.md at the CPU tier: its code parses, every p3send
name it imports exists, ``p3send.torch`` says clearly that it needs torch where torch is
absent, and ``import p3send`` never imports torch. (tests/gpu/test_torch.py runs the
same calls on a GPU.)"""
from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "EMBEDDING.md"


def recipe() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    found = [b for b in blocks if "from p3send.torch import" in b]
    if not found:
        pytest.skip("docs/EMBEDDING.md has no torch recipe yet (a python block importing p3send.torch)")
    return found[0]


def test_import_p3send_does_not_import_torch():
    code = "import sys, p3send, p3send.ops.combine, p3send.ops.rank, p3send.cuda.gate; " \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_the_recipe_parses_and_its_p3send_imports_resolve():
    tree = ast.parse(recipe())
    names = [(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
             and (n.module or "").startswith("p3send") for a in n.names]
    assert ("p3send.torch", "TorchCombine") in names, names
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    for module, name in names:
        if module == "p3send.torch" and not have_torch:
            with pytest.raises(ImportError, match="p3send.torch needs torch"):
                importlib.import_module(module)
            continue
        assert hasattr(importlib.import_module(module), name), f"{module} has no {name}"
