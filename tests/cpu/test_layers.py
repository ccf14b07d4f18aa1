"""The package's layers (README, "What is here"): abi -> cuda -> ops -> torch. Each
imports only the layers before it, and the runtime never imports the oracle or the
commands; p3send/__init__.py imports only abi (the rest of the runtime by name, on first
use), __main__.py only cli; only cuda/driver.py imports ``cuda.bindings``. Checked on the
source, so a new import that crosses a layer fails here."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "p3send"
ORDER = ["abi", "cuda", "ops", "torch", "moe"]   # a layer may import the ones before it
NOT_RUNTIME = {"oracle", "cli", "conform", "bench", "tracing"}


def layer_of(path: Path, root: Path = PKG) -> str:
    rel = path.relative_to(root)
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


# ---------------------------------------------------------------- beside the runtime
#: What each non-runtime room may import (of p3send's own rooms); the runtime never imports them.
BESIDE = {"oracle": set(ORDER), "conform": {"abi"}, "tracing": {"abi"}, "bench": set(ORDER) | {"oracle"},
          "cli": None}   # None: anything


@pytest.mark.parametrize("room", sorted(BESIDE))
def test_a_room_beside_the_runtime_imports_only_what_it_may(room):
    allowed = BESIDE[room]
    paths = [p for p in sorted(PKG.rglob("*.py")) if layer_of(p) == room]
    if not paths:
        pytest.skip(f"p3send has no {room} room (yet)")
    for path in paths:
        bad = p3send_imports(path) - {room} - (allowed if allowed is not None else p3send_imports(path))
        assert not bad, f"{path.relative_to(PKG)} ({room}) imports {sorted(bad)}; allowed: {sorted(allowed)}"


# ---------------------------------------------------------------- the module graph
def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["p3send", *parts])


def module_graph(root: Path = PKG) -> dict[str, set[str]]:
    """Every p3send module -> the p3send modules it imports, anywhere in its body (function-local
    imports included: a circle they hide still fails at some call)."""
    mods = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        pkg = name if is_pkg else name.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + (node.module.split(".") if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("p3send"):
                    continue
                for a in node.names:          # `from pkg import module` names a module
                    sub = f"{target}.{a.name}"
                    deps.add(sub if sub in mods else target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("p3send"))
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    circles = import_circles(module_graph())
    assert not circles, f"import circles (function-local imports included): {circles}"


def test_the_circle_finder_sees_a_circle(tmp_path):
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "__init__.py").write_text("")
    (tmp_path / "cli" / "app.py").write_text("def f():\n    from .bench import g\n")
    (tmp_path / "cli" / "bench.py").write_text("from . import app\n")
    assert import_circles(module_graph(tmp_path)) == [["p3send.cli.app", "p3send.cli.bench"]]


# ---------------------------------------------------------------- private names stay home
def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("_")


def _defined_here(tree: ast.AST) -> set[str]:
    """Names a module defines or assigns as attributes (``def _x``, ``_x = ...``, ``self._x = ...``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


def private_crossings(path: Path, root: Path = PKG) -> list[str]:
    """Uses in ``path`` of another module's private names: ``from m import _x``, ``mod._x`` of an
    imported p3send module, and ``self.a._x`` (a private attribute of another object) unless
    this module defines ``_x`` itself."""
    tree = ast.parse(path.read_text())
    mine = _defined_here(tree)
    modules = set()           # local names bound to p3send modules
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("p3send")):
            for a in node.names:
                if _private(a.name):
                    found.append(f"line {node.lineno}: from {'.' * node.level}{node.module or ''} import {a.name}")
                modules.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            modules.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("p3send"))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        v = node.value
        if isinstance(v, ast.Name) and v.id in modules:
            found.append(f"line {node.lineno}: {v.id}.{node.attr}")
        elif isinstance(v, ast.Attribute) and node.attr not in mine:
            root_name = v
            while isinstance(root_name, (ast.Attribute, ast.Subscript)):
                root_name = root_name.value
            if isinstance(root_name, ast.Name) and root_name.id in ("self", "cls"):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


ALL_MODULES = sorted(PKG.rglob("*.py"))


