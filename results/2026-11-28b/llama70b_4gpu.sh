# Llama-2-70B shape (preset 70b), full parameters, seq 2048, FSDP2 on one 4-GPU node: coat
# with recipe max_memory and bf16+8 master weights, stepping in backward without clipping,
# for 20 steps; then BF16 + torch AdamW (the bf16 JSON) at micro-batch 1.
# Run: bash bench/device_env.sh bash results/2026-11-28b/llama70b_4gpu.sh  (OUT: output folder)
set -u
OUT=${OUT:-/tmp/llama70b}; mkdir -p $OUT
TOK=$(python -c 'import sys; sys.path.insert(0, "bench"); import scaling; print(scaling.token_file(32000, 8_000_000))')
json() {  # name micro -> path of the shipped JSON with that micro-batch and no clipping
    python -c "import sys; sys.path.insert(0, 'bench'); import scaling
print(scaling.with_micro_batch('$1', $2, '_noclip', lambda c: c.update(gradient_clipping=0.0)))"
}
run() {  # name json micro steps limit extra...
    local name=$1 j=$(json $2 $3) steps=$4 limit=$5; shift 5
    timeout $limit python -m torch.distributed.run --nproc_per_node $NGPU train.py --fsdp --deepspeed $j --preset ${PRESET:-70b} \
        --seq-len ${SEQ:-2048} --max-steps $steps --warmup-steps 2 --log-interval 2 --eval-interval 0 --eval-batches 1 \
        --data $TOK --bin-dtype uint16 --metrics-file $OUT/$name.jsonl "$@" > $OUT/$name.log 2>&1
    echo "== $name: exit $?"
    grep -h -E "parameters|model start|training state|bytes/param|step in backward|^step |MFU|out of memory|Error" $OUT/$name.log | cut -c1-300 | tail -16
}
run coat_70b coat_zero3 ${MB:-2} ${STEPS:-20} 330 --recipe max_memory --master-weights bf16+8
if grep -q "out of memory" $OUT/coat_70b.log; then
    run coat_70b_mb1 coat_zero3 1 ${STEPS:-20} 300 --recipe max_memory --master-weights bf16+8
fi
run bf16_70b bf16_zero3 1 2 120
