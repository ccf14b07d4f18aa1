"""Timing on the GPU: ``Timer`` (device events around each launch, medians in microseconds)
and its timing in turns (``Timer.interleaved``). docs/PERF.md states the method."""
from __future__ import annotations

import random
import statistics

from ..cuda import driver, loader

# One thread that spins on %globaltimer for ``ns``: holds a stream while the host enqueues.
HOLD_PTX = """.version 8.0
.target sm_90
.address_size 64
.visible .entry p3_bench_hold(.param .u64 ns)
{
    .reg .pred  %p;
    .reg .b64   %t, %end;
    ld.param.u64        %end, [ns];
    mov.u64             %t, %globaltimer;
    add.s64             %end, %end, %t;
WAIT:
    nanosleep.u32       1000;
    mov.u64             %t, %globaltimer;
    setp.lt.u64         %p, %t, %end;
    @%p bra             WAIT;
    ret;
}
"""


def summary(us: list[float]) -> dict:
    """{"median_us", "min_us", "max_us", "n"} of a list of times in microseconds."""
    return {"median_us": statistics.median(us), "min_us": min(us), "max_us": max(us), "n": len(us)}


class Timer:
    """Event-timed iterations on one stream; median in microseconds.

    ``hold``: ``run`` first enqueues a one-thread kernel that holds the stream for 2 ms + 50
    us per iteration, so the host has enqueued every timed launch before the GPU reaches
    them and no event pair can include the host's launch path (``interleaved`` always
    holds)."""

    HOLD_NS, HOLD_NS_PER_ITER = 2_000_000, 50_000

    def __init__(self, stream: driver.Stream, *, hold: bool = False, device: driver.Device | None = None):
        self.s, self.hold, self.dev = stream, hold, device

    def run(self, fn, iters: int, warmup: int) -> dict:
        """``fn(i)`` ``warmup`` times, then ``iters`` times between events: summary() of those."""
        for i in range(warmup):
            fn(i)
        self.s.synchronize()
        starts = [driver.Event() for _ in range(iters)]
        ends = [driver.Event() for _ in range(iters)]
        if self.hold:
            self.hold_stream(iters)
        for i in range(iters):
            starts[i].record(self.s)
            fn(i)
            ends[i].record(self.s)
        self.s.synchronize()
        us = [1000.0 * a.elapsed_ms(b) for a, b in zip(starts, ends)]
        for e in starts + ends:
            e.close()
        return summary(us)

    def hold_stream(self, launches: int) -> None:
        """Enqueue the hold kernel, long enough for ``launches`` launches to be enqueued."""
        k = loader.load(HOLD_PTX, device=self.dev or driver.device(), name="bench hold")["p3_bench_hold"]
        k.params_block(ns=self.HOLD_NS + launches * self.HOLD_NS_PER_ITER).launch((1,), (1,), self.s)

    def interleaved(self, fns: dict, rounds: int, per_round: int, warmup: int) -> dict:
        """Every contender of ``fns`` (name -> fn(i)) timed in turns: ``rounds`` rounds of
        ``per_round`` launches each, the order shuffled every round (seeded), so slow drifts
        of the GPU (clocks, power, temperature) fall on every contender alike and no
        contender always follows the same one. Each round is held (as ``hold``) until all
        its launches are enqueued, so a short kernel's timing never includes the host's turn
        from one contender to the next. ``fn(i)`` gets the count of launches made before it
        (all contenders), so inputs rotated by ``i`` were last touched as many launches ago
        whoever ran before. Returns name -> summary() of all its launches, with
        "interleaved": True."""
        shuffle = random.Random(0).shuffle
        names = list(fns)
        for n in names:
            for i in range(warmup):
                fns[n](i)
        self.s.synchronize()
        times = {n: [] for n in names}
        made = 0
        events = [(driver.Event(), driver.Event()) for _ in range(per_round * len(names))]
        for _ in range(rounds):
            order = list(names)
            shuffle(order)
            marks = []
            self.hold_stream(len(events))
            for n in order:
                for _ in range(per_round):
                    e0, e1 = events[len(marks)]
                    e0.record(self.s)
                    fns[n](made)
                    made += 1
                    e1.record(self.s)
                    marks.append((n, e0, e1))
            self.s.synchronize()
            for n, e0, e1 in marks:
                times[n].append(1000.0 * e0.elapsed_ms(e1))
        for e0, e1 in events:
            e0.close()
            e1.close()
        return {n: dict(summary(v), interleaved=True) for n, v in times.items()}
