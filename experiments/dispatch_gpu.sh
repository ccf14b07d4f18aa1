#!/bin/bash
# The dispatch's checks and figures in one short GPU run (issue 29): the GPU tests of the dispatch,
# memcheck of a reduced set, the bench section `dispatch` (both shapes), the variants' A/B
# (experiments/dispatch_ab2.py: PDL, the wait launch, the quiet send, fbb32ce's count kernel, the
# count kernel's phases). The torch dispatch tests (tests/gpu/test_torch_dispatch.py) are left out.
#   bash experiments/dispatch_gpu.sh LOGFILE        (from the repository root, on a machine with a GPU)
exec > "$1" 2>&1
export PYTHONPATH=$PWD:${PYTHONPATH}
PY=${PYTHON:-python3}
date -u
echo "== GPU tests: tests/gpu/test_dispatch.py (the one-process-per-rank pair left out)"
timeout -s INT -k 5 40 $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_dispatch.py -k "not one_process_per_rank" 2>&1 | tail -25
echo "== tests rc ${PIPESTATUS[0]} at ${SECONDS}s"
echo "== memcheck (tests.gpu.sanitize dispatch-quick)"
timeout -s INT -k 5 12 compute-sanitizer --tool memcheck --error-exitcode 99 $PY -m tests.gpu.sanitize dispatch-quick 2>&1 | tail -16
echo "== memcheck rc ${PIPESTATUS[0]} at ${SECONDS}s"
echo "== bench --only dispatch"
timeout -s INT -k 5 30 $PY -m p3send bench --only dispatch --iters 30 --warmup 6 --json /tmp/disp_b4.json 2>&1 | tail -40
echo "== bench rc ${PIPESTATUS[0]} at ${SECONDS}s"
echo "== experiment"
left=$((96 - SECONDS))
if [ $left -gt 8 ]; then
  timeout -s INT -k 3 $left $PY experiments/dispatch_ab2.py --cases decode_bf16,decode_fp8,prefill_fp8 --rounds 6 --budget $((left - 9))
  echo "== experiment rc $? at ${SECONDS}s"
fi
date -u
