# 1) bf16+8 master weights against FP32 masters: the 350m parity, compiled and
#    deterministic, one seed per GPU at once. 2) train.py FSDP2 7b micro-batch 6 compiled:
#    BF16 against --recipe speed with FP32 and with bf16+16 master weights.
# Run: bash bench/device_env.sh bash results/2026-11-28b/master_parity_fsdp2.sh  (OUT: output folder)
set -u
OUT=${OUT:-/tmp/master_parity}; mkdir -p $OUT/par
i=0
for seed in 1337 1338 1339 1340; do
    CUDA_VISIBLE_DEVICES=$i timeout 250 python bench/parity.py --preset 350m --steps 300 --batch-size 12 --seq-len 1024 \
        --lr 3e-4 --warmup 30 --device cuda --log-interval 100 --variants coat_fp8lin_head,coat_fp8lin_head_m8 \
        --compile --deterministic --pair-vocab 32000 --seeds $seed --out $OUT/par/seed$seed > $OUT/par/seed$seed.log 2>&1 &
    i=$((i + 1))
done
wait
grep -h "final train" $OUT/par/seed*.log
python bench/parity.py --summary $OUT/par/seed*.json --baseline coat_fp8lin_head 2>&1 | tail -8
TOK=$(python -c 'import sys; sys.path.insert(0, "bench"); import scaling; print(scaling.token_file(32000, 8_000_000))')
for spec in "bf16_mb6:bf16_zero3:" "coat_mb6:coat_zero3:--recipe speed" "coat_mb6_bf16m:coat_zero3:--recipe speed --master-weights bf16+16"; do
    name=${spec%%:*}; rest=${spec#*:}; json=${rest%%:*}; extra=${rest#*:}
    j=$(python -c "import sys; sys.path.insert(0, 'bench'); import scaling; print(scaling.with_micro_batch('$json', 6))")
    timeout 110 python -m torch.distributed.run --nproc_per_node $NGPU train.py --fsdp --deepspeed $j --preset 7b \
        --seq-len 2048 --max-steps 8 --warmup-steps 2 --log-interval 2 --eval-interval 0 --eval-batches 1 \
        --data $TOK --bin-dtype uint16 --compile --metrics-file $OUT/$name.jsonl $extra > $OUT/$name.log 2>&1
    echo "$name: exit $? | $(grep -E '^step 8/' $OUT/$name.log | cut -c1-150)"
done
