# Both sides, layers compiled and the whole model compiled; a line each (a failure: its last lines).
for mode in layers whole; do
  for side in bf16 coat_fp8_nocomp_headloss; do
    out=$(timeout 280 python results/2026-11-27/whole_compile/whole.py $side $mode 2>&1)
    echo "$out" | grep '^{' || { echo "$side $mode failed:"; echo "$out" | tail -6; }
  done
done
