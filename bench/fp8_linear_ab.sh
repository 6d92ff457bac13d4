#!/usr/bin/env bash
# FP8 linears, this tree against an older one (OLD, e.g. `git archive <rev> coat_ds bench`
# unpacked into .oldwt), in one device call: the GPU tests of the layer, BF16, then the
# trees' coat_fp8 sides alternating for ROUNDS rounds (with EXTRA sides of this tree after
# each of its coat_fp8 runs, e.g. EXTRA=coat_fp8_keepw), torchao float8, and the ~1B shape.
# Each side runs in its own process (honest peaks); one log under $OUT.
#   OLD=.oldwt OUT=$OUT bash bench/fp8_linear_ab.sh      (torchao: its wheel in .whl_ao/)
set -u
OLD=${OLD:?set OLD to the older tree}
ROUNDS=${ROUNDS:-2}
EXTRA=${EXTRA:-}
OUT=${OUT:-results/fp8_ab}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if ls .whl_ao/*.whl >/dev/null 2>&1; then
    pip install -q --no-deps --target /tmp/site .whl_ao/*.whl >/dev/null 2>&1
fi
R=$PWD
L=$OUT/log.txt
side() {  # tree shape side
    (cd "$1" && PYTHONPATH=/tmp/site:$PWD timeout 150 python bench/fp8_linear_bench.py --shape "$2" --side "$3" 2>&1 \
        | grep RESULT | sed "s|^|$1 |") >> "$L"
}
date -u >> "$L"
PYTHONPATH=$R timeout 120 python -m pytest -q -p no:cacheprovider tests/test_fp8_linear.py 2>&1 | tail -3 >> "$L"
side "$R" 7b bf16
for _ in $(seq "$ROUNDS"); do
    side "$R/$OLD" 7b coat_fp8
    side "$R" 7b coat_fp8
    for s in $EXTRA; do side "$R" 7b "$s"; done
done
side "$R" 7b torchao
side "$R" 1b bf16
side "$R" 1b coat_fp8
date -u >> "$L"
cat "$L"
