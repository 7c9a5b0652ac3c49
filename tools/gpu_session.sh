#!/usr/bin/env bash
# One full call on the lent GPU machine: the `gpu` tests, then the benchmarks; logs under $OUT.
# Usage (device tool, carry .whl and .peers): bash tools/gpu_session.sh [pytest paths] ; BENCH=adamw,matmul to filter
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/.peers:$PWD/shared/det-core:$PWD/packages/adamw-sr/torch-ext:$PWD/packages/det-train/torch-ext:$PWD/packages/det-attn/torch-ext:$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -p no:cacheprovider -q -rfE --timeout 240 "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
fi
if [ -n "${BENCH:-}" ]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 tools/run_benchmarks.py --out "$OUT" --only "$BENCH" 2>&1 | tee "$OUT/bench.log" | tail -80
fi
