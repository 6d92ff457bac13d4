#!/usr/bin/env bash
set -u
export PYTHONUNBUFFERED=1
R=$PWD
L=$OUT/log.txt
pip install -q --no-deps --target /tmp/site .whl_ao/*.whl >/dev/null 2>&1
side() {  # tree shape side label
    (cd "$1" && PYTHONPATH=/tmp/site:$PWD timeout 150 python bench/fp8_linear_bench.py --shape "$2" --side "$3" 2>&1 \
        | grep RESULT | sed "s|^|$4 |") >> "$L"
}
date -u >> "$L"
PYTHONPATH=$R timeout 150 python bench/fp8_linear_bench.py --shape 7b --side coat_fp8 --steps 3 --trace $OUT/trace_new.json.gz 2>&1 | grep RESULT | sed "s|^|new(traced) |" >> "$L"
PYTHONPATH=$R python bench/gpu_gaps.py $OUT/trace_new.json.gz --kernels 12 > $OUT/gaps_new.txt 2>&1
for _ in 1 2; do
    side "$R" 7b bf16 bf16
    side "$R/.oldwt" 7b coat_fp8 old
    side "$R" 7b coat_fp8 new
    side "$R" 7b coat_fp8_keepw new_keepw
done
side "$R" 7b torchao torchao
side "$R" 1b bf16 1b_bf16
side "$R" 1b coat_fp8 1b_new
PYTHONPATH=$R timeout 240 python -m pytest -q -p no:cacheprovider tests/test_fp8_linear.py -k "cuda or keep or split or guess" 2>&1 | grep -E "passed|failed|^FAILED" >> "$L"
date -u >> "$L"
cat "$L"; head -9 $OUT/gaps_new.txt
