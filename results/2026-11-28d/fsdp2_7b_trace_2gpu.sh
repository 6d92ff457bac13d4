# train.py FSDP2 7b compiled on 2 GPUs, micro-batch 6: BF16 against --recipe speed, and speed with
# --fp8-keep-weight-codes; each traced for 3 steps after 10, and each trace's GPU time by category.
# Run: OUT=DIR bash bench/device_env.sh bash results/2026-11-28d/fsdp2_7b_trace_2gpu.sh
set -u
KEEP=${OUT:-/tmp/fsdp2_trace}; OUT=/tmp/fsdp2_trace_work; mkdir -p $OUT $KEEP
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
TOK=$(python -c 'import sys; sys.path.insert(0, "bench"); import scaling; print(scaling.token_file(32000, 8_000_000))')
run() {  # name json micro limit extra...
    local name=$1 json=$2 mb=$3 limit=$4; shift 4
    local j=$(python -c "import sys; sys.path.insert(0, 'bench'); import scaling; print(scaling.with_micro_batch('$json', $mb))")
    timeout $limit python -m torch.distributed.run --nproc_per_node $NGPU train.py --fsdp --deepspeed $j --preset 7b \
        --seq-len 2048 --max-steps 16 --warmup-steps 2 --log-interval 2 --eval-interval 0 --eval-batches 1 \
        --data $TOK --bin-dtype uint16 --compile --metrics-file $OUT/$name.jsonl --trace $OUT/$name.json.gz \
        --trace-after 10 "$@" > $OUT/$name.log 2>&1
    echo "$name: exit $? | $(grep -E '^step 16/' $OUT/$name.log | cut -c1-160)"
    grep -h -E "Error|out of memory" $OUT/$name.log | tail -2 | cut -c1-200
}
run bf16 bf16_zero3 6 150
run speed coat_zero3 6 150 --recipe speed
run speed_codes coat_zero3 6 150 --recipe speed --fp8-keep-weight-codes
for n in bf16 speed speed_codes; do
    [ -f $OUT/$n.json.gz ] && { echo "== $n"; python bench/trace_gaps.py $OUT/$n.json.gz --top 14 > $OUT/${n}_gaps.txt; sed -n "1,/^GPU span/p" $OUT/${n}_gaps.txt | head -22 | cut -c1-120; }
done
python - $OUT <<'P'
import json, os, statistics, sys
out = sys.argv[1]
print("| run (2 GPUs, mb 6) | tokens/s (median, steps 4-10) | vs bf16 | peak GB |\n|---|---|---|---|")
rows = {}
for name in ["bf16", "speed", "speed_codes"]:
    p = os.path.join(out, name + ".jsonl")
    logs = [m for m in map(json.loads, open(p)) if "tokens_per_s" in m and 2 < m["step"] <= 10] if os.path.isfile(p) else []
    rows[name] = (statistics.median(m["tokens_per_s"] for m in logs), max(m["peak_mem_gb"] for m in logs)) if logs else None
b = rows["bf16"]
for k, r in rows.items():
    print(f"| {k} | failed | | |" if r is None else f"| {k} | {r[0]:,.0f} | {r[0] / b[0]:.3f}x | {r[1]:.1f} |" if b else f"| {k} | {r[0]:,.0f} | | {r[1]:.1f} |")
P
cp $OUT/*_gaps.txt $OUT/*.jsonl $KEEP/; cp $OUT/speed.json.gz $KEEP/ 2>/dev/null; true
