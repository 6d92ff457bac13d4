#!/usr/bin/env bash
# The 350m loss-parity run of issue 16 on one GPU: torch AdamW against CoatAdamW + FP8
# activations + FP8 linears, one process per seed, all at once (the processes share the GPU,
# so their tokens/s are not throughput figures), then the paired summary over the seeds.
#   SEEDS="1337 1338 1339" COMPILE=1 OUT=$OUT/parity bash bench/parity_gpu.sh
set -euo pipefail
SEEDS=${SEEDS:-"1337 1338 1339"}
VARIANTS=${VARIANTS:-adamw,coat_fp8}
OUT=${OUT:-results/parity}
mode=eager; flag=""
if [ "${COMPILE:-0}" = 1 ]; then mode=compiled; flag=--compile; fi
mkdir -p "$OUT"
for s in $SEEDS; do
    python bench/loss_parity.py --preset 350m --steps 600 --batch-size 12 --seq-len 1024 --lr 3e-4 \
        --warmup 60 --device cuda --variants "$VARIANTS" $flag --seed "$s" --log-interval 100 \
        --out "$OUT/${mode}_seed$s" > "$OUT/${mode}_seed$s.log" 2>&1 &
done
fail=0
for job in $(jobs -p); do wait "$job" || fail=1; done
[ "$fail" = 0 ] || { tail -n 30 "$OUT"/${mode}_seed*.log; exit 1; }
python bench/parity_summary.py "$OUT"/${mode}_seed*.json
