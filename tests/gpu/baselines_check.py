"""Check the bench's baselines (p3send/bench/baselines.py) against the oracle, then time
them next to cuMemcpyDtoDAsync and p3_scatter_send, in one run on the GPU it finds.

Checks: every case family of the GPU tests (tests/gpu/conftest.run_send: sentinel-filled
receive buffers inside guards, counts with guard words, diagnostics, self-reset state),
and the bench's two shapes at full size (the prefill send and one rank's decode-size send,
8 receive buffers on this GPU, cases.prefill_routing): receive buffers with guards
compared byte for byte with the oracle's, counts compared after a first launch and again
after a second one (counts re-armed in between: the state must have reset itself).

    PYTHONPATH=. python3 -m tests.gpu.baselines_check [--seed N] [--iters 100] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import secrets
import time
from dataclasses import dataclass

import numpy as np

from p3send.abi.config import rank_config
from p3send.abi.layout import SENTINEL
from p3send.bench import baselines
from p3send.bench.data import random_bytes
from p3send.bench.timing import Timer
from p3send.cuda import driver
from p3send.ops.send import ScatterSend
from p3send.oracle import reference as ref
from p3send.oracle.cases import FAMILIES, prefill_routing, send_case

GUARD = 4096          # bytes of sentinel before and after every receive buffer


@dataclass
class Shape:
    name: str
    tokens: int
    ranks: int = 8
    top_k: int = 8
    experts: int = 32
    hidden: int = 7168
    sets: int = 2     # rotated input sets (more than L2 in all)


class Setup:
    """One bench shape on the GPU: ``sets`` rotated copies of C, receive buffers (with
    guards) and configs, shared counts (2 guard words each side), the routing."""

    def __init__(self, dev, sh: Shape, rng, torch):
        self.sh = sh
        self.off, self.table, self.src, _ = prefill_routing(sh.tokens, sh.ranks, sh.top_k, sh.experts, rng)
        self.rows, self.msg = sh.tokens * sh.top_k, 2 * sh.hidden
        self.nbytes = self.rows * self.msg
        self.recv_bytes = sh.tokens * sh.top_k * self.msg
        self.n_counts = sh.experts * sh.ranks
        self.cs = [random_bytes(self.nbytes, rng, torch) for _ in range(sh.sets)]
        self.recv = [[driver.DeviceBuffer(self.recv_bytes + 2 * GUARD, fill=SENTINEL) for _ in range(sh.ranks)]
                     for _ in range(sh.sets)]
        self.counts = [driver.DeviceBuffer(8 * (self.n_counts + 4), fill=0xFF) for _ in range(sh.ranks)]
        self.dsts = [driver.DeviceBuffer(self.nbytes) for _ in range(sh.sets)]
        self.rtab = driver.DeviceBuffer.from_array(self.table)
        self.srcb = driver.DeviceBuffer.from_array(self.src)
        self.offs = driver.DeviceBuffer.from_array(self.off)
        self.cfgs, self.sends = [], []
        for i in range(sh.sets):
            cfg = rank_config(n_ranks=sh.ranks, recv_bufs=[b.ptr + GUARD for b in self.recv[i][:sh.ranks]],
                              top_k=sh.top_k, msg_bytes=self.msg, max_tokens=sh.tokens, range_table=self.rtab,
                              src_info=self.srcb)
            self.cfgs.append(cfg)
            self.sends.append(dict(cfg=cfg, c=self.cs[i], expert_offsets=self.offs, expert_offsets_host=self.off,
                                   count_ptrs=[b.ptr + 16 for b in self.counts], rows_in_c=self.rows))

    def expected(self, torch):
        """The oracle's receive buffers (guards included) and counts for set 0."""
        c = self.cs[0].download().reshape(self.rows, self.msg)
        want = [np.full(self.recv_bytes + 2 * GUARD, SENTINEL, np.uint8) for _ in range(self.sh.ranks)]
        res = ref.send(self.cfgs[0], c, self.off, self.table, self.src,
                       [w[GUARD:GUARD + self.recv_bytes] for w in want])
        counts = [np.full(self.n_counts + 4, np.uint64(0xFFFF_FFFF_FFFF_FFFF), np.uint64) for _ in self.counts]
        ref.signal(self.cfgs[0], res, self.sh.experts, [w[2:2 + self.n_counts] for w in counts])
        if torch is not None:   # compared on the GPU: 8 x 470 MB per check
            want = [torch.from_numpy(w).cuda() for w in want]
        return want, counts, res

    def free(self):
        for b in (self.cs + [x for r in self.recv for x in r] + self.counts + self.dsts
                  + [self.rtab, self.srcb, self.offs]):
            b.free()


