"""The one public API: ``p3send`` exports every launcher, round, rank, exchange and the
driver seam; importing it touches no CUDA; renamed names warn for one release; every public
class and function documents its arguments."""
from __future__ import annotations

import inspect
import subprocess
import sys
import warnings

import pytest

import p3send


def test_import_p3send_touches_no_cuda_and_imports_the_runtime_lazily():
    code = ("import sys, p3send; "
            "bad = sorted(m for m in sys.modules if m.startswith(('cuda', 'p3send.ops', 'p3send.cuda', 'torch'))); "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


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


@pytest.mark.parametrize("name, obj", _public_callables(), ids=[n for n, _ in _public_callables()])
def test_every_public_class_and_function_documents_itself(name, obj):
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"{name}: no docstring"
    if inspect.isclass(obj) or name.rsplit(".", 1)[-1] in ("close",):
        return
    if "Deprecated alias" in doc:
        return
    missing = [p for p in _params(obj) if p not in doc]
    assert not missing, f"{name}: the docstring does not describe {missing}"
