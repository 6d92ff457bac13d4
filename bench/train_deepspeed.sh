#!/usr/bin/env bash
# Run ON the GPU machine (nvidia-h200-x2), from the repo root, with .whl/ carried
# (bench/prepare_wheels.sh makes it). Trains the ~1B preset with each DeepSpeed config given
# (default: all six) on every GPU and writes <config>.log, <config>.jsonl, device.txt and
# table.md under $OUT (the device tool returns at most 8 files: give it 2 configs a call).
#
#   bash bench/train_deepspeed.sh coat_zero2 bf16_zero2
#   python bench/summarize_deepspeed.py DIR_WITH_ALL_JSONL   # one table from several calls
#
# Env: STEPS (default 60), MICRO (micro-batch per GPU, default 8), SEQ (default 2048),
# MODEL_CONFIG (default configs/1b.yaml). A CPU dry run of the script itself:
#   SKIP_WHEELS=1 PYTHON=/work/venv/bin/python DS_ACCELERATOR=cpu NGPU=2 MODEL_CONFIG=configs/tiny.yaml \
#   SEQ=64 STEPS=10 OUT=/tmp/bench bash bench/train_deepspeed.sh coat_zero2 bf16_zero2
set -euo pipefail
. bench/device_env.sh
OUT=${OUT:-runs/bench}
STEPS=${STEPS:-60} MICRO=${MICRO:-8} SEQ=${SEQ:-2048} MODEL_CONFIG=${MODEL_CONFIG:-configs/1b.yaml}
mkdir -p "$OUT" /tmp/bench_cfg
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"; } \
    | sed "s/^/$(date -u +%F) /" > "$OUT/device.txt"
configs=("$@")
[ ${#configs[@]} -eq 0 ] && configs=(coat_zero1 bf16_zero1 coat_zero2 bf16_zero2 coat_zero3 bf16_zero3)
for name in "${configs[@]}"; do
    # The shipped JSON with the benchmark's micro-batch (the files in ds_configs/ stay CPU-sized).
    "$PYTHON" - "$name" "$MICRO" /tmp/bench_cfg/"$name".json <<'PY'
import json, sys
name, micro, dst = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfg = json.load(open(f"ds_configs/{name}.json"))
cfg["train_micro_batch_size_per_gpu"] = micro
json.dump(cfg, open(dst, "w"), indent=2)
PY
    rm -f "$OUT/$name.jsonl"
    echo "== $name: $NGPU GPUs, micro-batch $MICRO, seq $SEQ, $STEPS steps"
    set +e
    "$PYTHON" -m deepspeed.launcher.runner --num_gpus "$NGPU" --master_port 29512 \
        train.py --deepspeed /tmp/bench_cfg/"$name".json --config "$MODEL_CONFIG" --max-steps "$STEPS" \
        --seq-len "$SEQ" --metrics-file "$OUT/$name.jsonl" > "$OUT/$name.log" 2>&1
    rc=$?
    set -e
    grep -E "bytes/param|optimizer state|step [0-9]+/|eval loss" "$OUT/$name.log" || true
    if [ $rc -ne 0 ]; then echo "== $name FAILED (exit $rc):"; tail -40 "$OUT/$name.log"; fi
done
"$PYTHON" bench/summarize_deepspeed.py "$OUT" | tee "$OUT/table.md"
