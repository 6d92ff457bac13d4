# 1b preset, 50M tokens of the installed packages' Python sources (32,000-id BPE), train.py FSDP2
# compiled --recipe speed on 2 GPUs, micro-batch 8: the speed_m8 side (CoatAdamW with bf16+8 master weights).
# Run: OUT=DIR bash bench/device_env.sh bash results/2026-11-28d/conv_1b_speed_m8_2gpu.sh
set -u
KEEP=${OUT:-/tmp/conv_speed_m8}; mkdir -p $KEEP
python bench/convergence.py run speed --name speed_m8 --tokens 50e6 --limit 530 --out runs/m8 -- --master-weights bf16+8 2>&1 | tail -3
grep -h -E "corpus: (built|reading|train)|^step .*100%|eval loss" runs/m8/speed_m8/train.log | tail -5 | cut -c1-200
cp runs/m8/speed_m8/metrics.jsonl $KEEP/speed_m8_metrics.jsonl; cp runs/m8/speed_m8/run.json $KEEP/speed_m8_run.json
python bench/convergence.py plot runs/m8
