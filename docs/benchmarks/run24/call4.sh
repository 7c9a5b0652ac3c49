#!/usr/bin/env bash
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONPATH=$PWD/shared/det-core:$PWD/packages/adamw-sr/torch-ext:$PWD/packages/det-train/torch-ext:$PWD/packages/det-attn/torch-ext:$PWD:$PYTHONPATH
export PYTHONUNBUFFERED=1
T0=$SECONDS
timeout 95 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --timeout 90 -n 4 \
  packages/det-train/tests/test_compile.py packages/det-train/tests/test_fixed_folds.py > "$OUT/b_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/b_tests.log" | grep -v DEBUG | head -12
echo "== bench [t=$((SECONDS-T0))]"
timeout 115 python3 examples/bench_step.py --compile --compile-warmup 2 --rep-ms 200 \
  --warmup-ms 30 --no-bits-check --fixed-folds --compile-micro-batches 8 --out "$OUT/c1" > "$OUT/c1.log" 2>&1
grep -vE "^W[0-9]{4}" "$OUT/c1.log" | grep -E "^\||rror:" | tail -8
echo "done t=$((SECONDS-T0))"
