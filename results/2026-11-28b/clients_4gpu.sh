# What each client gets on 4 GPUs: Trainer + DeepSpeed ZeRO-2 (eager and torch_compile=True),
# train.py DeepSpeed ZeRO-3 7b micro-batch 6 compiled, Accelerate + FSDP2; BF16 in the same call.
# Run: bash bench/device_env.sh bash results/2026-11-28b/clients_4gpu.sh  (OUT: output folder)
set -u
OUT=${OUT:-/tmp/clients_4gpu}
python bench/clients.py trainer --stage 2 --sides bf16 coat bf16_compiled coat_compiled --steps 14 --warmup 5 \
    --limit 140 --out $OUT/trainer 2>&1 | tail -12
python bench/scaling.py deepspeed coat_zero3 bf16_zero3 --micro 6 --steps 12 --tokens 8000000 \
    --flags="--preset 7b --compile --log-interval 4" --coat-flags="--recipe speed" --limit 170 --out $OUT/zero3 2>&1 | tail -8
grep -h -E "^step 12/|Error|error" $OUT/zero3/*.log | tail -6
python bench/clients.py accelerate --sides bf16 coat --steps 12 --warmup 4 --limit 70 --out $OUT/accel 2>&1 | tail -6
