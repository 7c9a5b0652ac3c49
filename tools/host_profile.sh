#!/usr/bin/env bash
# One call on the lent GPU machine: where an eager det step's host time goes (issue: host path).
#   bash tools/host_profile.sh [micro-batches...]     default: 8 16
# Writes under $OUT: host_time_<mb>.txt (examples/host_time.py: host vs wall, cProfile by own time,
# launch costs), pyspy_<mb>.txt (py-spy --native collapsed stacks, when py-spy is carried in .whl
# and may sample here), bench_eager.md (bench_step.py eager rows at 2, 8, 16 micro-batches).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=$PWD/shared/det-core:$PWD/packages/adamw-sr/torch-ext:$PWD/packages/det-train/torch-ext:$PWD/packages/det-attn/torch-ext:$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
counts=${*:-8 16}
for mb in $counts; do
  timeout 150 python3 examples/host_time.py --micro-batches "$mb" --impl torch,det --top 70 --parts step >"$OUT/host_time_$mb.txt" 2>&1
  grep -E "^##|host|wall" "$OUT/host_time_$mb.txt" | head -12
done
if command -v py-spy >/dev/null; then
  for mb in $counts; do
    timeout 120 py-spy record --native --rate 500 --format raw -o "$OUT/pyspy_$mb.txt" -- \
      python3 examples/host_time.py --micro-batches "$mb" --impl det --top 0 --parts step >"$OUT/pyspy_$mb.log" 2>&1
    echo "py-spy $mb: rc $? $(tail -2 "$OUT/pyspy_$mb.log" | tr '\n' ' ')"
  done
fi
timeout 200 python3 examples/host_time.py --micro-batches 16 --impl det --top 0 --parts launch >"$OUT/launch.txt" 2>&1; tail -20 "$OUT/launch.txt"
timeout 240 python3 examples/bench_step.py --counts 2,8,16 --no-graph --out "$OUT/bench" >"$OUT/bench.log" 2>&1; tail -25 "$OUT/bench.log"