@pytest.mark.parametrize("path", ALL_MODULES, ids=[str(p.relative_to(PKG)) for p in ALL_MODULES])
def test_no_private_name_crosses_a_module(path):
    found = private_crossings(path)
    assert not found, f"{path.relative_to(PKG)} uses another module's private names: {found}"


def test_the_private_name_checker_sees_a_crossing(tmp_path):
    (tmp_path / "ops").mkdir()
    probe = tmp_path / "ops" / "probe.py"
    probe.write_text("from .send import _send_args\nfrom ..cuda import driver\n\n"
                     "class T:\n    def f(self):\n        driver._cu()\n        self._inner._enqueue_send()\n"
                     "        self._mine()\n\n    def _mine(self):\n        pass\n")
    found = private_crossings(probe, tmp_path)
    assert [f.split(": ", 1)[1] for f in found] == ["from .send import _send_args", "driver._cu",
                                                   "self._inner._enqueue_send()"[:-2]]


# ---------------------------------------------------------------- the package's own two modules
def stdlib_and_rooms(path: Path, root: Path = PKG) -> tuple[set[str], set[str]]:
    """(the non-stdlib top-level modules ``path`` imports absolutely, the p3send rooms it imports),
    from import statements anywhere in its body."""
    third = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            third |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            third.add(node.module.split(".")[0])
    return third - set(sys.stdlib_module_names) - {"__future__", "p3send"}, p3send_imports(path, root)


def lazy_modules(path: Path) -> dict[str, object]:
    """The ``_LAZY`` dict of ``path``'s module body, name -> the module string it is imported from
    on first use (a value that is not a string constant is kept as its source text)."""
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in targets):
            assert isinstance(node.value, ast.Dict), f"{path.name}: _LAZY is not a dict display"
            return {ast.unparse(k) if not isinstance(k, ast.Constant) else k.value:
                    v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else ast.unparse(v)
                    for k, v in zip(node.value.keys, node.value.values)}
    return {}


def lazy_problems(path: Path, root: Path = PKG) -> list[str]:
    """What is wrong with ``path``'s ``_LAZY`` targets: each must be a string naming an existing
    module of a runtime layer (``ORDER``), never the oracle, the commands or the other rooms."""
    out = []
    for name, target in lazy_modules(path).items():
        parts = target.split(".") if isinstance(target, str) else []
        if len(parts) < 2 or parts[0] != "p3send":
            out.append(f"{name}: {target!r} is not a p3send module name")
            continue
        if parts[1] not in ORDER:
            out.append(f"{name}: {target} is not in a runtime layer {ORDER}")
        if not (root.joinpath(*parts[1:]).with_suffix(".py").is_file()
                or (root.joinpath(*parts[1:]) / "__init__.py").is_file()):
            out.append(f"{name}: {target} is no module of the package")
    return out


def test_init_imports_only_the_abi_at_import_time():
    # the rest of the runtime comes through _LAZY on first use: import p3send touches no CUDA
    third, rooms = stdlib_and_rooms(PKG / "__init__.py")
    assert not third, f"p3send/__init__.py imports {sorted(third)}"
    assert rooms <= {"abi"}, f"p3send/__init__.py imports {sorted(rooms)} at import time; only abi may be"


def test_init_lazy_names_come_only_from_runtime_modules():
    lazy = lazy_modules(PKG / "__init__.py")
    assert len(lazy) > 20, "p3send/__init__.py's _LAZY was not found"
    assert not lazy_problems(PKG / "__init__.py")


def test_main_imports_only_the_commands():
    third, rooms = stdlib_and_rooms(PKG / "__main__.py")
    assert not third and rooms == {"cli"}, (third, rooms)


def test_the_init_checkers_see_a_planted_violation(tmp_path):
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "send.py").write_text("")
    probe = tmp_path / "__init__.py"
    probe.write_text("import importlib\nimport numpy\nfrom .abi import config\nfrom .oracle import cases\n\n"
                     "def f():\n    from .cli import app\n\n"
                     "MOD = 'p3send.ops.send'\n"
                     "_LAZY = {'ScatterSend': 'p3send.ops.send', 'Case': 'p3send.oracle.cases',\n"
                     "         'Gone': 'p3send.ops.nosuch', 'Other': 'numpy', 'Var': MOD}\n")
    assert stdlib_and_rooms(probe, tmp_path) == ({"numpy"}, {"abi", "oracle", "cli"})
    assert lazy_problems(probe, tmp_path) == [
        f"Case: p3send.oracle.cases is not in a runtime layer {ORDER}",
        "Case: p3send.oracle.cases is no module of the package",
        "Gone: p3send.ops.nosuch is no module of the package",
        "Other: 'numpy' is not a p3send module name",
        "Var: 'MOD' is not a p3send module name"]


