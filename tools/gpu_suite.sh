#!/usr/bin/env bash
# The GPU tier in one command: PTX check, GPU tests, compute-sanitizer (memcheck and
# racecheck over tests/gpu/sanitize.py, sanitize_fp8.py and sanitize_wire.py), the main job, the benchmarks and the SASS of every kernel. Writes its logs
# to LOGDIR (suite.log, bench.json, sass.txt) and prints a summary at the end.
#
#   tools/gpu_suite.sh LOGDIR [stage ...]     stages: ptx tests multi sanitize demo bench sass
#                                             (default: all; multi skips without 2 GPUs)
#
# Every stage has a wall-clock bound: the pytest stages per test (--timeout), the sanitizer, demo
# and bench stages as a whole (P3_STAGE_TIMEOUT seconds, default 900, then SIGKILL 30 s later): a
# hung spin-wait under the sanitizer ends the stage, whose rc (124, or 137 if it ignored SIGTERM)
# and "timed out" the summary shows, and the suite goes on with the next stage.
set -u
LOG=${1:?usage: tools/gpu_suite.sh LOGDIR [stage ...]}
shift
STAGES=${*:-ptx tests multi sanitize demo bench sass}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
mkdir -p "$LOG"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 CUDA_CACHE_DISABLE=1
# p3send never uses NVLink multicast (NVLS); keep NCCL, torch and NVSHMEM off it too, so a shared
# multi-GPU host is not put at risk by the comparisons
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
LIMIT=${P3_STAGE_TIMEOUT:-900}
SUITE="$LOG/suite.log"
: > "$SUITE"
declare -a SUMMARY

stage() {  # stage NAME CMD...: run, tee into the log, remember the status
  local name=$1; shift
  echo "===== $name: $*" | tee -a "$SUITE"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$SUITE"
  local rc=${PIPESTATUS[0]}
  local note=""
  if [[ $1 == timeout && ( $rc == 124 || $rc == 137 ) ]]; then
    note="  TIMED OUT (over ${LIMIT}s)"
    echo "===== $name: timed out after ${LIMIT}s (rc $rc)" | tee -a "$SUITE"
  fi
  SUMMARY+=("$(printf '%-10s rc=%-3s %4ss  %s%s' "$name" "$rc" $((SECONDS - t0)) "$*" "$note")")
}

bounded() {  # bounded NAME CMD...: a stage killed when it runs past LIMIT seconds
  local name=$1; shift
  stage "$name" timeout -k 30 "$LIMIT" "$@"
}

want() { [[ " $STAGES " == *" $1 "* ]]; }

{ nvidia-smi; nvidia-smi topo -m; } >> "$SUITE" 2>&1
want ptx && stage ptx $PY -m p3send check-ptx
want tests && stage tests $PY -m pytest ${P3_TESTS:-tests/gpu} -q -rs -p no:cacheprovider --timeout=900
if want sanitize; then
  bounded memcheck compute-sanitizer --tool memcheck --error-exitcode 99 $PY -m tests.gpu.sanitize
  bounded racecheck compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 99 $PY -m tests.gpu.sanitize
  bounded memcheck_fp8 compute-sanitizer --tool memcheck --error-exitcode 99 $PY -m tests.gpu.sanitize_fp8
  bounded racecheck_fp8 compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 99 $PY -m tests.gpu.sanitize_fp8
  bounded memcheck_wire compute-sanitizer --tool memcheck --error-exitcode 99 $PY -m tests.gpu.sanitize_wire
  bounded racecheck_wire compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 99 $PY -m tests.gpu.sanitize_wire
  # NVSHMEM's start-up builds an NCCL communicator for its teams when it finds libnccl, and under
  # the sanitizer NCCL's probing of its own kernels outlasted 35 s: the put path needs no NCCL
  LIMIT=${P3_NVSHMEM_SANITIZE_TIMEOUT:-$LIMIT} bounded memcheck_nvshmem env NVSHMEM_DISABLE_NCCL=1 \
    compute-sanitizer --tool memcheck --error-exitcode 99 $PY -m tests.gpu.sanitize_nvshmem
fi
want multi && stage multi $PY -m pytest tests/multi_gpu -q -rs -p no:cacheprovider --timeout=900
want demo && bounded demo $PY -m p3send demo
want demo && bounded demo_procs $PY -m p3send demo --procs --ranks 4 --tokens 128
want bench && bounded bench $PY -m p3send bench --json "$LOG/bench.json"
if want sass; then
  : > "$LOG/sass.txt"
  for f in ptx/*.ptx; do
    grep -q '\.entry' "$f" || continue
    arch=$(sed -n 's/^\.target \(sm_[0-9a-z]*\).*/\1/p' "$f" | head -1)
    ptxas -arch="$arch" -v "$f" -o "$LOG/k.cubin" >> "$LOG/sass.txt" 2>&1 && \
      cuobjdump -sass "$LOG/k.cubin" >> "$LOG/sass.txt" 2>&1
  done
  rm -f "$LOG/k.cubin"
  SUMMARY+=("sass       written to $LOG/sass.txt")
fi
echo "===== summary" | tee -a "$SUITE"
printf '%s\n' "${SUMMARY[@]}" | tee -a "$SUITE"
