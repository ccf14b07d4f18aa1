"""The benchmark as a library: what ``p3send bench`` measures, apart from its command line.

Modules: ``timing`` (``Timer``: event-timed loops, timing in turns), ``data`` (random inputs),
``baselines`` (the comparison kernels: Triton and CUDA C++ scatters, the copy, scatter and
reduce ceilings; their CUDA C++ in ``kernels/baselines.cu``), one module per section or
family of sections (``send``: prefill, decode_send, budget; ``decode``: the round and its
ceilings; ``latency``: latency, host; ``epilogue``; ``two_gpu``; ``gemm``), ``registry`` (the
sections in order, ``SECTIONS``, ``run``) and ``report`` (the table).

Adding a section (e.g. ``dispatch``): write ``p3send/bench/dispatch.py`` with

    def run(ctx, out: dict) -> None:     # measure; store the results under out["dispatch"]
    def table(out: dict) -> str:         # its part of the table ("" when out has none)

(``ctx`` is a ``registry.Context``: the options, the device, the seeded rng, torch or None, a
stream), then add one line to ``registry.REGISTRY``: ``Section("dispatch", dispatch.run,
dispatch.table)``. ``--only`` offers every registered name; ``report.render`` prints the
parts in registry order. A ``table`` must render from the recorded JSON alone (the CPU tests
render a recorded results file without a GPU).

The bench imports the runtime (abi, cuda, ops) and the oracle, never ``p3send.cli``; nothing
in the runtime imports it. Importing any module here touches no GPU and imports neither
torch nor Triton.
"""
