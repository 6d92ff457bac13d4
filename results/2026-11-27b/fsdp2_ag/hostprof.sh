# The host's Python time over 3 steps (11-13) of train.py under FSDP2, 1b, compiled, one GPU:
# coat --fp8-linear with and without --fp8-all-gather (cProfile; see hostprof.py).
# From the repo root:  bash bench/device_env.sh bash results/2026-11-27b/fsdp2_ag/hostprof.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for fl in "" "--fp8-all-gather"; do
  name=prof${fl// /_}
  timeout 200 python results/2026-11-27b/fsdp2_ag/hostprof.py --fsdp --config configs/1b.yaml --compile \
    --deepspeed ds_configs/coat_zero3.json --fp8-linear $fl --max-steps 14 --trace "$OUT/$name.txt" --trace-after 10 \
    > "$OUT/$name.log" 2>&1
  echo "== coat --fp8-linear $fl"; grep -E "^step 14/" "$OUT/$name.log"; sed -n 1,30p "$OUT/$name.txt"
done
