# train.py FSDP2, 1b, compiled: clipping inside CoatAdamW's step (this tree) against clip_grad_norm_
# first (.oldwt = 64f1144), BF16 JSON as the baseline; GPU check of the new optimizer tests first
set -u
python -m pytest -q -p no:cacheprovider tests/test_group_skips.py -k "whole_step or clipping_by" 2>&1 | tail -1
for round in 1 2; do
for run in "train.py:bf16_zero3:" "train.py:coat_zero3:--fp8-linear" ".oldwt/train.py:coat_zero3:--fp8-linear"; do
  s=${run%%:*}; r=${run#*:}; j=${r%%:*}; fl=${r#*:}
  timeout 170 python -m torch.distributed.run --nproc_per_node 1 $s --fsdp --config configs/1b.yaml --compile --max-steps 30 --deepspeed ds_configs/$j.json $fl > /tmp/run.log 2>&1
  echo "$s $j $fl: $(grep -E '^step 30/' /tmp/run.log) | clip in step: $(grep -c 'inside CoatAdamW' /tmp/run.log)"
  grep -E "Error" /tmp/run.log | tail -3
done
done