def unchecked_modules(root: Path = PKG) -> list[str]:
    """Modules in no layer or room these tests check (a new top-level module must join one)."""
    known = set(ORDER) | set(BESIDE) | {"__init__", "__main__"}
    return [str(p.relative_to(root)) for p in sorted(root.rglob("*.py")) if layer_of(p, root) not in known]


def test_every_module_is_in_a_checked_layer_or_room():
    assert not unchecked_modules()


def test_the_unchecked_module_finder_sees_one(tmp_path):
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "send.py").write_text("")
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "helpers.py").write_text("")
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "x.py").write_text("")
    assert unchecked_modules(tmp_path) == ["extra/x.py", "helpers.py"]


# ---------------------------------------------------------------- the one seam to cuda-python
#: The modules that may import NVIDIA's ``cuda`` namespace package, and what of it. driver.py is
#: the one module that calls ``cuda.bindings`` (driver, nvrtc, nvjitlink), the seam CPU tests swap.
#: gate.py may import ``cuda.pathfinder`` only: it finds the file libcudadevrt.a on disk (to link
#: the gate kernel through driver.py) and calls no CUDA API; kept to that module and that package
#: so any other use of cuda-python shows here.
CUDA_PYTHON = {"cuda/driver.py": ("cuda.bindings",), "cuda/gate.py": ("cuda.pathfinder",)}


def cuda_python_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of NVIDIA's ``cuda`` package in ``path``, anywhere in its
    body: ``import cuda.x``, ``from cuda.x import y``, ``from cuda import x`` and a constant name
    given to ``importlib.import_module`` / ``__import__`` (``from ..cuda import`` is p3send's)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [f"{node.module}.{a.name}" if node.module == "cuda" else node.module for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if fname in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [(node.lineno, n) for n in names if n == "cuda" or n.startswith("cuda.")]
    return found


def cuda_python_crossings(root: Path = PKG) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        allowed = CUDA_PYTHON.get(rel, ())
        out += [f"{rel}:{line}: {name}" for line, name in cuda_python_imports(path)
                if not any(name == a or name.startswith(a + ".") for a in allowed)]
    return out


def test_only_driver_imports_cuda_bindings():
    assert not cuda_python_crossings()
    assert [n for _, n in cuda_python_imports(PKG / "cuda" / "driver.py")], "driver.py's imports were not found"


def test_the_cuda_python_checker_sees_a_crossing(tmp_path):
    (tmp_path / "ops").mkdir()
    (tmp_path / "cuda").mkdir()
    (tmp_path / "ops" / "probe.py").write_text(
        "import importlib\nfrom ..cuda import driver\nfrom p3send.cuda import loader\n\n"
        "def f():\n    from cuda.bindings import driver as cu\n    import cuda.bindings.nvrtc\n"
        "    from cuda import pathfinder\n    return importlib.import_module('cuda.bindings.nvjitlink')\n")
    (tmp_path / "cuda" / "driver.py").write_text("def f():\n    from cuda.bindings import driver\n"
                                                 "    from cuda.pathfinder import find_static_lib\n")
    (tmp_path / "cuda" / "gate.py").write_text("from cuda.pathfinder import find_static_lib\n"
                                               "x = __import__('cuda.bindings.driver')\n")
    assert cuda_python_crossings(tmp_path) == [
        "cuda/driver.py:3: cuda.pathfinder", "cuda/gate.py:2: cuda.bindings.driver",
        "ops/probe.py:6: cuda.bindings", "ops/probe.py:7: cuda.bindings.nvrtc",
        "ops/probe.py:8: cuda.pathfinder", "ops/probe.py:9: cuda.bindings.nvjitlink"]
