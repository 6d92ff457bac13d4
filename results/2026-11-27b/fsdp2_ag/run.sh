# train.py under FSDP2, one GPU, 1b preset, compiled, 30 steps: the BF16 JSON, coat --fp8-linear,
# and coat --fp8-linear --fp8-all-gather, 2 rounds alternating (the last window's tokens/s); then
# a torch.profiler trace of steps 11-13 of the FP8-all-gather side and its category/gap table.
# From the repo root:  bash bench/device_env.sh bash results/2026-11-27b/fsdp2_ag/run.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/tr
run() { timeout 170 python -m torch.distributed.run --nproc_per_node 1 train.py --fsdp --config configs/1b.yaml --compile "$@"; }
nvidia-smi --query-gpu=name --format=csv,noheader; python -c "import torch; print(torch.__version__)"
for round in 1 2; do
  for side in "bf16_zero3:" "coat_zero3:--fp8-linear" "coat_zero3:--fp8-linear --fp8-all-gather"; do
    j=${side%%:*}; fl=${side#*:}
    run --max-steps 30 --deepspeed ds_configs/$j.json $fl > "$OUT/r${round}_${j}_${fl// /_}.log" 2>&1
    grep -E "^step 30/" "$OUT/r${round}_${j}_${fl// /_}.log" | sed "s|^|round $round $j $fl: |"
    grep -E "Error|error" "$OUT/r${round}_${j}_${fl// /_}.log" | head -3
  done
done
run --max-steps 14 --deepspeed ds_configs/coat_zero3.json --fp8-linear --fp8-all-gather --trace /tmp/tr/ag.json.gz --trace-after 10 > $OUT/ag.trace.log 2>&1
echo "== trace, coat --fp8-linear --fp8-all-gather"; python bench/fp8_linear.py --gaps /tmp/tr/ag.json.gz > $OUT/gaps_ag.txt 2>&1; head -24 $OUT/gaps_ag.txt