def check_setup(setup: Setup, launch, want, want_counts, res, torch, stream, sender=None) -> list[str]:
    """Launch set 0 twice (counts re-armed in between); the problems found (empty: exact).
    ``want_counts`` None: a launch that publishes no counts (they must stay untouched)."""
    problems = []
    for b in setup.recv[0]:
        b.fill(SENTINEL)
    for round_ in (1, 2):
        for b in setup.counts:
            b.fill(0xFF)
        launch(stream)
        stream.synchronize()
        if round_ == 1:
            for p, b in enumerate(setup.recv[0]):
                if torch is not None:
                    same = torch.equal(torch.as_tensor(b, device="cuda"), want[p])
                    got = b.download() if not same else None
                    w = want[p].cpu().numpy() if not same else None
                else:
                    got, w = b.download(), want[p]
                    same = np.array_equal(got, w)
                if not same:
                    bad = np.nonzero(got != w)[0]
                    i = int(bad[0])
                    problems.append(f"peer {p} receive buffer: {len(bad)} bytes differ, first at guarded byte {i} "
                                    f"(slot {(i - GUARD) // setup.msg}): got {got[i]:#04x}, want {w[i]:#04x}")
        for p, b in enumerate(setup.counts):
            got = b.download(np.uint64)
            w = want_counts[p] if want_counts is not None else np.full_like(got, 0xFFFF_FFFF_FFFF_FFFF)
            if not np.array_equal(got, w):
                bad = np.nonzero(got != w)[0]
                problems.append(f"launch {round_}: peer {p} counts differ at {bad[:6].tolist()}: got "
                                f"{got[bad[:6]].tolist()}, want {w[bad[:6]].tolist()}")
    if sender is not None:
        d = sender.diagnostics()
        if (d["dropped"], d["unrouted"]) != (2 * res.dropped, 2 * res.unrouted):
            problems.append(f"diagnostics {d} after two launches, oracle {res.dropped} dropped, "
                            f"{res.unrouted} unrouted each")
        state = sender.state.download(np.uint32)
        if state.any():
            problems.append(f"sender state not self-reset: {np.nonzero(state)[0][:8].tolist()} non-zero")
    return problems


class _AsSender:
    """A baseline in the sender protocol of tests/gpu/conftest.run_send."""

    def __init__(self, baseline):
        self.baseline, self.state, self.grid = baseline, baseline.state, 1

    def __call__(self, cfg, c, case, *, stream=None, count_ptrs=None, row_cache=False, p3_control=0):
        self.baseline(cfg, c, case.expert_offsets.astype(np.int32), case.row_stride, count_ptrs=count_ptrs,
                  row_cache=row_cache, p3_control=p3_control, stream=stream)

    def diagnostics(self):
        return self.baseline.diagnostics()

    def close(self):
        self.baseline.close()


def check_families(dev, seed: int, makers: dict) -> dict:
    """Every case family (seeded from ``seed``) through each baseline maker(n_experts);
    {baseline: [problems]}."""
    from .conftest import assert_send_exact, run_send
    out = {}
    for name, make in makers.items():
        out[name] = []
        for j, fam in enumerate(FAMILIES):
            case = send_case(fam, seed + j)
            try:
                assert_send_exact(run_send(dev, case, sender_factory=lambda cs: _AsSender(make(cs.n_experts))))
            except AssertionError as e:
                out[name].append(f"{fam} (seed {seed + j}): {str(e)[:400]}")
    return out


