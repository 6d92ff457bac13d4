"""Does Inductor write an FP8 cast and the max that checks its exponent in one kernel, once
the exponent is given (a guess) rather than computed from that max? SwiGLU's forward cast
(h = silu(g) * u, both layouts) and its backward casts (dg, du from dh, g, u), at the 1b
preset's MLP shape, compiled: the current twin (max, then codes) against the guessed one
(codes with a given exponent, plus the max a fix-up would compare). Prints ms and kernels.
Run from the repo root: python results/2026-11-26g/guess_fusion/guess_fusion.py"""
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from coat_ds.kernels import reference as R  # noqa: E402

M, I = 16384, 5632
dev, bf = "cuda", torch.bfloat16
torch.manual_seed(0)
g, u, dh = (torch.randn(M, I, device=dev, dtype=bf) for _ in range(3))
e = torch.tensor(-6, dtype=torch.int32, device=dev)


def q_now(x):
    return R.linear_quantize(x, "e4m3", True, True, 16, None, 16)


def q_guess(x, e):
    c, ct, _ = R.linear_quantize(x, "e4m3", True, True, 16, exp=e)
    return c, ct, R.linear_finite_absmax(x, 16)


def fwd_now(g, u):
    return q_now(F.silu(g) * u)


def fwd_guess(g, u, e):
    return q_guess(F.silu(g) * u, e)


def _bwd(dh, g, u):
    s = torch.sigmoid(g.float())
    dg = (dh.float() * u.float() * s * (1 + g.float() * (1 - s))).to(bf)
    du = (dh.float() * F.silu(g.float())).to(bf)
    return dg, du


def bwd_now(dh, g, u):
    dg, du = _bwd(dh, g, u)
    return q_now(dg), q_now(du)


def bwd_guess(dh, g, u, e):
    dg, du = _bwd(dh, g, u)
    return q_guess(dg, e), q_guess(du, e)


def measure(fn, *args):
    fn = torch.compile(fn)
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    kernels = [k for k in prof.key_averages() if k.device_type == torch.autograd.DeviceType.CUDA]
    names = sorted({k.key[:60] for k in kernels})
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20, len(kernels), names


print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, M {M}, I {I}")
print("| pattern | ms | kernels |\n|---|---|---|")
rows = [("fwd now", fwd_now, (g, u)), ("fwd guess", fwd_guess, (g, u, e)),
        ("bwd now", bwd_now, (dh, g, u)), ("bwd guess", bwd_guess, (dh, g, u, e))]
details = []
for name, fn, args in rows:
    ms, n, names = measure(fn, *args)
    print(f"| {name} | {ms:.3f} | {n} |")
    details.append((name, names))
for name, names in details:
    print(name, names)
