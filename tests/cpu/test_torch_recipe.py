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
        if module in ("p3send.torch", "p3send.moe") and not have_torch:
            with pytest.raises(ImportError, match=f"{module} needs torch"):
                importlib.import_module(module)
            continue
        assert hasattr(importlib.import_module(module), name), f"{module} has no {name}"


#: Where the Python blocks of docs/EMBEDDING.md may import from: the public API, the torch
#: adapter, and the oracle's generators for test data (a runtime has its own routing).
PUBLIC_MODULES = {"p3send", "p3send.torch", "p3send.moe", "p3send.oracle.cases"}


def test_every_python_block_of_the_embedding_guide_uses_only_the_public_api():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    assert blocks
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            mods = ([node.module] if isinstance(node, ast.ImportFrom) else
                    [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for m in mods:
                if (m or "").startswith("p3send"):
                    assert m in PUBLIC_MODULES, f"docs/EMBEDDING.md imports {m}; the public API is {PUBLIC_MODULES}"
        for name in re.findall(r"\bp3send\.([A-Za-z_]\w*)", block):
            assert name in ("torch", "moe", "oracle") or hasattr(__import__("p3send"), name), f"p3send has no {name}"
