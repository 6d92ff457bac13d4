#!/usr/bin/env bash
# Run ON a GPU machine, from the repo root, with .whl/ carried (bench/prepare_wheels.sh).
# train.py under FSDP2 on every GPU, four ways at one micro-batch: BF16 + torch AdamW and
# COAT (CoatAdamW + FP8 activations), each eager and with --compile. Same data, steps and
# initial weights; the last lines printed are one table (tokens/s of the last log window,
# peak memory, loss at the last step).
#
#   PRESET=7b MB=6 bash bench/train_compile.sh
#
# Env: PRESET (default 1b), MB (micro-batch per GPU, default 4), SEQ (2048), STEPS (10),
# LIMIT (seconds per run, 150), OUT (runs/train_compile), RUNS (which of the four, default
# all: "bf16_eager bf16_compiled coat_eager coat_compiled"); NGPU, SKIP_WHEELS:
# bench/device_env.sh.
set -uo pipefail
. bench/device_env.sh
PRESET=${PRESET:-1b} MB=${MB:-4} SEQ=${SEQ:-2048} STEPS=${STEPS:-10} LIMIT=${LIMIT:-150}
RUNS=${RUNS:-bf16_eager bf16_compiled coat_eager coat_compiled}
OUT=${OUT:-runs/train_compile}
mkdir -p "$OUT"
for side in bf16 coat; do  # the JSONs at this micro-batch
    sed "s/\"train_micro_batch_size_per_gpu\": [0-9]*/\"train_micro_batch_size_per_gpu\": $MB/" \
        "ds_configs/${side}_zero3.json" > "$OUT/${side}.json"
done
run() {  # name json flags...
    local name=$1 json=$2; shift 2
    case " $RUNS " in *" $name "*) ;; *) return ;; esac
    SECONDS=0
    timeout "$LIMIT" "$PYTHON" -m torch.distributed.run --nproc_per_node "$NGPU" train.py --fsdp --deepspeed "$json" \
        --preset "$PRESET" --seq-len "$SEQ" --max-steps "$STEPS" --warmup-steps 2 --log-interval 2 \
        --eval-interval 0 --eval-batches 1 --metrics-file "$OUT/$name.jsonl" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? ($SECONDS s)"
}
run bf16_eager "$OUT/bf16.json"
run bf16_compiled "$OUT/bf16.json" --compile
run coat_eager "$OUT/coat.json" --compress-activations
run coat_compiled "$OUT/coat.json" --compress-activations --compile
"$PYTHON" - "$OUT" "$PRESET" "$MB" "$NGPU" "$RUNS" <<'PY'
import json, os, sys
out, preset, mb, ngpu, runs = sys.argv[1:]
rows = {}
for name in runs.split():
    path = os.path.join(out, name + ".jsonl")
    logs = [json.loads(l) for l in open(path)] if os.path.isfile(path) else []
    last = [m for m in logs if "tokens_per_s" in m]
    rows[name] = last[-1] if last else None
print(f"{preset}, FSDP2 on {ngpu} GPUs, micro-batch {mb} per GPU")
print("| run | tokens/s (last window) | vs bf16 eager | peak mem GB | loss at last step |")
base = rows.get("bf16_eager") and rows["bf16_eager"]["tokens_per_s"]
for name, m in rows.items():
    if m is None:
        print(f"| {name} | failed | | | |")
        continue
    ratio = f"{m['tokens_per_s'] / base:.3f}x" if base else "-"
    print(f"| {name} | {m['tokens_per_s']:,.0f} | {ratio} | {m['peak_mem_gb']:.2f} | {m['loss']:.4f} |")
PY
