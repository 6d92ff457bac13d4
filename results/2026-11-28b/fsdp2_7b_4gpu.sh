# train.py FSDP2, 7b preset, compiled, 4 GPUs: BF16 (the bf16 JSON, torch AdamW) against
# --recipe speed at the same micro-batch, then each side at a larger micro-batch.
# Run: bash bench/device_env.sh bash results/2026-11-28b/fsdp2_7b_4gpu.sh  (OUT: output folder)
set -u
OUT=${OUT:-/tmp/fsdp2_7b}; mkdir -p $OUT
TOK=$(python -c 'import sys; sys.path.insert(0, "bench"); import scaling; print(scaling.token_file(32000, 8_000_000))')
run() {  # name json micro limit extra...
    local name=$1 json=$2 mb=$3 limit=$4; shift 4
    local j=$(python -c "import sys; sys.path.insert(0, 'bench'); import scaling; print(scaling.with_micro_batch('$json', $mb))")
    timeout $limit python -m torch.distributed.run --nproc_per_node $NGPU train.py --fsdp --deepspeed $j --preset 7b \
        --seq-len 2048 --max-steps 8 --warmup-steps 2 --log-interval 2 --eval-interval 0 --eval-batches 1 \
        --data $TOK --bin-dtype uint16 --compile --metrics-file $OUT/$name.jsonl "$@" > $OUT/$name.log 2>&1
    echo "$name: exit $? | $(grep -E '^step 8/' $OUT/$name.log)"
    grep -h -E "Error|out of memory" $OUT/$name.log | tail -2
}
run bf16_mb6 bf16_zero3 6 130
run coat_mb6 coat_zero3 6 130 --recipe speed
run bf16_mb10 bf16_zero3 10 130
run coat_mb20_bf16m coat_zero3 20 130 --recipe speed --master-weights bf16+16
python - $OUT <<'P'
import json, os, statistics, sys
out = sys.argv[1]
rows = {}
for name in ["bf16_mb6", "coat_mb6", "bf16_mb10", "coat_mb20_bf16m"]:
    p = os.path.join(out, name + ".jsonl")
    logs = [m for m in map(json.loads, open(p)) if "tokens_per_s" in m] if os.path.isfile(p) else []
    rows[name] = (statistics.median(m["tokens_per_s"] for m in logs[1:]), max(m["peak_mem_gb"] for m in logs)) if len(logs) > 1 else None
print("| run | tokens/s (median of windows after the first) | vs bf16_mb6 | vs bf16 best | peak GB |\n|---|---|---|---|---|")
b6 = rows["bf16_mb6"][0] if rows["bf16_mb6"] else None
best = max((r[0] for k, r in rows.items() if k.startswith("bf16") and r), default=None)
for k, r in rows.items():
    print(f"| {k} | failed | | | |" if r is None else
          f"| {k} | {r[0]:,.0f} | {r[0] / b6:.3f}x | {r[0] / best:.3f}x | {r[1]:.1f} |" if b6 and best else f"| {k} | {r[0]:,.0f} | | | {r[1]:.1f} |")
P
