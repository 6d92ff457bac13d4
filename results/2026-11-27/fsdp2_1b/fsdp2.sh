# train.py under FSDP2, one GPU, 1b preset, compiled, 30 steps; BF16 JSON vs coat --fp8-linear,
# 3 rounds alternating (the last window's tokens/s), then a torch.profiler trace of steps 11-13
# of each side and its category/gap table. Run from the repo root:
#   bash bench/device_env.sh bash results/2026-11-27/fsdp2_1b/fsdp2.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/tr
run() { timeout 170 python -m torch.distributed.run --nproc_per_node 1 train.py --fsdp --config configs/1b.yaml --compile "$@"; }
for round in 1 2 3; do
  for side in "bf16_zero3:" "coat_zero3:--fp8-linear"; do
    j=${side%%:*}; fl=${side#*:}
    run --max-steps 30 --deepspeed ds_configs/$j.json $fl 2>&1 | grep -E "^step 30/" | sed "s|^|round $round $j $fl: |"
  done
done
for side in "bf16_zero3:" "coat_zero3:--fp8-linear"; do
  j=${side%%:*}; fl=${side#*:}
  run --max-steps 14 --deepspeed ds_configs/$j.json $fl --trace /tmp/tr/$j.json.gz --trace-after 10 > $OUT/$j.trace.log 2>&1
  echo "== $j"; python bench/fp8_linear.py --gaps /tmp/tr/$j.json.gz 2>&1 | tail -25
done
