# Sourced by the bench scripts that run on a device machine, from the repo root: installs the
# carried wheels (.whl/, bench/prepare_wheels.sh; SKIP_WHEELS=1 skips that, for a CPU dry
# run), puts this checkout first on the path, keeps NVLink multicast off, and sets PYTHON and
# NGPU (default: every GPU).
PYTHON=${PYTHON:-python3}
if [ -z "${SKIP_WHEELS:-}" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DS_ACCELERATOR=${DS_ACCELERATOR:-cuda}
# NVLink multicast stays off on these shared hosts (device KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=${NGPU:-$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')}
