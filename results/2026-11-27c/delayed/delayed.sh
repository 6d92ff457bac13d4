# Delayed scaling, timing and memory (an experiment, delayed.patch): every compiled Fp8Linear
# casts its input, weight and output gradient with the exponent of the last step's max, kept
# per layer in buffers, and reduces this step's max into them (nothing waits on it). 7B shapes.
#   cd .agtree && SKIP_WHEELS=1 bash bench/device_env.sh bash delayed.sh
for r in 1 2; do
python bench/fp8_linear.py --shape 7b --sides bf16 coat_fp8_nocomp_headloss --steps 8 2>&1 | grep -E "^\| 7b"
COAT_DELAYED=1 python bench/fp8_linear.py --shape 7b --sides coat_fp8_nocomp_headloss --steps 8 2>&1 | grep -E "^\| 7b|Error" | sed 's/coat_fp8_nocomp_headloss/coat_fp8_nocomp_headloss DELAYED/'
done
