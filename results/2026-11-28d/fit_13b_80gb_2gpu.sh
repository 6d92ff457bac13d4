# Llama-2-13B shape, one GPU each capped at 80 GB (train.py --gpu-memory-gb 80), both sides at the same
# time on a 2-GPU H200 host (32 cores, 256 GB of host memory): coat (bf16+8 masters, step in backward,
# no clipping, FP8 linears and activations, the head's loss in chunks, no recomputation) on GPU 1, and
# DeepSpeed ZeRO-Offload (ZeRO-2, BF16, DeepSpeed's CPU Adam, every layer recomputed) on GPU 0, each
# at growing micro-batches until one fails.
# Run: OUT=DIR bash bench/device_env.sh bash results/2026-11-28d/fit_13b_80gb_2gpu.sh
set -u
OUT=${OUT:-/tmp/fit13b}; mkdir -p $OUT
common="--preset 13b --gpu-memory-gb 80 --alloc-conf expandable_segments:True"
CUDA_VISIBLE_DEVICES=1 python bench/scaling.py fit $common --head-loss --sides coat_m8:2,3,4 --steps 6 --limit 150 \
    --out $OUT/coat > $OUT/coat.txt 2>&1 &
python bench/scaling.py fit $common --recompute --sides offload:16,24 --steps 4 --limit 250 \
    --out $OUT/offload > $OUT/offload.txt 2>&1
wait
grep -h "exit" $OUT/coat.txt $OUT/offload.txt
tail -4 $OUT/coat.txt; tail -2 $OUT/offload.txt
grep -h -E "out of memory|Killed|Error" $OUT/*/*.log | cut -c1-220 | tail -4
grep -h "bytes per parameter" -A3 $OUT/coat/*.log | head -5
nproc; free -g | head -2
