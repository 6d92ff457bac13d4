"""How far CoatAdamW's stored second moment drifts from AdamW's over many steps, on CPU (the
host kernel; the torch twin computes the same): v of a (64, 1024) tensor whose elements have
fixed gradient scales spanning D decades within every 128-group, fresh Gaussian gradients
each step (none zero), against the exact float64 recurrence. Then the codec alone: a group
quantized, decoded and quantized again N times, nothing else changing.
Run: python results/2026-11-28e/moment_drift.py"""
import torch

from coat_ds.kernels import AdamWHyper, AdamWSlot, host
from coat_ds.kernels import reference as R


def quantiles(r):
    q = torch.quantile(r.flatten()[::7].float(), torch.tensor([0.001, 0.5, 0.999]))
    return f"{q[0]:+.2f} / {q[1]:+.2f} / {q[2]:+.2f}"


print("| beta2 | decades of |g| in a group | step | log10(v / AdamW's v): 0.1% / median / 99.9% |")
print("|---|---|---|---|")
for beta2, decades, steps in ((0.95, 3, 1000), (0.999, 1, 1000), (0.999, 3, 1000), (0.999, 3, 3000)):
    torch.manual_seed(0)
    shape = (64, 1024)
    zeros = torch.zeros(shape)
    slot = AdamWSlot(torch.randn(shape) * 0.02, torch.zeros(shape), R.quantize_groups(zeros), R.quantize_groups(zeros))
    scale = 10 ** (torch.rand(shape) * decades - decades)
    v_true = torch.zeros(shape, dtype=torch.float64)
    for step in range(1, steps + 1):
        g = torch.randn(shape) * scale
        slot.grad.copy_(g)
        host.host_step([slot], AdamWHyper.at_step(step, 1e-4, 0.9, beta2, 1e-8, 0.0))
        v_true = beta2 * v_true + (1 - beta2) * g.double() ** 2
    ratio = (R.dequantize_groups(slot.exp_avg_sq).double() / v_true).log10()
    print(f"| {beta2} | {decades} | {steps} | {quantiles(ratio)} |", flush=True)

print("\n| decades in a group | round trips | log10(x after / x): 0.1% / median / 99.9% |")
print("|---|---|---|")
for decades in (1, 2, 3, 6):
    torch.manual_seed(0)
    x0 = 10 ** (torch.rand(256, 128) * decades - decades)
    x = x0.clone()
    for trip in range(1, 301):
        x = R.dequantize_groups(R.quantize_groups(x))
        if trip in (1, 300):
            print(f"| {decades} | {trip} | {quantiles((x / x0).log10())} |", flush=True)
