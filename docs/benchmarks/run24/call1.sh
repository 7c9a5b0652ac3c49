#!/usr/bin/env bash
# Device call: (a) h-fixed-folds' gpu tests with traced kernels off; (b) test_compile with them on;
# (c) the compile table (default mode, fixed folds, 8 micro-batches) with traced kernels on, then off.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONPATH=$PWD/shared/det-core:$PWD/packages/adamw-sr/torch-ext:$PWD/packages/det-train/torch-ext:$PWD/packages/det-attn/torch-ext:$PWD:$PYTHONPATH
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
T0=$SECONDS
echo "== (a) gpu tests, DET_TRACE_KERNELS=0 (git ${GIT_REV:-?})"
DET_TRACE_KERNELS=0 timeout 180 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --timeout 190 -n 4 --durations=5 \
  packages/det-train/tests/test_fixed_folds.py packages/det-train/tests/test_compile.py \
  packages/det-train/tests/test_cross_entropy.py > "$OUT/a_tests.log" 2>&1
grep -vE "PASSED|^\.+( |$)" "$OUT/a_tests.log" | tail -25
echo "== (b) test_compile + fixed folds gpu, traced kernels on  [t=$((SECONDS-T0))]"
timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --timeout 160 -n 4 --durations=5 \
  packages/det-train/tests/test_compile.py packages/det-train/tests/test_fixed_folds.py shared/det-core/tests/test_traced_launch.py packages/det-attn/tests/test_attention_compile.py > "$OUT/b_tests.log" 2>&1
grep -vE "PASSED|^\.+( |$)" "$OUT/b_tests.log" | tail -40
for tk in 1 0; do
  echo "== (c) compile table, 8 mb, fixed folds, DET_TRACE_KERNELS=$tk  [t=$((SECONDS-T0))]"
  DET_TRACE_KERNELS=$tk timeout 110 python3 examples/bench_step.py --compile --compile-warmup 3 --rep-ms 300 \
    --warmup-ms 50 --no-bits-check --fixed-folds --compile-micro-batches 8 --out "$OUT/c$tk" > "$OUT/c$tk.log" 2>&1
  grep -vE "^W[0-9]{4}" "$OUT/c$tk.log" | grep -E "^\||rror|Exception" | tail -12
done
echo "done t=$((SECONDS-T0))"
