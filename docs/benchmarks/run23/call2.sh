#!/usr/bin/env bash
# session 8, call 2: the 6 tests that failed at 54511bb, at a8d9368; memory table; fold sweep
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONPATH=$PWD/shared/det-core:$PWD/packages/adamw-sr/torch-ext:$PWD/packages/det-train/torch-ext:$PWD/packages/det-attn/torch-ext:$PWD:$PYTHONPATH
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
t0=$SECONDS
timeout 220 python3 -m pytest -m gpu -p no:cacheprovider -q -rfEs --timeout 200 -n 3 \
  packages/det-train/tests/test_embedding.py::test_gpu_cuda_graph_capture_with_accumulator_equals_eager \
  tests/test_e2e_cuda_graph.py::test_gpu_captured_det_step_replays_to_the_eager_bits \
  tests/test_model_families.py -k "realistic or captured or cuda_graph" > "$OUT/rerun.log" 2>&1
echo "rerun rc $? ($((SECONDS-t0)) s):"; grep -E "passed|failed" "$OUT/rerun.log" | tail -3; grep -E "^FAILED|^E " "$OUT/rerun.log" | head -20
t0=$SECONDS
timeout 230 python3 examples/bench_memory.py --out "$OUT" --setups torch,torch_main_grad,det_bf16,det_bf16_one_leaf > "$OUT/memory.log" 2>&1
echo "memory rc $? ($((SECONDS-t0)) s)"; cat "$OUT/main-job_memory.md" 2>/dev/null | head -60 || tail -20 "$OUT/memory.log"
t0=$SECONDS
timeout 120 python3 packages/det-train/benchmarks/ablate_fold.py --out "$OUT" --budget 80 > "$OUT/fold.log" 2>&1
echo "fold rc $? ($((SECONDS-t0)) s)"; tail -30 "$OUT/fold.log"
