"""The package's layers (README, "What is here"): abi -> cuda -> ops -> torch. Each
imports only the layers before it, and the runtime never imports the oracle or the
commands. Checked on the source, so a new import that crosses a layer fails here."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "p3send"
ORDER = ["abi", "cuda", "ops", "torch"]          # a layer may import the ones before it
NOT_RUNTIME = {"oracle", "cli"}


def layer_of(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def p3send_imports(path: Path, root: Path = PKG) -> set[str]:
    """The p3send sub-packages/modules ``path`` imports (first component below p3send)."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(root)
    here = list(rel.parts[:-1])
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                parts = base + (node.module.split(".") if node.module else [])
                if parts:
                    found.add(parts[0])
                else:                                  # from . import x (top level)
                    found.update(a.name.split(".")[0] for a in node.names)
            elif node.module and node.module.split(".")[0] == "p3send":
                mod = node.module.split(".")
                found.add(mod[1] if len(mod) > 1 else node.names[0].name)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("p3send."))
    return found


RUNTIME = [p for p in sorted(PKG.rglob("*.py")) if layer_of(p) in ORDER]


def test_the_runtime_files_are_found():
    assert {layer_of(p) for p in RUNTIME} == set(ORDER), [str(p) for p in RUNTIME]


@pytest.mark.parametrize("path", RUNTIME, ids=[str(p.relative_to(PKG)) for p in RUNTIME])
def test_a_layer_imports_only_the_layers_before_it(path):
    mine = ORDER.index(layer_of(path))
    allowed = set(ORDER[: mine + 1])
    bad = {m for m in p3send_imports(path) if m not in allowed}
    assert not bad, f"{path.relative_to(PKG)} ({ORDER[mine]}) imports {sorted(bad)}; allowed: {sorted(allowed)}"
    assert not bad & NOT_RUNTIME


def test_abi_needs_only_the_stdlib_and_numpy():
    for path in (PKG / "abi").glob("*.py"):
        tree = ast.parse(path.read_text())
        third = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        third |= {n.module.split(".")[0] for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom) and not n.level and n.module}
        assert not third - set(sys.stdlib_module_names) - {"numpy"}, (path.name, third)


def test_the_checker_sees_a_crossing(tmp_path):
    # the checker itself must be able to fail: a runtime file importing the oracle and a command
    (tmp_path / "ops").mkdir()
    fake = tmp_path / "ops" / "probe.py"
    fake.write_text("from ..oracle.reference import f32_to_bf16\nfrom ..cli import bench\nfrom . import send\n")
    assert p3send_imports(fake, tmp_path) == {"oracle", "cli", "ops"}
