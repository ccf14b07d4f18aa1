#!/bin/bash
# disp, batch 2 (issue 29): the shipped all-ranks dispatch checked (GPU tests, memcheck of a
# reduced set) and its variants timed in turns (experiments/dispatch_ab2.py).
#   bash experiments/dispatch_b2.sh LOGFILE        (from the repository root, on the GPU machine)
exec > "$1" 2>&1
export PYTHONPATH=$PWD:${PYTHONPATH}
PY=${PYTHON:-python3}
date -u
echo "== GPU tests (dispatch, torch dispatch; the one-process-per-rank pair left out)"
timeout -s INT -k 5 34 $PY -m pytest -q -x -p no:cacheprovider tests/gpu/test_dispatch.py tests/gpu/test_torch_dispatch.py \
    -k "not one_process_per_rank" 2>&1 | tail -30
echo "== tests rc ${PIPESTATUS[0]} at ${SECONDS}s"
echo "== memcheck (tests.gpu.sanitize dispatch-quick)"
timeout -s INT -k 5 26 compute-sanitizer --tool memcheck --error-exitcode 99 $PY -m tests.gpu.sanitize dispatch-quick 2>&1 | tail -25
echo "== memcheck rc ${PIPESTATUS[0]} at ${SECONDS}s"
echo "== experiment"
timeout -s INT -k 5 $((96 - SECONDS)) $PY experiments/dispatch_ab2.py --cases decode_bf16,decode_fp8,prefill_fp8 --rounds 8 --budget $((85 - SECONDS))
echo "== experiment rc $? at ${SECONDS}s"
date -u
