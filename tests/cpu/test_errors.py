"""Every error p3send raises is a P3SendError with a message naming what was wrong; the
config's integer fields refuse values that do not fit; the limits live in one place."""
from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

import p3send
from p3send.abi.config import P3_MAX_MSG_BYTES, P3PeerSendConfig, rank_config, shape_problems, validate
from p3send.abi.errors import (
    ArrivalTimeout,
    ConfigError,
    ConfigTypeError,
    ContextLostError,
    CudaError,
    FieldError,
    P3SendError,
)
from p3send.ops.exchange import ExchangeTimeout
from p3send.ops.send import ScatterSend

BASE = 0x7F00_0000_0000


def enabled(**kw) -> P3PeerSendConfig:
    cfg = rank_config(n_ranks=2, my_rank=1, recv_bufs=[BASE + 0x100000, BASE + 0x200000], top_k=4, msg_bytes=256,
                      max_tokens=16, range_table=BASE + 0x1000, src_info=BASE + 0x2000)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


@pytest.mark.parametrize("make, match", [
    (lambda: ScatterSend(0), r"n_experts: expected >= 1, got 0"),
    (lambda: ScatterSend(1, threads=33), r"threads: expected a multiple of 32 in 32\.\.1024, got 33"),
    (lambda: P3PeerSendConfig.from_bytes(b"x"), r"data: expected 184 bytes, got 1"),
    (lambda: setattr(P3PeerSendConfig(), "recv_buf_ptrs", [BASE] * 7), r"recv_buf_ptrs: expected 8 addresses, got 7"),
])
def test_bad_arguments_raise_config_errors_before_any_cuda(make, match):
    with pytest.raises(ConfigError, match=match) as e:
        make()
    assert isinstance(e.value, P3SendError) and isinstance(e.value, ValueError)
    assert "\n" not in str(e.value)          # one problem: one line


@pytest.mark.parametrize("field, value, match", [
    ("n_ranks", 2**64 + 1, r"n_ranks: expected a signed 64-bit integer .* got 18446744073709551617"),
    ("top_k", -(2**63) - 1, r"top_k: expected a signed 64-bit integer"),
    ("atomic_counter", -1, r"atomic_counter: expected an unsigned 64-bit address .* got -1"),
    ("src_info_ptr", 2**64, r"src_info_ptr: expected an unsigned 64-bit address"),
    ("recv_buf_ptrs", [1] * 7 + [2**64], r"recv_buf_ptrs\[7\]: expected an unsigned 64-bit address"),
])
def test_out_of_range_integers_are_refused_not_wrapped(field, value, match):
    cfg = P3PeerSendConfig.disabled()
    with pytest.raises(ConfigError, match=match):
        setattr(cfg, field, value)
    assert bytes(cfg) == bytes(P3PeerSendConfig.disabled())     # nothing written
    with pytest.raises(ConfigError, match=match.split(":")[0]):
        P3PeerSendConfig(**{field: value})


def test_non_integers_and_unknown_fields():
    cfg = P3PeerSendConfig.disabled()
    with pytest.raises(ConfigTypeError, match="msg_bytes: expected an integer, got float"):
        cfg.msg_bytes = 16.0
    with pytest.raises(FieldError, match="no field 'n_rank'") as e:
        cfg.n_rank = 4
    assert isinstance(e.value, AttributeError)
    cfg.n_ranks = 2**63 - 1                      # the extremes fit
    cfg.trace_ptr = 2**64 - 1
    assert (cfg.n_ranks, cfg.trace_ptr) == (2**63 - 1, 2**64 - 1)


def test_validate_msg_bytes_limit_and_empty_receive_buffers():
    assert validate(enabled()) == []
    assert validate(enabled(msg_bytes=P3_MAX_MSG_BYTES)) == []
    p = validate(enabled(msg_bytes=P3_MAX_MSG_BYTES + 16), raise_on_error=False)
    assert p == [f"msg_bytes: expected a positive multiple of 16 up to {P3_MAX_MSG_BYTES} (1 MiB), "
                 f"got {P3_MAX_MSG_BYTES + 16}"]
    p = validate(enabled(max_tokens_per_rank=0), raise_on_error=False)
    assert len(p) == 1 and p[0].startswith("max_tokens_per_rank: expected >= 1") and "dropped" in p[0]
    assert validate(enabled(max_tokens_per_rank=0), p3_control=-1) == []   # the send is off: nothing to drop
    with pytest.raises(ConfigError, match="msg_bytes"):
        validate(enabled(msg_bytes=2 * P3_MAX_MSG_BYTES))


