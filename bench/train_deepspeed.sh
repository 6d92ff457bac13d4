#!/usr/bin/env bash
# Run ON the GPU machine (nvidia-h200-x2), from the repo root, with .whl/ carried
# (bench/prepare_wheels.sh makes it). Trains the ~1B preset with each DeepSpeed config given
# (default: all six) on every GPU and writes logs, metrics and a Markdown table under $OUT.
#
#   bash bench/train_deepspeed.sh coat_zero2 bf16_zero2
#
# Env: STEPS (default 60), MICRO (micro-batch per GPU, default 8), SEQ (default 2048).
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda
# NVLink multicast stays off on these shared hosts (device KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-runs/bench}
STEPS=${STEPS:-60} MICRO=${MICRO:-8} SEQ=${SEQ:-2048}
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
mkdir -p "$OUT/cfg"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/device.txt"
configs=("$@")
[ ${#configs[@]} -eq 0 ] && configs=(coat_zero1 bf16_zero1 coat_zero2 bf16_zero2 coat_zero3 bf16_zero3)
for name in "${configs[@]}"; do
    # Same JSON, batch set for the benchmark (the shipped files stay CPU-friendly).
    python3 - "$name" "$MICRO" "$OUT/cfg/$name.json" <<'PY'
import json, sys
name, micro, dst = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfg = json.load(open(f"ds_configs/{name}.json"))
cfg["train_micro_batch_size_per_gpu"] = micro
json.dump(cfg, open(dst, "w"), indent=2)
PY
    rm -f "$OUT/$name.jsonl"
    deepspeed --num_gpus "$NGPU" --master_port 29512 train.py --deepspeed "$OUT/cfg/$name.json" \
        --config configs/1b.yaml --max-steps "$STEPS" --seq-len "$SEQ" --metrics-file "$OUT/$name.jsonl" \
        2>&1 | tee "$OUT/$name.log" | grep -E "resolved|bytes/param|optimizer state|step [0-9]+/|eval loss|Error|error" || true
done
python3 bench/summarize_deepspeed.py "$OUT" | tee "$OUT/table.md"
