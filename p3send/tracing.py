"""A combine round's %globaltimer stamps as a Chrome trace, a summary and a PNG
(what ``p3send trace`` prints and writes).

The stamps come from ``Combine.timeline()`` (docs/KERNELS.md, the headers of
``ptx/p3_scatter_send.ptx`` and ``ptx/p3_recv_reduce.ptx``): per rank a dict

    {"send": [[first_ns, last_ns], ...],                       # one per send CTA
     "recv": [[start_ns, last_wait_done_ns, end_ns, tokens], ...]}  # one per receive CTA

all on one GPU's %globaltimer, zeros where a CTA did nothing. Each lane becomes
complete ("X") events of the Trace Event Format (Perfetto, chrome://tracing):

- ``send``: first peer store to last peer store of that send CTA;
- ``wait``: receive CTA start to the latest moment one of its units' waits completed
  (tokens whose pairs have arrived are reduced inside this span, not after it);
- ``reduce``: that moment to the CTA's end (the last reduces, the sweep over all
  slots and the re-arm);
- ``recv``: start to end of a receive CTA in which no wait completed (nothing
  arrived for its units, or it had none).

pid = rank, tid = CTA lane (send CTA i is tid i; receive CTA j follows the rank's
send lanes), ts/dur in microseconds from the earliest stamp of the round. CTAs whose
stamps are all zero produce no events, not even a lane name.

Pure conversion: nothing here imports CUDA (``abi`` only); matplotlib (the optional
extra ``p3send[plot]``) is imported only inside ``plot``.
"""
from __future__ import annotations

import os

from .abi.errors import ConfigError
from .abi.files import load_json

__all__ = ["RECV_FIELDS", "plot", "read_timeline", "summarize", "to_chrome_trace"]

#: The receive stamp fields, in order (``p3_recv_reduce`` stamp_ptr).
RECV_FIELDS = ("start_ns", "last_wait_done_ns", "end_ns", "tokens")


# ---------------------------------------------------------------- pure conversion

def _normalize(timeline) -> dict[int, dict[str, list[list[int]]]]:
    """``timeline`` with int rank keys (JSON makes them strings), checked; sorted by rank."""
    if not isinstance(timeline, dict):
        raise ConfigError(f"timeline: expected a dict {{rank: {{'send': [...], 'recv': [...]}}}}, "
                         f"got {type(timeline).__name__}", "timeline")
    out: dict[int, dict[str, list[list[int]]]] = {}
    for key, entry in timeline.items():
        try:
            r = int(key)
        except (TypeError, ValueError):
            raise ConfigError(f"timeline: expected rank keys that are integers, got {key!r}", "timeline") from None
        if r < 0 or r in out:
            raise ConfigError(f"timeline: rank {key!r} is negative or appears twice", "timeline")
        if not isinstance(entry, dict) or not {"send", "recv"} <= set(entry):
            raise ConfigError(f"timeline rank {r}: expected a dict with 'send' and 'recv' lists, got {entry!r:.80}",
                              "timeline")
        out[r] = {"send": _rows(entry["send"], 2, f"rank {r} send"),
                  "recv": _rows(entry["recv"], 4, f"rank {r} recv")}
    return dict(sorted(out.items()))


def _rows(rows, width: int, what: str) -> list[list[int]]:
    if not isinstance(rows, (list, tuple)):
        raise ConfigError(f"timeline {what}: expected a list of [{width} stamps] per CTA, got {type(rows).__name__}",
                          "timeline")
    checked = []
    for i, row in enumerate(rows):
        ok = isinstance(row, (list, tuple)) and len(row) == width and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in row)
        if not ok:
            raise ConfigError(f"timeline {what} CTA {i}: expected {width} non-negative integers, got {row!r:.80}",
                              "timeline")
        checked.append([int(v) for v in row])
    return checked


def _t0(tl: dict) -> int | None:
    """The earliest non-zero time stamp of the round (token counts are not times)."""
    stamps = [v for e in tl.values() for row in e["send"] for v in row if v]
    stamps += [v for e in tl.values() for row in e["recv"] for v in row[:3] if v]
    return min(stamps) if stamps else None


def _us(ns: int) -> float:
    return round(ns / 1000.0, 3)


def _lanes(tl: dict):
    """Yield (rank, tid, lane name, [(event name, begin_ns, end_ns, args), ...]) per active CTA."""
    for r, e in tl.items():
        n_send = len(e["send"])
        for i, (first, last) in enumerate(e["send"]):
            if first == 0:  # this CTA stored nothing
                continue
            yield r, i, f"send CTA {i}", [("send", first, max(first, last), {"first_ns": first, "last_ns": last})]
        for j, (start, waited, end, tokens) in enumerate(e["recv"]):
            if start == 0:  # not launched (stamps are zeroed per round)
                continue
            args = {"tokens": tokens}
            if waited == 0:
                spans = [("recv", start, max(start, end), {**args, "start_ns": start, "end_ns": end})]
            else:
                mid = max(start, waited)
                spans = [("wait", start, mid, {"start_ns": start, "last_wait_done_ns": waited}),
                         ("reduce", mid, max(mid, end), {**args, "end_ns": end})]
            yield r, n_send + j, f"recv CTA {j}", spans


