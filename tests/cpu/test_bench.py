"""The benchmark library (p3send/bench) on a machine without a GPU: it imports without CUDA,
torch or Triton; its registry is what ``--only`` offers; ``p3send bench`` exits 0 with its
message (no GPU) or 2 with one line (bad input); the CUDA C++ baselines ship as package data
(also in a built wheel) and compile for sm_90 (nvcc, and NVRTC where installed); the table
renders from a recorded results file; the bench imports only the runtime and the oracle."""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from p3send.bench import baselines, registry, report

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "p3send" / "bench"
RESULTS = Path(__file__).parent / "data" / "bench_results.json"
MODULES = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__")


def test_the_bench_imports_without_cuda_torch_or_triton():
    # every module, and the command's parser, with cuda.bindings, torch and triton unimportable
    code = f"""
import importlib, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton") or name.startswith("cuda.bindings"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
for m in {["p3send.bench." + m for m in MODULES if m != "baselines_triton"]!r}:
    importlib.import_module(m)
from p3send.cli import app
app.build_parser().parse_args(["bench", "--only", "prefill"])
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton", "cuda")))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_sections_are_the_registry_and_the_only_choices():
    names = [s.name for s in registry.REGISTRY]
    assert registry.SECTIONS == tuple(names) and len(set(names)) == len(names)
    # the sections of this version (others join them with one registry line each)
    assert {"prefill", "decode_send", "budget", "decode", "latency", "host", "epilogue", "two_gpu",
            "gemm"} <= set(names)
    for s in registry.REGISTRY:
        assert callable(s.run) and callable(s.table), s
        assert s.table({}) == "", f"{s.name}: a table part must be empty when its results are absent"
    import argparse

    from p3send.cli import bench
    p = argparse.ArgumentParser(prog="bench")
    bench.add_arguments(p)
    assert "[--only {" + ",".join(registry.SECTIONS) + "}]" in " ".join(p.format_usage().split())
    for name in registry.SECTIONS:
        assert p.parse_args(["--only", name]).only == [name]


def test_run_refuses_an_unknown_section_before_any_gpu_work():
    from p3send.abi.errors import ConfigError
    with pytest.raises(ConfigError, match="only: expected sections of .*got \\['nope'\\]"):
        registry.run(object(), only=["prefill", "nope"])


def test_bench_without_a_gpu_exits_0_with_its_message(cli, tmp_path):
    from p3send.cuda import driver
    if driver.available()[0]:
        pytest.skip("a GPU is present: the bench would measure")
    rc, out = cli("bench", "--json", tmp_path / "b.json")
    assert rc == 0, out
    assert out.startswith("p3send bench: no usable GPU here (") and out.rstrip().endswith("nothing to measure.")
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize("args, wanted", [
    (["--ranks", "0"], "--ranks: expected 1..8, got 0"),
    (["--iters", "0"], "--iters: expected >= 1, got 0"),
    (["--decode-tokens", "0"], "--decode-tokens: expected >= 1, got 0"),
    (["--gemm-k", "100"], "--gemm-k: expected a positive multiple of 64, got 100"),
])
def test_bench_with_a_bad_argument_exits_2_with_one_line(args, wanted, capsys, tmp_path):
    from p3send import cli
    assert cli.main(["bench", *args, "--json", str(tmp_path / "b.json")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"p3send bench: error: {wanted}"), err


def test_the_table_renders_from_recorded_results():
    out = json.loads(RESULTS.read_text())
    text = report.render(out)
    assert text.startswith("p3send bench on NVIDIA H200 (132 SMs), 2026-12-01 18:42:16")
    for title in ("\n1. prefill send: 32768 rows", "\n1b. one rank's decode-size send: 1024 rows", "\n2. SM budget",
                  "\n3. decode round (graph replay): 114.9 us, copy floor 87.7 us -> 1.31x",
                  "\n4. signal latency", "\n5. host: 4.62 us per launch", "\n6. in-epilogue send",
                  "\n7. two GPUs over the peer link", "\n8. grouped GEMM + send, prefill",
                  "\n8. grouped GEMM + send, decode"):
        assert title in text, title
    assert text.index("\n1b.") < text.index("\n2.") < text.index("\n3.") < text.index("\n7.") < text.index("\n8.")
    assert "best baseline / send 1.019x" in text and "fused / gemm                             1.025x" in text
    # one section alone renders alone; what it needs from another section is said to be missing
    only_decode = {k: out[k] for k in ("device", "sm_count", "date", "decode")}
    text = report.render(dict(only_decode, decode=dict(out["decode"], copy_floor_us=None, round_over_floor=None)))
    assert "copy floor: needs the prefill section" in text and "per launch: needs the host section" in text
    assert "\n1. " not in text and "\n8. " not in text
    skipped = dict(only_decode, two_gpu={"skipped": "needs two GPUs"}, gemm={"skipped": "needs torch"})
    text = report.render(skipped)
    assert "7. two GPUs: skipped (needs two GPUs)" in text and "8. grouped GEMM + send: skipped (needs torch)" in text


def test_the_cuda_sources_are_package_data():
    text = baselines.kernel_source()
    for entry in ("baseline_copy", "baseline_scatter", "baseline_rows", "baseline_publish", "baseline_reduce"):
        assert f" {entry}(" in text and 'extern "C" __global__ void' in text, entry
    assert "cuda.bindings" not in text


ARCH_DEFINES = [dict(VPT=1, HINT=0, MAXT=1024), dict(VPT=4, HINT=1, MAXT=256), dict(VPT=8, HINT=0, MAXT=128)]


@pytest.mark.parametrize("defines", ARCH_DEFINES, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_the_cuda_baselines_compile_for_sm90_with_nvcc(defines, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed: the CUDA C++ baselines are not compiled here")
    out = tmp_path / "baselines.ptx"
    r = subprocess.run([nvcc, "-arch=sm_90", "-ptx", "-std=c++17", *(f"-D{k}={v}" for k, v in defines.items()),
                        str(BENCH / "kernels" / "baselines.cu"), "-o", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    entries = {line.split("(")[0].split()[-1] for line in out.read_text().splitlines() if ".entry" in line}
    assert entries == {"baseline_copy", "baseline_scatter", "baseline_rows", "baseline_publish", "baseline_reduce",
                       "dispatch_exchange", "dispatch_signal"}


def test_the_cuda_baselines_compile_with_nvrtc():
    from p3send.abi.errors import CudaError, P3SendError
    from p3send.cuda import driver
    try:
        driver.nvrtc_version()
    except P3SendError as e:
        pytest.skip(f"NVRTC is not installed here: {e}")
    ptx, _ = driver.nvrtc_compile(baselines.kernel_source(), "sm_90", "baselines.cu", ARCH_DEFINES[1], output="ptx")
    assert b".entry baseline_scatter(" in ptx
    with pytest.raises(CudaError, match=r"nvrtcCompileProgram results in NVRTC_ERROR_COMPILATION") as e:
        driver.nvrtc_compile(baselines.kernel_source() + "\n__device__ int broken = ;\n", "sm_90", "baselines.cu")
    assert "baselines.cu(" in e.value.log


def test_nvrtc_compile_checks_its_output_argument_first():
    from p3send.abi.errors import ConfigError
    from p3send.cuda import driver
    with pytest.raises(ConfigError, match="output: expected 'cubin' or 'ptx', got 'elf'"):
        driver.nvrtc_compile("", "sm_90", output="elf")


@pytest.mark.install
@pytest.mark.timeout(600)
def test_a_built_wheel_ships_the_cuda_sources(tmp_path):
    # the tracked and new files, as test_install copies them; a wheel built from them
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True)
    if listed.returncode:
        pytest.skip("not a git checkout")
    src = tmp_path / "src"
    for f in filter(None, listed.stdout.decode().split("\0")):
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"),
                        str(src)], capture_output=True, text=True, timeout=600)
    if r.returncode and any(s in r.stderr for s in ("No matching distribution", "Could not find a version",
                                                    "Failed to establish", "Network is unreachable")):
        pytest.skip(f"pip cannot reach a package index: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    wheel, = (tmp_path / "dist").glob("p3send-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert "p3send/bench/kernels/baselines.cu" in z.namelist()
        z.extractall(tmp_path / "site")
    # imported from the unpacked wheel (not this checkout), the source is found
    code = ("import p3send, p3send.bench.baselines as b; print(p3send.__file__); "
            "print('baseline_scatter' in b.kernel_source())")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    where, found = r.stdout.split()
    assert where.startswith(str(tmp_path / "site")) and found == "True", r.stdout


# ---------------------------------------------------------------- layers

ALLOWED = {"abi", "cuda", "ops", "oracle", "bench", "moe"}


def imports_of(path: Path) -> tuple[set[str], set[str]]:
    """(the p3send sub-packages ``path`` imports, the bench modules it imports), function-local
    imports included."""
    packages, modules = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                packages.add("bench")
                if node.module:
                    modules.add(node.module.split(".")[0])
                else:
                    modules.update(a.name for a in node.names)
            elif node.level == 2:
                packages.add((node.module or "").split(".")[0])
            elif node.module and node.module.startswith("p3send."):
                packages.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            packages.update(a.name.split(".")[1] for a in node.names if a.name.startswith("p3send."))
    return packages, modules


def test_the_bench_imports_only_the_runtime_the_oracle_and_itself():
    for path in BENCH.glob("*.py"):
        packages, _ = imports_of(path)
        assert packages <= ALLOWED, f"{path.name} imports {sorted(packages - ALLOWED)}"


def test_no_import_circle_inside_the_bench():
    graph = {p.stem: imports_of(p)[1] for p in BENCH.glob("*.py")}
    assert all(m in graph for deps in graph.values() for m in deps), graph

    def visit(m, path):
        assert m not in path, f"import circle: {' -> '.join(path + [m])}"
        for n in graph[m]:
            visit(n, path + [m])
    for m in graph:
        visit(m, [])


def test_nothing_outside_the_bench_and_the_commands_imports_it():
    for path in (ROOT / "p3send").rglob("*.py"):
        rel = path.relative_to(ROOT / "p3send").parts
        if rel[0] in ("bench", "cli"):
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom):
                name = n.module or ""
                assert not (n.level and name.split(".")[0] == "bench"), f"{path}: from {'.' * n.level}{name}"
                assert not name.startswith("p3send.bench"), f"{path}: from {name}"
            elif isinstance(n, ast.Import):
                assert not any(a.name.startswith("p3send.bench") for a in n.names), path
