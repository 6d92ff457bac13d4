# Llama-2-13B shape, DeepSpeed ZeRO-Offload with DeepSpeed's CPU Adam (the optimizer a user's
# offload JSON gets) at micro-batch 8, one H200 capped at 80 GB, every layer recomputed.
# Run: OUT=DIR bash bench/device_env.sh bash results/2026-11-28c/offload_13b_80gb.sh
set -u
OUT=${OUT:-/tmp/offload13b}; mkdir -p $OUT
python bench/scaling.py fit --preset 13b --recompute --gpu-memory-gb 80 --alloc-conf expandable_segments:True \
    --sides offload:8 --steps 4 --limit 330 --out $OUT 2>&1 | tail -4
grep -h -E "cpu_adam|CPUAdam|out of memory|Killed|Error|^step" $OUT/*.log | cut -c1-200 | tail -8
