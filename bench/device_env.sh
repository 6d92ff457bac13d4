# A GPU machine's environment, from the repo root: installs the wheels in .whl/ (made by
# bench/prepare_wheels.sh; SKIP_WHEELS=1 skips that, for a CPU dry run), puts this
# checkout first on the path, keeps NVLink multicast off, and sets PYTHON and NGPU (default:
# every GPU). Sourced, it only sets that up. Run, it runs its arguments in it, or with none the
# GPU test files and the tests marked gpu, a summary last:
#     bash bench/device_env.sh python bench/optim_step.py --peers --portable --tree .oldwt
#     bash bench/device_env.sh                              # TESTS="tests/test_x.py" for others
PYTHON=${PYTHON:-python3}
if [ -z "${SKIP_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DS_ACCELERATOR=${DS_ACCELERATOR:-cuda}
# NVLink multicast stays off: on a host whose GPUs others share, a program using it can take them out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=${NGPU:-$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')}
export NGPU
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    if [ $# -gt 0 ]; then exec "$@"; fi
    OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
    TESTS=${TESTS:-"tests/test_kernels.py tests/test_act_kernels.py tests/test_optim.py tests/test_optim_contract.py tests/test_dre.py tests/test_kernel_paths.py tests/test_fp8_linear.py tests/test_moment_drift.py"}
    "$PYTHON" -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
    "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$OUT/gpu_marked.log" | tail -5
    echo "== summary"; grep -h -E "passed|failed" "$OUT/gpu_tests.log" "$OUT/gpu_marked.log" | tail -2
fi
