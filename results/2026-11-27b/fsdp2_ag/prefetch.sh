# train.py under FSDP2, one GPU, 1b preset, compiled, 30 steps, 2 rounds alternating (the last
# window's tokens/s): the BF16 JSON and coat --fp8-linear, each with FSDP2 forward prefetch, and
# coat --fp8-linear --fp8-all-gather with and without it.
# From the repo root:  bash bench/device_env.sh bash results/2026-11-27b/fsdp2_ag/prefetch.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
run() { timeout 150 python -m torch.distributed.run --nproc_per_node 1 train.py --fsdp --config configs/1b.yaml --compile "$@"; }
nvidia-smi --query-gpu=name --format=csv,noheader; python -c "import torch; print(torch.__version__)"
for round in 1 2; do
  for side in "bf16_zero3:--fsdp-forward-prefetch" "coat_zero3:--fp8-linear --fsdp-forward-prefetch" \
              "coat_zero3:--fp8-linear --fp8-all-gather --fsdp-forward-prefetch" "coat_zero3:--fp8-linear --fp8-all-gather"; do
    j=${side%%:*}; fl=${side#*:}; log="$OUT/r${round}_${j}_${fl// /_}.log"
    run --max-steps 30 --deepspeed ds_configs/$j.json $fl > "$log" 2>&1
    grep -E "^step 30/" "$log" | sed "s|^|round $round $j $fl: |"; grep -E "Error|error" "$log" | head -3
  done
done
