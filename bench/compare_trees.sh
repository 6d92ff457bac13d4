#!/usr/bin/env bash
# Issue 14's speed bounds in one device call: the optimizer step (bench/optim_step.py) and the
# activation overhead (bench/act_memory.py) of this checkout against a reference tree, sides
# alternated ROUNDS times so that drift shows as spread, then a short table
# (bench/compare_trees.py). From the repo root on the GPU machine:
#     git archive cad9c1a coat_ds bench | tar -x -C .oldwt     # here, before the call
#     OLD=.oldwt OUT=$OUT/cmp bash bench/compare_trees.sh
set -u
OLD=${OLD:?set OLD to the reference tree}
OUT=${OUT:-/tmp/compare_trees}; ROUNDS=${ROUNDS:-2}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
ACT_COMPILED="--quick --steps 12 --layer-bs 8 --bs 4 --compile"
ACT_EAGER="--quick --steps 8 --layer-bs 8 --bs 4"
for r in $(seq "$ROUNDS"); do
    for side in new old; do
        tree=$PWD; [ "$side" = old ] && tree=$OLD
        PYTHONPATH=$tree "$PY" "$tree/bench/optim_step.py" --iters 30 --out "$OUT/optim_${side}_$r.json" \
            > "$OUT/optim_${side}_$r.log" 2>&1 || tail -5 "$OUT/optim_${side}_$r.log"
        PYTHONPATH=$tree "$PY" "$tree/bench/act_memory.py" $ACT_COMPILED > "$OUT/act_compiled_${side}_$r.log" 2>&1 \
            || tail -5 "$OUT/act_compiled_${side}_$r.log"
        PYTHONPATH=$tree "$PY" "$tree/bench/act_memory.py" $ACT_EAGER > "$OUT/act_eager_${side}_$r.log" 2>&1 \
            || tail -5 "$OUT/act_eager_${side}_$r.log"
        echo "round $r $side done $(date -u +%H:%M:%S)"
    done
done
"$PY" bench/compare_trees.py "$OUT"
