#!/usr/bin/env bash
# Run ON a multi-GPU machine (nvidia-h200-x2/x4/x8), from the repo root, with .whl/ carried
# (bench/prepare_wheels.sh makes it). The issue-8 scaling set on every GPU of the machine:
# the memory profiler for 7B and 13B under ZeRO-3 and FSDP2 (each side in its own
# processes), then a few train.py steps of 7B under FSDP2 with COAT. Outputs under $OUT:
# <run>/profile.json|png, <run>.log, device.txt; the last lines printed are one table.
#
#   bash bench/scaling.sh                 # all five
#   bash bench/scaling.sh p7b_zero3       # some of: p7b_zero3 p13b_zero3 p7b_fsdp2 p13b_fsdp2 train7b_fsdp2
#
# Env: LIMIT (seconds per run, default 170), SEQ (default 2048), STEPS (train.py, default 6).
set -uo pipefail
. bench/device_env.sh
OUT=${OUT:-runs/scaling} LIMIT=${LIMIT:-170} SEQ=${SEQ:-2048} STEPS=${STEPS:-6}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; echo "$NGPU GPUs, $(date -u +%F)"; } > "$OUT/device.txt"
profile() {  # name model engine coat_json baseline_json
    timeout "$LIMIT" "$PYTHON" -m coat_ds.profile --model "$2" --seq-len "$SEQ" --engine "$3" --nproc "$NGPU" \
        --config "ds_configs/$4.json" --baseline "ds_configs/$5.json" --max-batch 64 --throughput-steps 2 \
        --out "$OUT/$1" > "$OUT/$1.log" 2>&1
    echo "$1: exit $?"
}
runs=("$@")
[ ${#runs[@]} -eq 0 ] && runs=(p7b_zero3 p13b_zero3 p7b_fsdp2 p13b_fsdp2 train7b_fsdp2)
for run in "${runs[@]}"; do
    SECONDS=0
    case $run in
        p7b_zero3) profile p7b_zero3 7b deepspeed coat_zero3 bf16_zero3 ;;
        p13b_zero3) profile p13b_zero3 13b deepspeed coat_zero3 bf16_zero3 ;;
        p7b_fsdp2) profile p7b_fsdp2 7b fsdp coat_zero3 bf16_zero3 ;;
        p13b_fsdp2) profile p13b_fsdp2 13b fsdp coat_zero3 bf16_zero3 ;;
        train7b_fsdp2)
            timeout "$LIMIT" "$PYTHON" -m torch.distributed.run --nproc_per_node "$NGPU" train.py --fsdp \
                --deepspeed ds_configs/coat_zero3.json --preset 7b --seq-len "$SEQ" --max-steps "$STEPS" \
                --warmup-steps 2 --log-interval 2 --eval-interval 0 --eval-batches 1 --compress-activations \
                > "$OUT/$run.log" 2>&1
            echo "$run: exit $?" ;;
        *) echo "unknown run $run"; exit 2 ;;
    esac
    echo "  ($SECONDS s)"
done
"$PYTHON" - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
print(open(os.path.join(out, "device.txt")).read().strip())
print("| run | side | measured total @ b=2 (GB/rank) | opt states | act/sample | max micro-batch | tokens/s |")
for run in sorted(os.listdir(out)):
    path = os.path.join(out, run, "profile.json")
    if not os.path.isfile(path):
        continue
    r = json.load(open(path))
    for side in ("baseline", "coat"):
        s, m = r["sides"][side], r["sides"][side]["ranks"][0]
        tps = s["tokens_per_s"]
        print(f"| {run} | {side} | {m['measured_total_bytes'] / 1e9:.2f} | {m['optimizer_state_bytes'] / 1e9:.2f} | "
              f"{m['activation_bytes_per_sample'] / 1e9:.3f} | {s['max_micro_batch']} | {tps and round(tps)} |")
PY
grep -h "step \|optimizer state\|saved activations" "$OUT"/train*.log 2>/dev/null | tail -6
