# train.py ZeRO-2, 1b, compiled: shipped JSONs against the same with bf16.check_grad_overflow=false
set -u
python - <<'P'
import json
for n in ("bf16_zero2", "coat_zero2"):
    c = json.load(open(f"ds_configs/{n}.json")); c["bf16"]["check_grad_overflow"] = False
    json.dump(c, open(f"/tmp/{n}_nocheck.json", "w"), indent=1)
P
for run in "ds_configs/bf16_zero2.json:" "ds_configs/coat_zero2.json:--fp8-linear" "/tmp/coat_zero2_nocheck.json:--fp8-linear" "/tmp/bf16_zero2_nocheck.json:" "/tmp/coat_zero2_nocheck.json:--fp8-linear" "ds_configs/coat_zero2.json:--fp8-linear" "ds_configs/bf16_zero2.json:"; do
  j=${run%%:*}; fl=${run#*:}
  timeout 170 python train.py --config configs/1b.yaml --compile --max-steps 30 --deepspeed $j $fl > /tmp/run.log 2>&1
  echo "$(basename $j) $fl: $(grep -E '^step 30/' /tmp/run.log) $(grep -c "overflow check is off" /tmp/run.log)"
  grep -E "Error|error" /tmp/run.log | tail -3
done
