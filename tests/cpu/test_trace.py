"""`p3send trace` without a GPU: stamps -> Chrome trace events, the summary, the
optional PNG, and the command's no-GPU path."""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from p3send import tracing

B = 1_700_000_000_000  # an arbitrary %globaltimer origin, ns

# Written by hand: 2 ranks, 3 send CTAs and 2 receive CTAs each. Rank 0's send CTA 2
# and rank 1's receive CTA 1 are idle (all zeros); rank 1's receive CTA 0 saw no wait
# complete (stamp [1] == 0) and starts 100 ns before rank 1's last send store.
TIMELINE = {
    0: {"send": [[B + 0, B + 1500], [B + 250, B + 2000], [0, 0]],
        "recv": [[B + 3000, B + 3500, B + 5250, 64], [B + 3100, B + 4000, B + 5000, 64]]},
    1: {"send": [[B + 500, B + 2500], [B + 750, B + 1750], [B + 1000, B + 1000]],
        "recv": [[B + 2400, 0, B + 2900, 0], [0, 0, 0, 0]]},
}

# (pid, tid, name, ts_us, dur_us), from the stamps above minus B, divided by 1000.
# Receive lanes follow the rank's 3 send lanes: receive CTA j is tid 3 + j.
EXPECTED = sorted([
    (0, 0, "send", 0.0, 1.5),
    (0, 1, "send", 0.25, 1.75),
    (0, 3, "wait", 3.0, 0.5),
    (0, 3, "reduce", 3.5, 1.75),
    (0, 4, "wait", 3.1, 0.9),
    (0, 4, "reduce", 4.0, 1.0),
    (1, 0, "send", 0.5, 2.0),
    (1, 1, "send", 0.75, 1.0),
    (1, 2, "send", 1.0, 0.0),
    (1, 3, "recv", 2.4, 0.5),
])


def _complete(tr):
    return sorted((e["pid"], e["tid"], e["name"], e["ts"], e["dur"])
                  for e in tr["traceEvents"] if e["ph"] == "X")


def _saved(tmp_path, timeline=TIMELINE):
    path = tmp_path / "stamps.json"
    path.write_text(json.dumps({str(r): e for r, e in timeline.items()}))  # as --save writes it
    return path


def test_events_match_hand_computed_microseconds():
    got = _complete(tracing.to_chrome_trace(TIMELINE))
    assert [g[:3] for g in got] == [e[:3] for e in EXPECTED]
    for g, e in zip(got, EXPECTED):
        assert g[3:] == pytest.approx(e[3:], abs=1e-9), g


def test_event_fields_follow_the_trace_event_format():
    tr = tracing.to_chrome_trace(TIMELINE)
    assert tr["otherData"]["t0_ns"] == B
    for e in tr["traceEvents"]:
        assert e["ph"] in ("X", "M")
        assert isinstance(e["pid"], int)
        if e["name"] not in ("process_name", "process_sort_index"):  # per-process metadata has no lane
            assert isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
    reduce = [e for e in tr["traceEvents"] if e["name"] == "reduce" and e["pid"] == 0 and e["tid"] == 3]
    assert reduce[0]["args"]["tokens"] == 64


def test_metadata_names_ranks_and_active_lanes_only():
    tr = tracing.to_chrome_trace(TIMELINE)
    procs = {e["pid"]: e["args"]["name"] for e in tr["traceEvents"] if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in tr["traceEvents"] if e["name"] == "thread_name"}
    assert procs == {0: "rank 0", 1: "rank 1"}
    assert threads == {(0, 0): "send CTA 0", (0, 1): "send CTA 1", (0, 3): "recv CTA 0", (0, 4): "recv CTA 1",
                       (1, 0): "send CTA 0", (1, 1): "send CTA 1", (1, 2): "send CTA 2", (1, 3): "recv CTA 0"}


def test_idle_ctas_produce_no_events():
    tr = tracing.to_chrome_trace(TIMELINE)
    lanes = {(e["pid"], e["tid"]) for e in tr["traceEvents"] if "tid" in e}
    assert (0, 2) not in lanes   # rank 0 send CTA 2: zeros
    assert (1, 4) not in lanes   # rank 1 recv CTA 1: zeros
    idle = {0: {"send": [[0, 0]], "recv": [[0, 0, 0, 0]]}}
    assert tracing.to_chrome_trace(idle)["traceEvents"] == []
    assert "no stamps" in tracing.summarize(idle)


def test_json_round_trip_and_string_rank_keys():
    tr = tracing.to_chrome_trace(TIMELINE)
    assert json.loads(json.dumps(tr)) == tr
    as_saved = json.loads(json.dumps({str(r): e for r, e in TIMELINE.items()}))
    assert tracing.to_chrome_trace(as_saved) == tr


