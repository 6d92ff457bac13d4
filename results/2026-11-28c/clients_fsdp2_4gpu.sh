# 1) Trainer + DeepSpeed ZeRO-2 with torch_compile=True, BF16 against prepare(recipe='speed'), the
#    prepared model's forward outside the trace. 2) train.py FSDP2 7b compiled, each side at a larger
#    micro-batch: BF16 at its best tried (10) and --recipe speed at 16.
# Run: OUT=DIR bash bench/device_env.sh bash results/2026-11-28c/clients_fsdp2_4gpu.sh
set -u
OUT=${OUT:-/tmp/clients_fsdp2}; mkdir -p $OUT
python bench/clients.py trainer --stage 2 --sides bf16_compiled coat_compiled --steps 14 --warmup 5 \
    --limit 130 --out $OUT/trainer 2>&1 | tail -5
TOK=$(python -c 'import sys; sys.path.insert(0, "bench"); import scaling; print(scaling.token_file(32000, 8_000_000))')
run() {  # name json micro limit extra...
    local name=$1 json=$2 mb=$3 limit=$4; shift 4
    local j=$(python -c "import sys; sys.path.insert(0, 'bench'); import scaling; print(scaling.with_micro_batch('$json', $mb))")
    timeout $limit python -m torch.distributed.run --nproc_per_node $NGPU train.py --fsdp --deepspeed $j --preset 7b \
        --seq-len 2048 --max-steps 8 --warmup-steps 2 --log-interval 2 --eval-interval 0 --eval-batches 1 \
        --data $TOK --bin-dtype uint16 --compile --metrics-file $OUT/$name.jsonl "$@" > $OUT/$name.log 2>&1
    echo "$name: exit $? | $(grep -E '^step 8/' $OUT/$name.log | cut -c1-160)"
    grep -h -E "Error|out of memory" $OUT/$name.log | tail -2 | cut -c1-200
}
run bf16_mb10 bf16_zero3 10 125
run coat_mb16 coat_zero3 16 125 --recipe speed
python - $OUT <<'P'
import json, os, statistics, sys
out = sys.argv[1]
print("| run | tokens/s (median after the first window) | vs bf16_mb10 | peak GB |\n|---|---|---|---|")
rows = {}
for name in ["bf16_mb10", "coat_mb16"]:
    p = os.path.join(out, name + ".jsonl")
    logs = [m for m in map(json.loads, open(p)) if "tokens_per_s" in m] if os.path.isfile(p) else []
    rows[name] = (statistics.median(m["tokens_per_s"] for m in logs[1:]), max(m["peak_mem_gb"] for m in logs)) if len(logs) > 1 else None
b = rows["bf16_mb10"]
for k, r in rows.items():
    print(f"| {k} | failed | | |" if r is None else f"| {k} | {r[0]:,.0f} | {r[0] / b[0]:.3f}x | {r[1]:.1f} |" if b else f"| {k} | {r[0]:,.0f} | | {r[1]:.1f} |")
P
