# train.py under FSDP2, one GPU, 1b preset, compiled, 30 steps: BF16 JSON vs coat --fp8-linear
# with and without --fp8-fuse-siblings (w_gate/w_up in one GEMM), two rounds alternating.
#   SKIP_WHEELS=1 bash bench/device_env.sh bash results/2026-11-27c/siblings/fsdp2.sh
run() { timeout 170 python -m torch.distributed.run --nproc_per_node 1 train.py --fsdp --config configs/1b.yaml --compile "$@"; }
for round in 1 2; do
  for side in "bf16_zero3:" "coat_zero3:--fp8-linear" "coat_zero3:--fp8-linear --fp8-fuse-siblings"; do
    j=${side%%:*}; fl=${side#*:}
    run --max-steps 30 --deepspeed ds_configs/$j.json $fl 2>&1 | grep -E "^step 30/|Error|error" | tail -3 | sed "s|^|round $round $j $fl: |"
  done
done