@pytest.mark.parametrize("bad, fragment", [
    ([1, 2], "expected a dict"),
    ({"x": {"send": [], "recv": []}}, "integers"),
    ({0: {"send": []}}, "'send' and 'recv'"),
    ({0: {"send": [[1, 2, 3]], "recv": []}}, "rank 0 send CTA 0"),
    ({0: {"send": [], "recv": [[1, 2, -3, 4]]}}, "rank 0 recv CTA 0"),
])
def test_malformed_timelines_are_refused(bad, fragment):
    with pytest.raises(ValueError, match=fragment):
        tracing.to_chrome_trace(bad)


def test_summary_spans_and_overlap():
    text = tracing.summarize(TIMELINE)
    rank0 = next(line for line in text.splitlines() if "rank 0:" in line)
    rank1 = next(line for line in text.splitlines() if "rank 1:" in line)
    assert "send 0.000-2.000 (2.000 us, 2/3 CTAs)" in rank0
    assert "wait done 4.000, reduce end 5.250 (2/2 CTAs, 128 tokens)" in rank0
    assert "recv overlapped sends 0.000 us" in rank0
    assert "send 0.500-2.500 (2.000 us, 3/3 CTAs)" in rank1
    assert "wait done -, reduce end 2.900 (1/2 CTAs, 0 tokens)" in rank1
    assert "recv overlapped sends 0.100 us" in rank1
    assert "overlap 0.100 us; the first receive starts 0.100 us before the last send store" in text


def test_cli_from_file_writes_the_trace(cli, tmp_path):
    prefix = tmp_path / "round"
    rc, out = cli("trace", "--from", _saved(tmp_path), "--out", prefix)
    assert rc == 0, out
    written = json.loads((tmp_path / "round.json").read_text())
    assert written == tracing.to_chrome_trace(TIMELINE)
    assert "rank 1:" in out and "recv overlapped sends 0.100 us" in out
    png = tmp_path / "round.png"
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not png.exists()
        assert "matplotlib is not installed" in out


def test_cli_without_matplotlib_still_writes_json(cli, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: import raises ImportError
    prefix = tmp_path / "nomp"
    rc, out = cli("trace", "--from", _saved(tmp_path), "--out", prefix)
    assert rc == 0, out
    assert json.loads((tmp_path / "nomp.json").read_text())["traceEvents"]
    assert not (tmp_path / "nomp.png").exists()
    assert "matplotlib is not installed" in out and "p3send[plot]" in out


def test_cli_save_stores_the_raw_stamps(cli, tmp_path):
    copy = tmp_path / "copy.json"
    rc, out = cli("trace", "--from", _saved(tmp_path), "--out", tmp_path / "t", "--save", copy)
    assert rc == 0, out
    assert json.loads(copy.read_text()) == {str(r): e for r, e in TIMELINE.items()}


def test_cli_bad_from_file_is_an_error(cli, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"0": {"send": [[1]], "recv": []}}')
    rc, out = cli("trace", "--from", bad, "--out", tmp_path / "t")
    assert rc == 2
    assert "p3send trace: error:" in out and "rank 0 send CTA 0" in out
    assert not (tmp_path / "t.json").exists()


def test_cli_refuses_to_overwrite_the_stamps(cli, tmp_path):
    src = _saved(tmp_path)
    before = src.read_text()
    rc, out = cli("trace", "--from", src, "--out", tmp_path / "stamps")  # would write stamps.json
    assert rc == 2
    assert "--from FILE" in out and "same file" in out
    assert src.read_text() == before


def test_cli_without_gpu_says_so_and_exits_0(cli, tmp_path, monkeypatch):
    from p3send.cuda import driver
    monkeypatch.setattr(driver, "available", lambda: (False, "no CUDA driver (test)"))
    rc, out = cli("trace", "--out", tmp_path / "t")
    assert rc == 0, out
    assert "no usable GPU here (no CUDA driver (test))" in out
    assert not (tmp_path / "t.json").exists()


def test_tracing_is_pure_conversion():
    # stamps in, trace out: abi only (no CUDA, no commands), matplotlib only inside plot()
    from tests.cpu.test_layers import PKG, p3send_imports
    assert p3send_imports(PKG / "tracing.py") <= {"abi"}
    assert "from cuda" not in (PKG / "tracing.py").read_text()


def test_read_timeline_refuses_what_is_not_a_timeline(tmp_path):
    from p3send.abi.errors import ConfigError, InputFileError
    with pytest.raises(InputFileError, match="is a folder"):
        tracing.read_timeline(tmp_path)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(InputFileError, match="nested more than 64 levels"):
        tracing.read_timeline(deep)
    with pytest.raises(ConfigError, match="rank 0 send CTA 0"):
        tracing.read_timeline(_saved(tmp_path, {0: {"send": [[1]], "recv": []}}))
    assert tracing.read_timeline(_saved(tmp_path)) == {str(r): e for r, e in TIMELINE.items()}
