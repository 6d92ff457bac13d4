# Two more seeds (1340, 1341) of the 350m per-recipe parity, torch AdamW against
# prepare(recipe="speed"), compiled and deterministic, the same setup as
# results/2026-11-28c/recipe_parity_4gpu.sh; the four runs at once, two on each GPU.
# Run: OUT=DIR bash bench/device_env.sh bash results/2026-11-28d/recipe_parity_more_2gpu.sh
set -u
OUT=${OUT:-/tmp/recipe_parity_more}; mkdir -p $OUT
g=0
for seed in 1340 1341; do
    for v in adamw recipe_speed; do
        (CUDA_VISIBLE_DEVICES=$g timeout 225 python bench/parity.py --preset 350m --steps 300 --batch-size 12 \
            --seq-len 1024 --lr 3e-4 --warmup 30 --device cuda --log-interval 100 --variants $v --compile \
            --deterministic --pair-vocab 32000 --seeds $seed > $OUT/${v}_$seed.log 2> $OUT/${v}_$seed.err
         echo "gpu $g $v seed $seed: exit $? $(grep -h 'final train' $OUT/${v}_$seed.log)") &
    done
    g=$((g + 1))
done
wait
python bench/parity.py --summary $OUT/*.log 2>&1 | tail -6
