# 1b preset, 150M tokens of the installed packages' Python sources (32,000-id BPE), train.py FSDP2
# compiled --recipe speed on 2 GPUs, micro-batch 8 (16 x 2048 tokens a step): the speed side.
# Two launches back to back on one machine: the second resumes the first's save folder.
# Run: OUT=DIR bash bench/device_env.sh bash results/2026-11-28e/conv_1b_150m_speed_2gpu.sh
set -u
KEEP=${OUT:-/tmp/conv150_speed}; mkdir -p $KEEP
python bench/convergence.py run speed --tokens 150e6 --limit ${LIMIT:-540} --out runs/c150 2>&1 | tail -3
grep -h -E "corpus: (built|reading|train)|^step .*100%|eval loss|resum" runs/c150/speed/train.log | tail -4 | cut -c1-200
cp runs/c150/speed/metrics.jsonl $KEEP/speed_metrics.jsonl; cp runs/c150/speed/run.json $KEEP/speed_run.json
python bench/convergence.py plot runs/c150
