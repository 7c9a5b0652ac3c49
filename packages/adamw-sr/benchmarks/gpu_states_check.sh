#!/usr/bin/env bash
# One GPU call that checks and measures adamw-sr's bf16- and 8-bit-moment step kernels (at most 7.5 min):
#   1. the adamw-sr GPU tests (bits against reference.py, shard invariance, resume, AMP, ...);
#   2. the state kernels' launch candidates side by side (ablate_adamw.py --states, 602M set): bits checked
#      against S0 and S0 against reference.py, ms and x floor per candidate, the best per format;
#   3. bench_adamw.py's state_dtype table (602M set, with the peers where installed);
#   4. bench_adamw.py --quick (2,000 small tensors: step(), kernel, CUDA graph, torch, optimi).
# Run from the repository root with det-core and the packages on the path, e.g.
#   PYTHONPATH=shared/det-core:packages/adamw-sr/torch-ext bash packages/adamw-sr/benchmarks/gpu_states_check.sh OUT
# Writes OUT/{pytest.txt, adamw-sr_states_ablation.{md,json}, adamw-sr_states.{md,json},
# adamw-sr_adamw.{md,json}}; the summary is printed at the end. A failing step is reported, the next ones still run.
set -u
OUT=${1:-${OUT:-/tmp/adamw_sr_states_check}}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python}
status=()

per_test=()
if $PY -c "import pytest_timeout" 2>/dev/null; then per_test=(--timeout=100); fi
timeout 150 $PY -m pytest -m gpu packages/adamw-sr/tests -v -p no:cacheprovider "${per_test[@]}" \
    > "$OUT/pytest.txt" 2>&1
status+=("gpu tests: rc $? ($(tail -1 "$OUT/pytest.txt"))")

timeout 150 $PY "$HERE/ablate_adamw.py" --states --no-small --out "$OUT" > "$OUT/ablation_log.txt" 2>&1
status+=("states ablation: rc $?")

timeout 80 $PY "$HERE/bench_adamw.py" --states-only --out "$OUT" > "$OUT/bench_states_log.txt" 2>&1
status+=("bench --states-only: rc $?")

timeout 70 $PY "$HERE/bench_adamw.py" --quick --out "$OUT" > "$OUT/bench_quick_log.txt" 2>&1
status+=("bench --quick: rc $?")

echo "=== adamw-sr GPU tests (failures and errors) ==="
grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest.txt" | tail -15
echo "=== state kernels' candidates (ablate_adamw.py --states) ==="
cat "$OUT/adamw-sr_states_ablation.md" 2>/dev/null || tail -20 "$OUT/ablation_log.txt"
echo "=== state_dtype table (bench_adamw.py --states-only) ==="
cat "$OUT/adamw-sr_states.md" 2>/dev/null || tail -20 "$OUT/bench_states_log.txt"
echo "=== 2,000 small tensors (bench_adamw.py --quick) ==="
cat "$OUT/adamw-sr_adamw.md" 2>/dev/null || tail -20 "$OUT/bench_quick_log.txt"
echo "=== status ==="
printf '%s\n' "${status[@]}"
