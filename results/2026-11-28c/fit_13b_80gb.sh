# Llama-2-13B shape on one GPU capped at 80 GB (train.py --gpu-memory-gb 80) of a 4-GPU H200 host
# (512 GB of host memory, for ZeRO-Offload's FP32 state): coat (bf16+8 masters, step in backward, no
# clipping, every layer recomputed from FP8 inputs, the head's loss in chunks) at growing
# micro-batches on GPU 1, and DeepSpeed ZeRO-Offload (BF16, CPU AdamW) at micro-batch 1 on GPU 0,
# at the same time.
# Run: OUT=DIR bash bench/device_env.sh bash results/2026-11-28c/fit_13b_80gb.sh
set -u
OUT=${OUT:-/tmp/fit13b}; mkdir -p $OUT
common="--preset 13b --recompute --recompute-input-fp8 --head-loss --gpu-memory-gb 80 --alloc-conf expandable_segments:True"
CUDA_VISIBLE_DEVICES=1 python bench/scaling.py fit $common --sides coat_m8:8,12,16 --steps 6 --limit 150 \
    --out $OUT/coat > $OUT/coat.txt 2>&1 &
python bench/scaling.py fit $common --sides offload:1 --steps 4 --limit 520 --out $OUT/offload > $OUT/offload.txt 2>&1
wait
tail -7 $OUT/coat.txt; tail -3 $OUT/offload.txt
grep -h -E "out of memory|Killed|Error" $OUT/*/*.log | cut -c1-220 | tail -4
grep -h "bytes per parameter" -A3 $OUT/coat/*.log | head -8