def test_rank_config_is_the_one_builder():
    class Buf:
        ptr = BASE + 0x3000
    cfg = rank_config(n_ranks=3, my_rank=2, recv_bufs=[BASE + 0x10000 * (i + 1) for i in range(3)], top_k=8,
                      msg_bytes=14336, max_tokens=128, range_table=BASE + 0x1000, src_info=BASE + 0x2000,
                      row_base=Buf(), send_stamps=BASE + 0x4000, trace=BASE + 0x5000, trace_slot=3)
    d = cfg.to_dict()
    assert d["recv_buf_ptrs"] == [BASE + 0x10000, BASE + 0x20000, BASE + 0x30000] + [1] * 5
    assert (d["n_ranks"], d["p2p_world_size"], d["my_rank"], d["top_k"], d["msg_bytes"]) == (3, 3, 2, 8, 14336)
    assert (d["row_base_ptr"], d["send_stamp_on"], d["trace_on"], d["send_trace_slot"]) == (BASE + 0x3000, 1, 1, 3)
    assert validate(cfg, row_cache=True) == []
    off = rank_config(n_ranks=2, recv_bufs=[BASE, BASE], top_k=1, msg_bytes=16, max_tokens=1)
    dis = P3PeerSendConfig.disabled()
    assert (off.row_base_ptr, off.send_stamp_on, off.trace_on, off.send_trace_slot) == \
        (dis.row_base_ptr, 0, 0, -1)
    with pytest.raises(ConfigError, match="recv_bufs: expected at most 8 receive buffers, got 9"):
        rank_config(n_ranks=8, recv_bufs=[BASE] * 9, top_k=1, msg_bytes=16, max_tokens=1)


@pytest.mark.parametrize("kw, wanted", [
    (dict(n_ranks=0), "n_ranks: expected 1..8, got 0"), (dict(n_ranks=9), "n_ranks: expected 1..8, got 9"),
    (dict(top_k=0), "top_k: expected 1..32, got 0"), (dict(top_k=33), "top_k: expected 1..32, got 33"),
    (dict(hidden=7), "hidden: expected a positive multiple of 8"), (dict(hidden=1 << 19 + 1), "hidden"),
    (dict(max_tokens=0), "max_tokens: expected >= 1"), (dict(n_local_experts=0), "n_local_experts: expected >= 1"),
    (dict(n_ranks=1, n_local_experts=2, top_k=3), "top_k: expected at most the 2 experts"),
])
def test_shape_rules(kw, wanted):
    shape = dict(n_ranks=8, max_tokens=512, top_k=8, hidden=7168, n_local_experts=32)
    assert shape_problems(**shape) == []
    shape.update(kw)
    problems = shape_problems(shape.pop("n_ranks"), **shape)
    assert len(problems) == 1 and problems[0].startswith(wanted), problems


@pytest.mark.parametrize("err", [
    ConfigError(["a: expected 1, got 2", "b: expected 3, got 4"], "launch"),
    ConfigTypeError(["c: expected an integer, got str"]),
    CudaError("cuModuleLoadData", "CUDA_ERROR_INVALID_PTX", 218, "a PTX JIT compilation failed", "line 3: error"),
    ContextLostError("cuCtxSynchronize", "CUDA_ERROR_ILLEGAL_ADDRESS", 700),
    ArrivalTimeout([(0, 1, 2), (1, 0, 3)], {"timeouts": 2}, 5_000_000),
    ExchangeTimeout("rank 1: barrier #3 broken", [2, 0]),
])
def test_errors_survive_pickling(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err)
    assert vars(back) == vars(err) and back.args == err.args


def test_no_bare_builtin_raises_in_the_package():
    """Every error p3send raises derives from P3SendError (errors.py promises it)."""
    root = Path(p3send.__file__).parent
    allowed: set = set()
    bare = re.compile(r"\braise (ValueError|TypeError|KeyError|RuntimeError|IndexError|AttributeError|OSError|"
                      r"Exception|TimeoutError|NotImplementedError)\(")
    found = [f"{p.relative_to(root)}:{i}: {line.strip()}"
             for p in sorted(root.rglob("*.py")) if p.relative_to(root).as_posix() not in allowed
             for i, line in enumerate(p.read_text().splitlines(), 1) if bare.search(line)]
    assert not found, "raise a P3SendError subclass instead:\n" + "\n".join(found)
