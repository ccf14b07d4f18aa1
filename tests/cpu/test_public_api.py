"""The one public API: ``p3send`` exports every launcher, round, rank, exchange and the
driver seam; importing it touches no CUDA; renamed names warn for one release; every public
class and function documents its arguments."""
from __future__ import annotations

import inspect
import re
import subprocess
import sys
import warnings

import pytest

import p3send


#: What ``import p3send`` must not import: CUDA (cuda-python), torch, the runtime past the ABI
#: (it comes on first use) and the rooms beside the runtime.
NOT_ON_IMPORT = ("cuda", "torch", "p3send.cuda", "p3send.ops", "p3send.torch", "p3send.moe", "p3send.oracle",
                 "p3send.bench", "p3send.conform", "p3send.tracing", "p3send.cli")


def _imported_by(code: str) -> tuple[int, list[str]]:
    """(exit status, the NOT_ON_IMPORT modules in sys.modules) after ``code`` in a fresh interpreter."""
    check = (f"{code}; import sys; bad = sorted(m for m in sys.modules "
             f"if any(m == f or m.startswith(f + '.') for f in {NOT_ON_IMPORT!r})); "
             "print(repr(bad)); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip().startswith("["), r.stdout + r.stderr
    return r.returncode, eval(r.stdout.strip().splitlines()[-1])   # noqa: S307 -- our own repr of a list


def test_import_p3send_touches_no_cuda_and_imports_the_runtime_lazily():
    rc, bad = _imported_by("import p3send")
    assert (rc, bad) == (0, [])


def test_the_import_check_sees_a_planted_import():
    # tracing imports only the abi: what it brings along is exactly itself
    assert _imported_by("import p3send, p3send.tracing") == (1, ["p3send.tracing"])
    rc, bad = _imported_by("import p3send.ops.send")
    assert rc == 1 and {"p3send.ops", "p3send.ops.send", "p3send.cuda"} <= set(bad), bad


@pytest.mark.parametrize("name", p3send.__all__)
def test_every_public_name_resolves(name):
    assert getattr(p3send, name) is not None
    assert name in dir(p3send)


def test_public_names_are_the_defining_modules_objects():
    from p3send.cuda import driver, loader
    from p3send.ops import combine, procs, rank, send
    assert p3send.Combine is combine.Combine and p3send.Rank is rank.Rank and p3send.run_ranks is procs.run_ranks
    assert p3send.ScatterSend is send.ScatterSend and p3send.DeviceBuffer is driver.DeviceBuffer
    assert p3send.load_ptx is loader.load and p3send.link_ptx is loader.link and p3send.driver is driver


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Combin'"):
        p3send.Combin  # noqa: B018


def test_the_version_is_the_package_metadata_version():
    from importlib.metadata import version
    assert p3send.__version__ == version("p3send") == "0.2.0"


# ---------------------------------------------------------------- deprecated aliases (one release)
class _Recorder:
    def __init__(self):
        self.calls = []

    def load(self, world):
        self.calls.append(("load", world))

    def set_inputs(self, r, **kw):
        self.calls.append(("set_inputs", r, kw))


@pytest.mark.parametrize("old, new, call", [
    ("Combine.load_world", "Combine.load", lambda C, o: C.load_world(o, "W")),
    ("Combine.set_rank", "Combine.set_inputs", lambda C, o: C.set_rank(o, 3, c="C")),
])
def test_renamed_methods_warn_and_delegate(old, new, call):
    from p3send.ops.combine import Combine
    o = _Recorder()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        call(Combine, o)
    assert [x.category for x in w] == [DeprecationWarning]
    assert old in str(w[0].message) and new in str(w[0].message)
    assert o.calls and o.calls[0][0] == new.split(".")[1]


@pytest.mark.parametrize("cls_name", ["Combine", "Rank"])
@pytest.mark.parametrize("old, new", [("offs", "expert_offsets"), ("rtab", "range_table")])
def test_renamed_attributes_warn_and_alias(cls_name, old, new):
    cls = getattr(p3send, cls_name)
    obj = cls.__new__(cls)
    setattr(obj, new, ["sentinel"]) if False else obj.__dict__.__setitem__(new, ["sentinel"])
    with pytest.warns(DeprecationWarning, match=new):
        assert getattr(obj, old) is obj.__dict__[new]


# ---------------------------------------------------------------- structured docstrings
def _public_callables():
    out = []
    for name in p3send.__all__:
        obj = getattr(p3send, name)
        if inspect.isclass(obj):
            out.append((name, obj))
            for m, f in vars(obj).items():
                if not m.startswith("_") and (inspect.isfunction(f) or isinstance(f, (classmethod, staticmethod))):
                    out.append((f"{name}.{m}", getattr(obj, m)))
        elif inspect.isfunction(obj):
            out.append((name, obj))
    return out


def _params(f) -> list[str]:
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):
        return []
    return [p for p in sig.parameters if p not in ("self", "cls") and not p.startswith("_")]


def _constructor_doc(cls) -> str:
    """Where a class's constructor arguments may be described: the class's docstring, and the
    docstrings of the ``__init__`` / ``__new__`` it uses and of the class defining it (an
    inherited constructor is described where it is defined)."""
    parts = [inspect.getdoc(cls) or ""]
    for meth in ("__init__", "__new__"):
        definer = next((k for k in cls.__mro__ if meth in vars(k)), None)
        if definer is not None and definer.__module__ != "builtins":
            parts += [inspect.getdoc(definer) or "", inspect.getdoc(vars(definer)[meth]) or ""]
    return "\n".join(parts)


def undescribed(params, doc: str) -> list[str]:
    """The parameters ``doc`` never names as a whole word (``x`` is not named by ``topk_idx``;
    each of ``a, b, c: ...`` is named)."""
    return [p for p in params if not re.search(rf"(?<![A-Za-z0-9_]){re.escape(p)}(?![A-Za-z0-9_])", doc)]


def test_the_word_check_is_not_a_substring_check():
    doc = "Args:\n    topk_idx: int32 (T, k).\n    a, b, c: the sizes.\n    max_tokens (int): rows."
    assert undescribed(["x", "topk_idx", "a", "b", "c", "max_tokens", "tokens", "idx"], doc) == ["x", "tokens", "idx"]


def test_a_constructor_is_described_where_it_is_defined():
    class Base:
        """Takes ``alpha``."""

        def __init__(self, alpha, beta):
            """beta: documented on __init__."""

    class Child(Base):
        """Says nothing of them."""

    class Other:
        """Mentions nothing."""

        def __init__(self, gamma):
            pass

    assert undescribed(_params(Child), _constructor_doc(Child)) == []
    assert undescribed(_params(Other), _constructor_doc(Other)) == ["gamma"]


@pytest.mark.parametrize("name, obj", _public_callables(), ids=[n for n, _ in _public_callables()])
def test_every_public_class_and_function_documents_itself(name, obj):
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"{name}: no docstring"
    if "Deprecated alias" in doc:
        return
    if inspect.isclass(obj):
        doc = _constructor_doc(obj)
    missing = undescribed(_params(obj), doc)
    assert not missing, f"{name}: the docstring does not describe {missing}"
