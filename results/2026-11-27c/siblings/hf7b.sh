# 7B layer shapes (HF Llama, 6 decoder layers, bs 8 x 2048, compiled layers): the recipe with
# and without Fp8LinearConfig(fuse_siblings=True), against BF16 of the same call, two rounds.
#   SKIP_WHEELS=1 bash bench/device_env.sh bash results/2026-11-27c/siblings/hf7b.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python bench/fp8_linear.py --shape 7b --sides bf16 coat_fp8_nocomp_headloss coat_fp8_nocomp_fsib_headloss \
  bf16 coat_fp8_nocomp_headloss coat_fp8_nocomp_fsib_headloss --steps 8 2>&1 | tail -12
