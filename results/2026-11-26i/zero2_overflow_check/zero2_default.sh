# train.py ZeRO-2, 1b, compiled: the BF16 JSON against coat_zero2.json as shipped (CoatAdamW's
# on-device skip in place of DeepSpeed's overflow check) and with the check kept (key true)
set -u
python -m pytest -q -p no:cacheprovider tests/test_group_skips.py 2>&1 | tail -1
python - <<'P'
import json
c = json.load(open("ds_configs/coat_zero2.json")); c["bf16"]["check_grad_overflow"] = True
json.dump(c, open("/tmp/coat_zero2_checked.json", "w"), indent=1)
P
for round in 1 2; do
for run in "ds_configs/bf16_zero2.json:" "ds_configs/coat_zero2.json:--fp8-linear" "/tmp/coat_zero2_checked.json:--fp8-linear"; do
  j=${run%%:*}; fl=${run#*:}
  timeout 170 python train.py --config configs/1b.yaml --compile --max-steps 30 --deepspeed $j $fl > /tmp/run.log 2>&1
  echo "$(basename $j) $fl: $(grep -E '^step 30/' /tmp/run.log) | on-device skip: $(grep -c 'in place of DeepSpeed' /tmp/run.log)"
  grep -E "Error" /tmp/run.log | tail -3
done
done