def check_baselines(dev, seed: int, torch=None, shapes=None, iters: int = 100, warmup: int = 10,
                passes: int = 2, log=print) -> dict:
    """The whole check and timing; returns {"families": ..., shape name: {"check": {name:
    [problems]}, "timing": [pass dicts]}}. A GPU test asserts every problem list empty."""
    rng = np.random.default_rng(seed)
    s = driver.Stream()
    timer = Timer(s)
    out = {"seed": seed}
    cuda_v = [baselines.CUDA_VARIANTS[0], (256, 1), (256, 4)]     # the default; 4 chunks x 1 and 1 chunk x 4 vectors
    tri_v = [baselines.TRITON_VARIANTS[0], (256, 1)]
    makers = {f"CUDA C++ {v}": (lambda n, v=v: baselines.CudaScatter(n, device=dev, threads=v[0], vpt=v[1]))
              for v in cuda_v}
    if baselines.triton_version() is not None:
        makers.update({f"Triton {v}": (lambda n, v=v: baselines.TritonScatter(n, device=dev, threads=v[0], vpt=v[1]))
                       for v in tri_v})
    t0 = time.time()
    out["families"] = check_families(dev, seed, makers)
    log(f"families checked in {time.time() - t0:.1f} s")
    for sh in shapes or (Shape("prefill", 4096), Shape("decode one rank", 128, sets=4)):
        t0 = time.time()
        st = Setup(dev, sh, rng, torch)
        want, want_counts, res = st.expected(torch)
        senders = {}
        for scope, same in ((".sys", False), (".gpu", True)):
            snd = ScatterSend(sh.experts, device=dev)
            blocks = [snd.prepare(a["cfg"], a["c"], a["expert_offsets"],
                                  expert_offsets_host=a["expert_offsets_host"], count_ptrs=a["count_ptrs"],
                                  rows_in_c=a["rows_in_c"], same_gpu=same, into=snd.k.params_block())
                      for a in st.sends]
            senders[f"p3_scatter_send ({scope} signal)"] = (snd, blocks)
        for name, make in makers.items():
            snd = make(sh.experts)
            senders[name] = (snd, [snd.prepare(**a) for a in st.sends])
        # diagnostic (not the send's job): the CUDA C++ CTA shape with every row's destination
        # precomputed on the host from the oracle: no resolve, no signal (the scatter baselines' shape)
        row_dst = []
        for cfg in st.cfgs:
            bufs = np.array(list(cfg.recv_buf_ptrs), np.uint64)
            base = bufs[np.maximum(res.peer, 0)] + (np.maximum(res.slot, 0) * st.msg).astype(np.uint64)
            d = np.where(res.peer >= 0, base, 0)
            row_dst.append(driver.DeviceBuffer.from_array(d.astype(np.uint64)))
        pre = {}
        for t, v in ((256, 1), (256, 2), (256, 4)):
            rows_copy = baselines.RowsCopy(device=dev, threads=t, vpt=v)
            pre[f"diag: CUDA C++ rows copy, destinations precomputed ({t}, {v})"] = [
                rows_copy.prepare(row_dst[i], st.cs[i], st.rows, st.msg) for i in range(sh.sets)]
        check = {}
        for name, (snd, blocks) in senders.items():
            check[name] = check_setup(st, lambda strm: snd.launch(strm, blocks[0]), want, want_counts, res, torch, s,
                                      sender=snd)
            log(f"{sh.name}: {name}: {'byte-exact' if not check[name] else check[name]}")
        for name, launches in pre.items():
            check[name] = check_setup(st, launches[0], want, None, res, torch, s)
            log(f"{sh.name}: {name}: {'byte-exact' if not check[name] else check[name]}")
        del want
        timing = []
        for _ in range(passes):
            rows = {"cuMemcpyDtoDAsync": timer.run(lambda i: driver.memcpy_dtod(
                st.dsts[i % sh.sets].ptr, st.cs[i % sh.sets].ptr, st.nbytes, s), iters, warmup)}
            for name, (snd, blocks) in senders.items():
                if name.startswith("p3_scatter_send"):
                    rows[name] = timer.run(lambda i: snd.launch(s, blocks[i % sh.sets]), iters, warmup)
            found, skipped = baselines.time_baselines(timer, st.sends, (st.dsts, st.cs, st.nbytes),
                                                      n_experts=sh.experts, dev=dev, iters=iters, warmup=warmup)
            rows.update(found)
            # diagnostics: each scatter baseline's fastest variant without the signal, and the
            # precomputed-destination copy: what the resolve and the signal cost
            for cls in (baselines.TritonScatter, baselines.CudaScatter):
                label = cls.label
                if label not in found:
                    continue
                v = found[label]["variant"]
                kern = cls(sh.experts, device=dev, threads=v[0], vpt=v[1])
                ls = [kern.prepare(**dict(a, count_ptrs=None)) for a in st.sends]
                rows[f"diag: {label} {v}, no signal"] = timer.run(lambda i: kern.launch(s, ls[i % sh.sets]), iters,
                                                                  warmup)
                kern.close()
            for name, launches in pre.items():
                rows[name] = timer.run(lambda i: launches[i % sh.sets](s), iters, warmup)
            timing.append({"rows": rows, "skipped": skipped})
        for snd, _ in senders.values():
            snd.close()
        for b in row_dst:
            b.free()
        st.free()
        out[sh.name] = {"rows": st.rows, "bytes": st.nbytes, "check": check, "timing": timing,
                        "seconds": time.time() - t0}
    s.close()
    return out


