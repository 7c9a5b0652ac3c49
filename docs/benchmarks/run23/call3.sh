#!/usr/bin/env bash
# session 8, call 3: adamw-sr states kernel, main (a8d9368) vs h-eightbit3 (631854a), same machine, alternated; fold sweep again
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
BASE=/tmp/site:$PWD/packages/det-train/torch-ext:$PWD/packages/det-attn/torch-ext:$PWD
MAIN=$PWD/shared/det-core:$PWD/packages/adamw-sr/torch-ext:$BASE
EB=$PWD/.devscripts/eb/shared/det-core:$PWD/.devscripts/eb/packages/adamw-sr/torch-ext:$BASE
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
T0=$SECONDS
for round in 1 2; do
  for v in main eb; do
    if [ $v = main ]; then P=$MAIN; S=packages/adamw-sr/benchmarks/bench_adamw.py; else P=$EB; S=.devscripts/eb/packages/adamw-sr/benchmarks/bench_adamw.py; fi
    PYTHONPATH=$P timeout 100 python3 $S --states-only --out "$OUT/${v}_$round" > "$OUT/${v}_$round.log" 2>&1
    echo "== $v round $round rc $? ($((SECONDS-T0)) s)"; grep -E "AdamWSR|torch AdamW" "$OUT/${v}_$round/adamw-sr_states.md" 2>/dev/null | head -4 || tail -5 "$OUT/${v}_$round.log"
  done
done
PYTHONPATH=$MAIN timeout 60 python3 packages/det-train/benchmarks/ablate_fold.py --out "$OUT" --budget 35 --no-accumulator > "$OUT/fold.log" 2>&1
echo "fold rc $? ($((SECONDS-T0)) s)"; grep -E "^  \* |128x128 w8 s3 g8 |64x128 w4 s3 g8 |best|cuBLAS peer" "$OUT/fold.log" | head -20
