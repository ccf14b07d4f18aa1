"""Driver seam on the GPU: the by-value echo, load-time checks, errors, graphs."""
from __future__ import annotations

import numpy as np
import pytest

from p3send import CudaError, P3PeerSendConfig, ParamMismatchError
from p3send.abi.config import FIELDS
from p3send.cuda import driver, loader
from tests.gpu.conftest import fresh_seed


def random_config(rng) -> P3PeerSendConfig:
    cfg = P3PeerSendConfig()
    for f in FIELDS:
        if f.kind == "ptr[8]":
            setattr(cfg, f.name, [int(x) for x in rng.integers(0, 2**63, 8, dtype=np.int64)])
        elif f.kind == "ptr":
            setattr(cfg, f.name, int(rng.integers(0, 2**63, dtype=np.int64)) * 2 + int(rng.integers(2)))
        else:
            setattr(cfg, f.name, int(rng.integers(-2**63, 2**63 - 1, dtype=np.int64)))
    return cfg


def test_echo_disabled_is_byte_exact(dev):
    cfg = P3PeerSendConfig.disabled()
    seen, tag = loader.abi_echo(cfg, tag=0x1122334455667788, device=dev)
    assert seen == bytes(cfg), f"device saw {seen.hex()}, host sent {bytes(cfg).hex()}"
    assert tag == 0x1122334455667788


def test_echo_random_configs_are_byte_exact(dev):
    rng = np.random.default_rng(fresh_seed("echo"))
    for i in range(16):
        cfg = random_config(rng)
        tag = int(rng.integers(0, 2**63, dtype=np.int64))
        seen, seen_tag = loader.abi_echo(cfg, tag=tag, device=dev)
        assert seen == bytes(cfg), f"config {i}: device saw {seen.hex()}, host sent {bytes(cfg).hex()}"
        assert seen_tag == tag


def test_documented_params_match_the_driver(dev):
    for name in ("p3_abi_echo", "p3_scatter_send", "p3_recv_reduce"):
        k = loader.kernel(name, dev)
        info = driver.param_info(k.func, len(k.params))
        assert info[0] == (0, 184), f"{name}: the struct must be parameter 0, 184 bytes"
        assert info == [(p.offset, p.size) for p in k.params]


def test_param_table_mismatch_raises_before_launch(dev):
    text = (loader.ptx_dir() / "p3_abi_echo.ptx").read_text()
    # document a 4-byte tag while the entry declares 8 bytes: the loader must refuse it
    bad = text.replace("//   192     8  u64               tag", "//   192     4  u32               tag")
    assert bad != text
    with pytest.raises(ParamMismatchError, match="p3_abi_echo"):
        loader.load(bad, device=dev, name="echo_with_wrong_header.ptx")


def test_broken_ptx_raises_with_the_jit_log(dev):
    text = (loader.ptx_dir() / "p3_abi_echo.ptx").read_text()
    bad = text.replace("st.global.u64       [%rd1+184], %rd3;", "st.global.u64       [%rd1+184], %nosuchreg;")
    with pytest.raises(CudaError) as ei:
        loader.load(bad, device=dev, name="broken_echo.ptx")
    e = ei.value
    assert e.call == "cuModuleLoadDataEx" and e.name == "CUDA_ERROR_INVALID_PTX"
    assert "nosuchreg" in e.log and "broken_echo.ptx" in str(e), str(e)


def test_bad_launch_names_the_call_and_context_survives(dev):
    k = loader.kernel("p3_abi_echo", dev)
    out = driver.DeviceBuffer(192, fill=0)
    s = driver.Stream()
    blk = k.params_block(cfg=P3PeerSendConfig.disabled(), out=out, tag=1)
    with pytest.raises(CudaError, match="cuLaunchKernel"):
        blk.launch((1,), (4096,), s)        # more threads than a block may have
    blk.launch((1,), (32,), s)              # the context is still usable
    s.synchronize()
    assert out.download()[184:192].view(np.uint64)[0] == 1
    out.free()
    s.close()


def test_graph_capture_and_replay(dev):
    k = loader.kernel("p3_abi_echo", dev)
    out = driver.DeviceBuffer(192 * 3, fill=0)
    origin, side = driver.Stream(), driver.Stream()
    cfgs = [P3PeerSendConfig.disabled() for _ in range(3)]
    for i, c in enumerate(cfgs):
        c.n_ranks = i + 1
    blocks = [k.params_block(cfg=c, out=out.ptr + 192 * i, tag=100 + i) for i, c in enumerate(cfgs)]
    with driver.Graph.capture(origin, [side]) as cap:
        blocks[0].launch((1,), (32,), origin)
        blocks[1].launch((1,), (32,), side)
        blocks[2].launch((1,), (32,), side)
    out.fill(0)
    for _ in range(5):
        cap.graph.launch(origin)
    origin.synchronize()
    raw = out.download()
    for i, c in enumerate(cfgs):
        assert raw[192 * i:192 * i + 184].tobytes() == bytes(c)
        assert raw[192 * i + 184:192 * i + 192].view(np.uint64)[0] == 100 + i
    cap.graph.close()
    out.free()