def table(out: dict) -> str:
    L = [f"baselines check, seed {out['seed']}"]
    for name, probs in out["families"].items():
        L.append(f"  families ({len(FAMILIES)}) {name:<26} {'byte-exact' if not probs else f'{len(probs)} FAILED'}")
        L += [f"    {p}" for p in probs]
    for e in out.get("errors", []):
        L.append(f"  error: {e}")
    for key, sec in out.items():
        if not isinstance(sec, dict) or "timing" not in sec:
            continue
        L.append(f"\n{key}: {sec['rows']} rows, {sec['bytes'] / 1e6:.1f} MB, 8 receive buffers on this GPU "
                 f"({sec['seconds']:.0f} s)")
        for name, probs in sec["check"].items():
            L.append(f"  check {name:<38} {'byte-exact, counts exact twice, state reset' if not probs else 'FAILED'}")
            L += [f"    {p}" for p in probs]
        passes = sec["timing"]
        copy = [p["rows"]["cuMemcpyDtoDAsync"]["median_us"] for p in passes]
        L.append(f"  {'median us (' + str(len(passes)) + ' passes)':<44} {'pass 1':>8} {'pass 2':>8}  / copy (pass 1)")
        for name in passes[0]["rows"]:
            us = [p["rows"][name]["median_us"] if name in p["rows"] else float("nan") for p in passes]
            cfg = passes[0]["rows"][name].get("config", "")
            L.append(f"  {name + (' [' + cfg + ']' if cfg else ''):<44} " + " ".join(f"{u:8.1f}" for u in us)
                     + f"  {us[0] / copy[0]:6.3f}")
            for v, m in passes[0]["rows"][name].get("variants", {}).items():
                L.append(f"      {v:<40} {m:8.1f}  {m / copy[0]:6.3f}")
        for name, why in passes[0]["skipped"].items():
            L.append(f"  {name}: skipped: {why}")
    return "\n".join(L)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    ok, why = driver.available()
    if not ok:
        print(f"no usable GPU here ({why}); nothing to check.")
        return 0
    dev = driver.device()
    try:
        import torch
        torch = torch if torch.cuda.is_available() else None
    except ImportError:
        torch = None
    seed = a.seed if a.seed is not None else secrets.randbits(31)
    print(f"[seed] {seed}  device {dev.name}, torch {'yes' if torch else 'no'}, "
          f"triton {baselines.triton_version() or 'no'}", flush=True)
    out = check_baselines(dev, seed, torch, iters=a.iters, warmup=a.warmup)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    print(table(out))
    bad = any(out["families"].values()) or any(
        any(v for v in sec["check"].values()) for sec in out.values() if isinstance(sec, dict) and "check" in sec)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
