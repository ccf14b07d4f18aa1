"""A plain ``pip install <repo>`` (no extras) into a new virtual environment runs the
README's commands: ``p3send demo`` (no GPU here: the oracle, exit 0), ``layout`` and
``conform`` (a Mojo and a JSON declaration; a C header where cffi is installed, else one
clear line). About a minute; skips when pip cannot reach a package index."""
from __future__ import annotations

import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.install, pytest.mark.timeout(600)]

MOJO = '''@fieldwise_init
struct P3PeerSendConfig(ImplicitlyCopyable, Movable):
    var atomic_counter: UnsafePointer[Int32, MutAnyOrigin]
    var src_info_ptr: UnsafePointer[Int32, ImmutAnyOrigin]
    var row_base_ptr: UnsafePointer[UInt64, MutAnyOrigin]
    var recv_buf_ptrs: StaticTuple[UnsafePointer[UInt8, MutAnyOrigin], 8]
    var n_ranks: Int
    var p2p_world_size: Int
    var top_k: Int
    var msg_bytes: Int
    var max_tokens_per_rank: Int
    var my_rank: Int
    var send_mbx: UnsafePointer[Int32, MutAnyOrigin]
    var send_stamp_ptr: UnsafePointer[UInt64, MutAnyOrigin]
    var send_stamp_on: Int
    var trace_ptr: UnsafePointer[UInt64, MutAnyOrigin]
    var trace_on: Int
    var send_trace_slot: Int
'''


def run(exe, *args, env=None, timeout=300):
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def plain_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")
    # What a user gets from a clone: the tracked and new (not ignored) files, no build outputs.
    src = root / "src"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True)
    files = listed.stdout.decode().split("\0") if listed.returncode == 0 else \
        [p.relative_to(REPO).as_posix() for p in REPO.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts]
    for f in filter(None, files):
        if (REPO / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, src / f)
    venv.create(root / "venv", with_pip=True)
    py = root / "venv" / "bin" / "python"
    r = run(py, "-m", "pip", "install", "-q", str(src), timeout=600)
    if r.returncode:
        if any(s in r.stderr for s in ("No matching distribution", "Could not find a version",
                                                       "Failed to establish", "Network is unreachable")):
            pytest.skip(f"pip cannot reach a package index: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return root / "venv" / "bin", root, env


def test_plain_install_demo(plain_env):
    bin_, root, env = plain_env
    r = run(bin_ / "p3send", "demo", "--seed", "3", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    if "no usable GPU" in r.stdout:
        assert "SKIPPED: the GPU round" in r.stdout and "pass the demo's own verification" in r.stdout


def test_plain_install_layout_and_conform(plain_env):
    bin_, root, env = plain_env
    r = run(bin_ / "p3send", "layout", "--format", "json", env=env)
    assert r.returncode == 0 and '"recv_buf_ptrs"' in r.stdout, r.stderr
    (root / "cfg.json").write_text(r.stdout)
    (root / "cfg.mojo").write_text(MOJO)
    for f in ("cfg.json", "cfg.mojo"):
        r = run(bin_ / "p3send", "conform", str(root / f), env=env)
        assert r.returncode == 0 and "conforms" in r.stdout, r.stdout + r.stderr
    r = run(bin_ / "p3send", "layout", "--format", "c", env=env)
    (root / "cfg.h").write_text(r.stdout)
    r = run(bin_ / "p3send", "conform", str(root / "cfg.h"), env=env)
    has_cffi = run(bin_ / "python", "-c", "import cffi", env=env).returncode == 0
    if has_cffi:
        assert r.returncode == 0 and "conforms" in r.stdout, r.stdout + r.stderr
    else:   # the C path needs cffi: one clear line, no traceback
        assert r.returncode == 2 and "Traceback" not in r.stderr and "cffi" in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1, r.stderr
