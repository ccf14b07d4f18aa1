"""Small runs of the shipped senders' NVSHMEM put path for compute-sanitizer (memcheck): one PE,
every row by puts (FLAG_NVSHMEM_ALL) through p3_scatter_send_fp8 on both wires (bf16: from the
shared tile and staged) and through
p3_epilogue_send, and the receive of a self-put round; each byte-exact against the oracle (the
checks of tests/gpu/test_nvshmem.py). Exits non-zero if a result is wrong, 0 with a line saying
why when the transport is not installed; the sanitizer's --error-exitcode reports memory errors.

    NVSHMEM_DISABLE_NVLS=1 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo \\
        compute-sanitizer --tool memcheck --error-exitcode 99 python -m tests.gpu.sanitize_nvshmem [quick]

(``quick``: the first two cases only.)
"""
from __future__ import annotations

import os
import sys


def main() -> int:
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")
    from p3send.cuda import driver
    from p3send.cuda.nvshmem_link import NvshmemUnavailable
    from p3send.ops import nvshmem
    from p3send.ops.exchange import ProcessExchange
    from tests.gpu import test_nvshmem as t
    try:
        nvshmem.bindings()
    except NvshmemUnavailable as e:
        print(f"sanitize_nvshmem: skipped, no NVSHMEM transport here: {e}")
        return 0
    w = nvshmem.NvshmemWorld(ProcessExchange(1).bind(0), device=driver.device())
    failed = 0
    quick = sys.argv[1:] == ["quick"]          # one case: a sanitizer's NVSHMEM start-up alone is long
    runs = [(t.test_shipped_scatter_send_puts_every_row_to_this_pe, ("random", "fp8", False)),
            (t.test_shipped_scatter_send_puts_every_row_to_this_pe, ("bad_src_info", "bf16", False)),
            (t.test_shipped_scatter_send_puts_every_row_to_this_pe, ("unrouted", "bf16", True)),
            (t.test_shipped_epilogue_send_puts_every_row_to_this_pe, ("masked_experts", "fp8")),
            (t.test_the_receive_reduces_a_self_put_round_exactly, ("bf16",))][: 2 if quick else None]
    try:
        for fn, args in runs:
            try:
                fn(w, *args)
                print(f"ok   {fn.__name__}{args}")
            except AssertionError as e:
                failed += 1
                print(f"FAIL {fn.__name__}{args}: {e}")
    finally:
        w.finalize()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
