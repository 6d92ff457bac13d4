#!/usr/bin/env bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_fp8_linear.py -k "cuda or guess or keep or split" 2>&1 | grep -E "passed|failed|^FAILED|^E " | head -20
timeout 120 python bench/fp8_linear_bench.py --kernels 2>&1 | grep -E "^\||Error|error" | head -24
