# Call 2: gate/up only, the output gradients concatenated before their cast. 7B layer shapes one
# round with a traced step per side (category tables), then train.py under FSDP2 one round.
#   SKIP_WHEELS=1 bash bench/device_env.sh bash results/2026-11-27c/siblings/call2.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/tr7
python bench/fp8_linear.py --shape 7b --sides bf16 coat_fp8_nocomp_headloss coat_fp8_nocomp_fsib_headloss \
  --steps 8 --trace /tmp/tr7 2>&1 | grep -E "^\|" | tail -5
for s in coat_fp8_nocomp_headloss coat_fp8_nocomp_fsib_headloss; do
  echo "== $s"; python bench/fp8_linear.py --gaps /tmp/tr7/7b_$s.json.gz --top 40 > "$OUT/gaps_7b_$s.txt" 2>&1
  head -9 "$OUT/gaps_7b_$s.txt"
done
run() { timeout 170 python -m torch.distributed.run --nproc_per_node 1 train.py --fsdp --config configs/1b.yaml --compile "$@"; }
for side in "bf16_zero3:" "coat_zero3:--fp8-linear" "coat_zero3:--fp8-linear --fp8-fuse-siblings"; do
  j=${side%%:*}; fl=${side#*:}
  run --max-steps 30 --deepspeed ds_configs/$j.json $fl 2>&1 | grep -E "^step 30/|Error" | tail -3 | sed "s|^|$j $fl: |"
done
