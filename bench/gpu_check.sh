#!/usr/bin/env bash
# One device call that checks the GPU paths and times the optimizer step against the code of a
# reference commit in the same run. From the repo root on the GPU machine, with the wheels
# carried as .whl and the reference tree as $OLD (e.g. `git archive cad9c1a | tar -x -C .oldwt`):
#     OLD=.oldwt bash bench/gpu_check.sh
# Writes logs and JSON under ${OUT:-/tmp/gpu_check}; prints a short table last.
set -u
source bench/device_env.sh
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
OLD=${OLD:-}
TESTS=${TESTS:-"tests/test_kernels.py tests/test_act_kernels.py tests/test_optim.py tests/test_optim_contract.py tests/test_dre.py tests/test_kernel_paths.py tests/test_fp8_linear.py"}
"$PYTHON" bench/optim_step.py --iters 30 --portable ${PEERS:+--peers} --out "$OUT/optim_new.json" 2>&1 | tee "$OUT/optim_new.log" | tail -30
if [ -n "$OLD" ]; then
    "$PYTHON" "$OLD/bench/optim_step.py" --iters 30 --out "$OUT/optim_old.json" 2>&1 | tee "$OUT/optim_old.log" | tail -8
    # Same process order reversed once more, so drift in clocks shows as a spread.
    "$PYTHON" bench/optim_step.py --iters 30 --out "$OUT/optim_new2.json" 2>&1 | tail -8
fi
"$PYTHON" -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
"$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$OUT/gpu_marked.log" | tail -5
echo "== summary"; grep -h -E "passed|failed" "$OUT"/gpu_tests.log "$OUT"/gpu_marked.log | tail -2
