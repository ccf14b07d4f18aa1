"""One process per GPU on two peer-capable GPUs: the round with peer stores over
NVLink/PCIe P2P (legacy CUDA IPC mappings of the other GPU's buffers). Byte-exact
receive buffers, exact counts, reduce within bf16 rounding, several rounds and graph
replays with fresh C; then two processes per GPU (peers on the same GPU and on the
other one). Skipped with the reason unless two GPUs can access each other."""
from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from p3send.cuda import driver
from p3send.ops.procs import run_ranks
from p3send.oracle.rounds import RoundJob, run_round_job
from tests.gpu.conftest import OK, WHY, fresh_seed
from tests.gpu.test_world import assert_verified, report


def _why_not() -> str | None:
    if not OK:
        return f"no usable GPU: {WHY}"
    n = driver.device_count()
    if n < 2:
        return f"needs 2 GPUs, the driver reports {n}"
    if not (driver.can_access_peer(0, 1) and driver.can_access_peer(1, 0)):
        return "GPUs 0 and 1 cannot access each other's memory (cuDeviceCanAccessPeer = 0)"
    return None


WHY_NOT = _why_not()
pytestmark = [pytest.mark.multi_gpu, pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]


@pytest.fixture(scope="module", autouse=True)
def topology():
    """Print how GPUs 0 and 1 are linked (the numbers depend on it)."""
    print(f"\nGPU 0 {driver.pci_bus_id(0)}, GPU 1 {driver.pci_bus_id(1)}: peer access both ways")
    smi = shutil.which("nvidia-smi")
    if smi:
        res = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=30)
        print(res.stdout or res.stderr)


def test_one_process_per_gpu_rounds_and_replays():
    job = RoundJob(tokens=64, top_k=4, n_local=3, hidden=1032, seed=fresh_seed("two_gpus"), rounds=3, replays=5)
    t0 = time.monotonic()
    out = run_ranks(run_round_job, 2, job, devices=[0, 1], timeout_s=300)
    assert_verified(out, f"2 ranks on GPUs 0 and 1 (seed {job.seed})")
    assert time.monotonic() - t0 < 300
    assert [o.value["device"] for o in out] == [0, 1]
    assert out[0].value["bus_id"] != out[1].value["bus_id"]
    assert not any(o.value["sync_sends"] for o in out), "across GPUs the receive streams: no mid-round barrier"
    report(out)


def test_dsv3_rows_with_the_mid_round_barrier_forced_on():
    job = RoundJob(tokens=32, top_k=8, n_local=4, hidden=7168, seed=fresh_seed("two_gpus_dsv3"), rounds=2,
                   replays=3, sync_sends=True)
    out = run_ranks(run_round_job, 2, job, devices=[0, 1], timeout_s=300)
    assert_verified(out, f"2 ranks, hidden 7168 (seed {job.seed})")
    report(out)


def test_two_processes_per_gpu():
    job = RoundJob(tokens=40, top_k=4, n_local=2, hidden=256, seed=fresh_seed("2x2"), rounds=2, replays=3)
    out = run_ranks(run_round_job, 4, job, devices=[0, 1], timeout_s=300)
    assert_verified(out, f"4 ranks on 2 GPUs (seed {job.seed})")
    assert [o.value["device"] for o in out] == [0, 1, 0, 1]
    assert all(o.value["sync_sends"] for o in out), "a peer on the same GPU turns the mid-round barrier on"
    report(out)
