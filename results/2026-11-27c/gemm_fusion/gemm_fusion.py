"""Would one FP8 GEMM for sibling linears (q/k/v, gate/up) beat one GEMM each?

Times torch._scaled_mm in the three layouts an Fp8Linear runs (forward, input gradient,
weight gradient), for the siblings as separate GEMMs (plus the input gradient's adds) and
as one GEMM over their concatenated weights. Per-tensor power-of-two scales, our formats
(E4M3 inputs/weights, E5M2 gradients), fast accumulation in forward only, as coat_ds runs.
Run: bash bench/device_env.sh python results/2026-11-27c/gemm_fusion/gemm_fusion.py
"""
import torch

M = 16384  # tokens per step: bs 8 x 2048
CASES = [  # (name, K = the shared input's width, sibling output widths)
    ("7b q/k/v", 4096, [4096, 4096, 4096]),
    ("7b gate/up", 4096, [11008, 11008]),
    ("1b q/k/v (HF ~1B)", 2048, [2048, 2048, 2048]),
    ("1b gate/up", 2048, [5632, 5632]),
]
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
one = torch.ones((), device="cuda")


def codes(shape, dtype):
    return (torch.randn(shape, device="cuda") * 0.5).to(dtype)


def timed(fn, iters=30):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def mm(a, b_t, out_dtype, fast):
    return torch._scaled_mm(a, b_t.t(), one, one, out_dtype=out_dtype, use_fast_accum=fast)


rows = []
for name, K, Ns in CASES:
    N = sum(Ns)
    x, xt = codes((M, K), E4), codes((K, M), E4)             # input codes, both layouts
    ws = [codes((n, K), E4) for n in Ns]; wts = [codes((K, n), E4) for n in Ns]
    w, wt = torch.cat([c.float() for c in ws]).to(E4), torch.cat([c.float() for c in wts], 1).to(E4)
    gs = [codes((M, n), E5) for n in Ns]; gts = [codes((n, M), E5) for n in Ns]
    g, gt = torch.cat([c.float() for c in gs], 1).to(E5), torch.cat([c.float() for c in gts]).to(E5)
    flops = 2 * M * K * N

    def fwd_sep(): [mm(x, wi, torch.bfloat16, True) for wi in ws]
    def fwd_one(): mm(x, w, torch.bfloat16, True)

    def dgrad_sep():
        dx = mm(gs[0], wts[0], torch.bfloat16, False)
        for gi, wti in zip(gs[1:], wts[1:]):
            dx = dx + mm(gi, wti, torch.bfloat16, False)
    def dgrad_one(): mm(g, wt, torch.bfloat16, False)
    def dgrad_sep_mm(): [mm(gi, wti, torch.bfloat16, False) for gi, wti in zip(gs, wts)]

    def wgrad_sep(): [mm(gti, xt, torch.float32, False) for gti in gts]
    def wgrad_one(): mm(gt, xt, torch.float32, False)

    for what, sep, fused in (("forward", fwd_sep, fwd_one), ("input grad", dgrad_sep, dgrad_one),
                             ("input grad, GEMMs only", dgrad_sep_mm, dgrad_one),
                             ("weight grad", wgrad_sep, wgrad_one)):
        ts, tf = timed(sep), timed(fused)
        rows.append((name, what, ts, tf, flops / ts / 1e9, flops / tf / 1e9))
    del x, xt, ws, wts, w, wt, gs, gts, g, gt
    torch.cuda.empty_cache()

print(torch.cuda.get_device_name(), torch.__version__)
print("| siblings | GEMM | separate ms | one GEMM ms | saved ms | separate TFLOP/s | one TFLOP/s |")
print("|---|---|---|---|---|---|---|")
tot = {}
for name, what, ts, tf, fs, ff in rows:
    if what != "input grad, GEMMs only":
        tot[name] = tot.get(name, 0.0) + ts - tf
    print(f"| {name} | {what} | {ts:.3f} | {tf:.3f} | {ts - tf:.3f} | {fs:.0f} | {ff:.0f} |")
for name, saved in tot.items():
    print(f"{name}: {saved:.3f} ms saved per layer per step")