def to_chrome_trace(timeline: dict) -> dict:
    """The round as Trace Event Format (Perfetto, chrome://tracing).

    Args:
        timeline: the dict of ``Combine.timeline()`` (rank keys int, or str as JSON
            stores them): per rank ``{"send": [[first_ns, last_ns], ...], "recv":
            [[start_ns, last_wait_done_ns, end_ns, tokens], ...]}``, non-negative ints.

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ns", "otherData": {...}}``: metadata
        events naming each rank and lane, then one complete ("X") event per span, ts/dur
        in microseconds from the earliest stamp.

    Raises:
        ConfigError: (a ValueError) the stamps do not have that shape; the message names
            the rank and CTA.
    """
    tl = _normalize(timeline)
    t0 = _t0(tl)
    meta, events = [], []
    named = set()
    for r, tid, lane, spans in _lanes(tl):
        if r not in named:
            named.add(r)
            meta.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
            meta.append({"name": "process_sort_index", "ph": "M", "pid": r, "args": {"sort_index": r}})
        meta.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": lane}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": r, "tid": tid, "args": {"sort_index": tid}})
        for name, b, e, args in spans:
            events.append({"name": name, "cat": "send" if name == "send" else "recv", "ph": "X",
                           "ts": _us(b - t0), "dur": _us(e - b), "pid": r, "tid": tid, "args": args})
    return {"traceEvents": meta + events, "displayTimeUnit": "ns",
            "otherData": {"source": "p3send trace", "clock": "%globaltimer of one GPU",
                          "t0_ns": t0 or 0, "ranks": list(tl)}}


def _union(spans) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for b, e in sorted(s for s in spans if s[1] > s[0]):
        if merged and b <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([b, e])
    return [(b, e) for b, e in merged]


def _overlap_ns(a, b) -> int:
    """Length of the intersection of two unions of [begin, end) spans."""
    total = 0
    for b0, e0 in _union(a):
        for b1, e1 in _union(b):
            total += max(0, min(e0, e1) - max(b0, b1))
    return total


def summarize(timeline: dict) -> str:
    """The round in a few lines of text.

    Args:
        timeline: as for ``to_chrome_trace``.

    Returns:
        Per rank: send span (first to last store over its CTAs), receive start, last wait
        done, reduce end, tokens, and how long its receive overlapped any rank's sends;
        then the same over all ranks. Microseconds from the earliest stamp; one line
        saying so when every stamp is zero. Ends with a newline.

    Raises:
        ConfigError: (a ValueError) the stamps do not have the shape of a timeline.
    """
    tl = _normalize(timeline)
    t0 = _t0(tl)
    if t0 is None:
        return f"no stamps in this timeline ({len(tl)} rank(s), every CTA zero): nothing ran or stamps were off\n"
    f = lambda ns: f"{(ns - t0) / 1000:.3f}"  # noqa: E731
    sends = {r: [(a, b) for a, b in e["send"] if a] for r, e in tl.items()}
    recvs = {r: [row for row in e["recv"] if row[0]] for r, e in tl.items()}
    all_sends = [s for v in sends.values() for s in v]
    all_recvs = [(row[0], max(row[0], row[2])) for v in recvs.values() for row in v]
    lines = [f"{len(tl)} rank(s); us from the earliest stamp (%globaltimer {t0} ns)"]
    for r, e in tl.items():
        s, v = sends[r], recvs[r]
        part = [f"rank {r}:"]
        if s:
            b, end = min(a for a, _ in s), max(max(a, z) for a, z in s)
            part.append(f"send {f(b)}-{f(end)} ({(end - b) / 1000:.3f} us, {len(s)}/{len(e['send'])} CTAs)")
        else:
            part.append(f"send - (0/{len(e['send'])} CTAs stored)")
        if v:
            waited = [row[1] for row in v if row[1]]
            ends = [row[2] for row in v if row[2]]
            part.append(f"| recv start {f(min(row[0] for row in v))}, "
                        f"wait done {f(max(waited)) if waited else '-'}, "
                        f"reduce end {f(max(ends)) if ends else '-'} "
                        f"({len(v)}/{len(e['recv'])} CTAs, {sum(row[3] for row in v)} tokens)")
            mine = [(row[0], max(row[0], row[2])) for row in v]
            part.append(f"| recv overlapped sends {_overlap_ns(mine, all_sends) / 1000:.3f} us")
        else:
            part.append(f"| recv - (0/{len(e['recv'])} CTAs ran)")
        lines.append("  " + " ".join(part))
    if all_sends and all_recvs:
        last_send = max(max(a, z) for a, z in all_sends)
        first_recv = min(b for b, _ in all_recvs)
        gap = (first_recv - last_send) / 1000
        lines.append(f"  all sends {f(min(a for a, _ in all_sends))}-{f(last_send)}, all receives "
                     f"{f(first_recv)}-{f(max(e for _, e in all_recvs))}: overlap "
                     f"{_overlap_ns(all_recvs, all_sends) / 1000:.3f} us; the first receive starts "
                     + (f"{gap:.3f} us after the last send store" if gap >= 0
                        else f"{-gap:.3f} us before the last send store"))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- PNG (optional)

