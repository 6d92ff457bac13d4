# train.py under FSDP2, 1b preset, compiled: a torch.profiler trace of steps 11-13 of each side, then
# bench/fp8_linear.py --gaps (categories, kernels, idle by launching op and by what the host ran).
#   bash bench/device_env.sh bash results/2026-11-27/fsdp2_1b/trace.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/tr
for side in "bf16_zero3:" "coat_zero3:--fp8-linear"; do
  j=${side%%:*}; fl=${side#*:}
  timeout 170 python -m torch.distributed.run --nproc_per_node 1 train.py --fsdp --config configs/1b.yaml --compile \
    --max-steps 14 --deepspeed ds_configs/$j.json $fl --trace /tmp/tr/$j.json.gz --trace-after 10 > $OUT/$j.trace.log 2>&1
  python bench/fp8_linear.py --gaps /tmp/tr/$j.json.gz --top 14 > $OUT/gaps_$j.txt 2>&1
done
for j in bf16_zero3 coat_zero3; do echo "== $j"; head -9 $OUT/gaps_$j.txt; sed -n '/^GPU span/,$p' $OUT/gaps_$j.txt | grep -v "^| ---" ; done
