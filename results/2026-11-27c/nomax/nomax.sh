# Upper bound of a cast recipe without max passes: every compiled FP8 cast (torch twin) uses a
# fixed exponent (COAT_FIXED_EXP; gradients 12 binades lower), so no max is read at all; with
# COAT_DELAYED=1 each cast still reduces its max into a global sink that nothing waits on (the
# work a delayed-scaling recipe keeps). Timing only: what it trains on is meaningless. 7B shapes.
#   cd .agtree && SKIP_WHEELS=1 bash bench/device_env.sh bash nomax.sh
for r in 1 2; do
COAT_FIXED_EXP=-4 python bench/fp8_linear.py --shape 7b --sides coat_fp8_nocomp_headloss --steps 8 2>&1 | grep -E "^\| 7b" | sed "s/coat_fp8_nocomp_headloss/coat_fp8_nocomp_headloss FIXED EXP/"
python bench/fp8_linear.py --shape 7b --sides bf16 coat_fp8_nocomp_headloss --steps 8 2>&1 | grep -E "^\| 7b"
COAT_FIXED_EXP=-4 COAT_DELAYED=1 python bench/fp8_linear.py --shape 7b --sides coat_fp8_nocomp_headloss --steps 8 2>&1 | grep -E "^\| 7b|Error" | sed 's/coat_fp8_nocomp_headloss/coat_fp8_nocomp_headloss FIXED EXP + MAX SINK/'
done