_COLORS = {"send": "#1f77b4", "wait": "#ff7f0e", "reduce": "#2ca02c", "recv": "#7f7f7f"}


def plot(timeline: dict, path) -> bool:
    """Draw the round as a PNG: one panel per rank, one row per active CTA lane, with the
    Agg canvas (pyplot's global state is left alone).

    Args:
        timeline: as for ``to_chrome_trace``.
        path: the PNG file to write (str or ``os.PathLike``).

    Returns:
        True when written; False, writing nothing, when matplotlib is not installed.

    Raises:
        ConfigError: (a ValueError) the stamps do not have the shape of a timeline.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        return False
    trace = to_chrome_trace(timeline)
    lanes: dict[int, dict[int, str]] = {}
    bars: dict[int, list[dict]] = {}
    for ev in trace["traceEvents"]:
        if ev["name"] == "thread_name":
            lanes.setdefault(ev["pid"], {})[ev["tid"]] = ev["args"]["name"]
        elif ev["ph"] == "X":
            bars.setdefault(ev["pid"], []).append(ev)
    ranks = sorted(lanes) or [None]
    heights = [0.8 + 0.012 * len(lanes.get(r, {})) for r in ranks]
    size = (12, min(60.0, 0.6 + sum(heights)))
    try:
        fig = Figure(figsize=size, dpi=100, layout="constrained")
    except TypeError:  # matplotlib < 3.5
        fig = Figure(figsize=size, dpi=100, constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(ranks), 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, r in zip(axes, ranks):
        if r is None:
            ax.text(0.5, 0.5, "no stamps", ha="center", va="center", transform=ax.transAxes)
            continue
        row = {tid: k for k, tid in enumerate(sorted(lanes[r]))}
        for name, color in _COLORS.items():
            evs = [ev for ev in bars.get(r, []) if ev["name"] == name]
            if evs:  # one call per kind; a zero-length span gets a hairline width so it stays visible
                ax.barh([row[ev["tid"]] for ev in evs], [max(ev["dur"], 1e-3) for ev in evs],
                        left=[ev["ts"] for ev in evs], height=0.8, color=color, linewidth=0)
        n_send = sum(1 for name in lanes[r].values() if name.startswith("send"))
        if 0 < n_send < len(row):
            ax.axhline(n_send - 0.5, color="k", linewidth=0.5)
        ax.set_ylim(len(row) - 0.5, -0.5)
        ax.set_yticks([])
        ax.set_ylabel(f"rank {r}\n{n_send} send /\n{len(row) - n_send} recv CTAs", fontsize=8)
    axes[-1].set_xlabel("us from the earliest stamp (%globaltimer)")
    axes[0].legend(handles=[Patch(color=c, label=n) for n, c in _COLORS.items()],
                   loc="upper right", fontsize=8, ncol=4)
    fig.suptitle("p3send combine round: send and receive CTAs per rank")
    fig.savefig(str(path), format="png", bbox_inches="tight")
    return True


# ---------------------------------------------------------------- saved stamps

def read_timeline(path) -> dict:
    """A timeline saved as JSON (``p3send trace --save``), checked.

    Args:
        path: the JSON file (str or ``os.PathLike``): a regular file within
            ``abi.files.MAX_TEXT_BYTES``, nested at most ``abi.files.MAX_JSON_DEPTH`` deep.

    Returns:
        The timeline as stored (rank keys are strings); ``to_chrome_trace`` and
        ``summarize`` accept it as it is.

    Raises:
        InputFileError: not a regular file, too large, not UTF-8, nested too deeply or
            not JSON; ConfigError: JSON, but not a timeline. Both name ``path``.
    """
    data = load_json(path, what="timeline")
    try:
        _normalize(data)
    except ConfigError as e:
        raise ConfigError(e.problems, f"timeline {os.fspath(path)}") from None
    return data
