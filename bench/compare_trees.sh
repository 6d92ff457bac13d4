#!/usr/bin/env bash
# Issue 14's speed bounds in one device call: the optimizer step (bench/optim_step.py) and the
# activation overhead (bench/act_memory.py) of this checkout against a reference tree, sides
# alternated ROUNDS times so that drift shows as spread, then a short table
# (bench/compare_trees.py). From the repo root on the GPU machine:
#     git archive cad9c1a coat_ds bench | tar -x -C .oldwt     # here, before the call
#     OLD=.oldwt OUT=$OUT/cmp bash bench/compare_trees.sh
# MEASURES picks a subset of "optim act_compiled act_eager" (default: all three).
set -u
OLD=${OLD:?set OLD to the reference tree}
OUT=${OUT:-/tmp/compare_trees}; ROUNDS=${ROUNDS:-2}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
MEASURES=${MEASURES:-optim act_compiled act_eager}
want() { case " $MEASURES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
ACT_COMPILED="--quick --steps 12 --layer-bs 8 --bs 4 --compile"
ACT_EAGER="--quick --steps 8 --layer-bs 8 --bs 4"
run() {  # run NAME LOG ARGS...: one measurement if MEASURES holds NAME, its log's tail on failure
    want "$1" || return 0
    local log=$2; shift 2
    PYTHONPATH=$tree "$PY" "$@" > "$log" 2>&1 || tail -5 "$log"
}
for r in $(seq "$ROUNDS"); do
    for side in new old; do
        tree=$PWD; [ "$side" = old ] && tree=$OLD
        run optim "$OUT/optim_${side}_$r.log" "$tree/bench/optim_step.py" --iters 30 --out "$OUT/optim_${side}_$r.json"
        run act_compiled "$OUT/act_compiled_${side}_$r.log" "$tree/bench/act_memory.py" $ACT_COMPILED
        run act_eager "$OUT/act_eager_${side}_$r.log" "$tree/bench/act_memory.py" $ACT_EAGER
        echo "round $r $side done $(date -u +%H:%M:%S)"
    done
done
"$PY" bench/compare_trees.py "$OUT"
