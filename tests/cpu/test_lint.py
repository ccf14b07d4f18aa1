"""ruff over the package, the tests and the tools (configured in pyproject.toml)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _ruff():
    exe = shutil.which("ruff") or (Path(sys.executable).parent / "ruff")
    return str(exe) if Path(str(exe)).exists() else None


@pytest.mark.skipif(_ruff() is None, reason="ruff is not installed (pip install -e '.[test]')")
def test_ruff_clean():
    r = subprocess.run([_ruff(), "check", "--no-cache", "p3send", "tests", "tools"], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
