# Loss per recipe: the 350m parity, compiled and deterministic, torch AdamW against
# prepare(recipe=speed|memory|max_memory), 3 seeds; the 12 runs spread over 4 GPUs.
# Run: OUT=DIR bash bench/device_env.sh bash results/2026-11-28c/recipe_parity_4gpu.sh
set -u
OUT=${OUT:-/tmp/recipe_parity}; mkdir -p $OUT/par
jobs=()
for seed in 1337 1338 1339; do
    for v in adamw recipe_speed recipe_memory recipe_max_memory; do jobs+=("$seed:$v"); done
done
for g in 0 1 2 3; do
    (for ((k = g; k < ${#jobs[@]}; k += 4)); do
        seed=${jobs[k]%%:*}; v=${jobs[k]#*:}
        CUDA_VISIBLE_DEVICES=$g timeout 190 python bench/parity.py --preset 350m --steps 300 --batch-size 12 \
            --seq-len 1024 --lr 3e-4 --warmup 30 --device cuda --log-interval 100 --variants $v --compile \
            --deterministic --pair-vocab 32000 --seeds $seed > $OUT/par/${v}_$seed.log 2> $OUT/par/${v}_$seed.err
        echo "gpu $g $v seed $seed: exit $? $(grep -h 'final train' $OUT/par/${v}_$seed.log)"; [ -s $OUT/par/${v}_$seed.err ] && grep -h -E "Error" $OUT/par/${v}_$seed.err | tail -1 | cut -c1-200
    done) &
done
wait
python bench/parity.py --summary $OUT/par/*.log 2>&1 | tail -8
