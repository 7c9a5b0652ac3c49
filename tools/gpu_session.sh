#!/usr/bin/env bash
# One call on the lent GPU machine: a part of the `gpu` tests, then the benchmarks; logs under $OUT.
#
#   bash tools/gpu_session.sh part 1/4      det-core and det-train `gpu` tests
#   bash tools/gpu_session.sh part 2/4      det-attn `gpu` tests but the sliding-window / soft-cap ones
#   bash tools/gpu_session.sh part 3/4      det-attn's sliding-window / soft-cap tests, adamw-sr
#   bash tools/gpu_session.sh part 4/4      the end-to-end `gpu` tests (main job, transformers, families)
#   bash tools/gpu_session.sh all           the whole `gpu` suite in one call (4 pytest-xdist workers)
#   bash tools/gpu_session.sh [pytest paths or options]     any selection
#
# The four parts together are the whole `gpu` suite, each sized to fit one device call (10 minutes)
# with margin on a fresh machine (which compiles every kernel first); each prints a one-line
# summary last. `all` runs the whole suite in WORKERS (default 4) pytest-xdist workers sharing the
# one GPU: a fresh machine's time is mostly Triton compiling, on the CPUs, so it fits one call
# (462 s on a fresh H200, run 20; six workers were slower there: cut at 430 s with 7 tests left;
# pytest-xdist carried in .whl where the machine lacks it).
# WORKERS=N runs any selection in N workers. TESTS=0 skips the tests;
# BENCH=adamw,matmul runs those benchmarks after them. Carry .whl (wheels) and .peers (peer
# libraries) where needed.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/.peers:$PWD/shared/det-core:$PWD/packages/adamw-sr/torch-ext:$PWD/packages/det-train/torch-ext:$PWD/packages/det-attn/torch-ext:$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
label=custom
if [ "${1:-}" = part ]; then
  label="part $2"
  case "$2" in
    1/4) set -- shared/det-core packages/det-train ;;
    2/4) set -- packages/det-attn -k "not window and not softcap" ;;
    3/4) set -- packages/det-attn packages/adamw-sr -k "window or softcap or adamw" ;;
    4/4) set -- tests ;;
    *) echo "gpu_session.sh: unknown part '$2' (use 1/4, 2/4, 3/4 or 4/4; or: gpu_session.sh all)" >&2; exit 2 ;;
  esac
elif [ "${1:-}" = all ]; then
  label="whole suite"
  WORKERS=${WORKERS:-4}
  set -- shared/det-core packages tests
fi
if [ -n "${WORKERS:-}" ] && ! python3 -c "import xdist" 2>/dev/null; then
  echo "gpu_session.sh: WORKERS=$WORKERS needs pytest-xdist; carry its wheel and execnet's in .whl" \
    "(python3 -m pip download --no-deps -d .whl pytest-xdist execnet), or run the parts" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
rc=0
if [ "${TESTS:-1}" = 1 ]; then
  log="$OUT/gpu_tests_${label//[ \/]/_}.log"
  timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -m gpu -p no:cacheprovider -q -rfEs --timeout 240 \
    --durations=15 ${WORKERS:+-n "$WORKERS"} "$@" >"$log" 2>&1
  rc=$?
  grep -vE "PASSED|^\.+( |$)|^[.sFE]+ +\[" "$log" | tail -60
  summary=$(grep -E "^=*.*(passed|failed|error).* in [0-9.]+s" "$log" | tail -1 | tr -d '=')
  if [ "$rc" = 124 ]; then  # results so far: -v lines, or the progress characters of -q / xdist
    marks=$(grep -E '^[.sFExX]+( +\[ *[0-9]+%\])?$' "$log" | sed -E 's/ +\[.*//' | tr -d '\n')
    verbose=$(grep -cE '(PASSED|FAILED)' "$log")
    reported=$(( ${#marks} > verbose ? ${#marks} : verbose ))
    bad=$(( $(printf '%s' "$marks" | tr -cd 'FE' | wc -c) + $(grep -cE 'FAILED|ERROR' "$log") ))
    summary="cut at ${TEST_TIMEOUT:-540} s: $reported tests reported, $bad failed or errored"
  fi
  echo "gpu suite, $label (git ${GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null)}): ${summary:-no summary, rc $rc}"
fi
if [ -n "${BENCH:-}" ]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 tools/run_benchmarks.py --out "$OUT" --only "$BENCH" 2>&1 | tee "$OUT/bench.log" | tail -80
fi
exit $rc
