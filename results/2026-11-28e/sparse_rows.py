"""CoatAdamW against torch AdamW on an embedding-like parameter whose rows see gradients
rarely or once (the moments of unseen rows decay for thousands of steps toward FP32's
subnormal range): reports the first steps whose update exceeds 10 x lr or is not finite.
Run: python results/2026-11-28e/sparse_rows.py [--device cuda] [--backends triton torch]"""
import argparse
import torch
from coat_ds.optim import CoatAdamW

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda")
ap.add_argument("--backends", nargs="+", default=["triton", "torch"])
ap.add_argument("--steps", type=int, default=3000)
ap.add_argument("--cases", nargs="+", default=["1e-4,1e-2,700", "1e-8,1e-6,700", "1e-12,1e-15,300", "1e-20,1e-20,500"])
a = ap.parse_args()
lr = 3e-4
print("| backend | rare grad, once grad, period | first bad step | bad steps | max |update| | max |p-ref| | finite |")
print("|---|---|---|---|---|---|---|")
for backend in a.backends:
    for case in a.cases:
        rare, once, period = case.split(","); rare, once, period = float(rare), float(once), int(period)
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64, 2048, device=a.device) * 0.02)
        ref = torch.nn.Parameter(p.detach().clone())
        opt = CoatAdamW([p], lr=lr, betas=(0.9, 0.95), weight_decay=0.1, backend=backend)
        ropt = torch.optim.AdamW([ref], lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
        g = torch.Generator(device=a.device).manual_seed(1)
        first, bad, worst = None, 0, 0.0
        for t in range(a.steps):
            gr = torch.zeros(64, 2048, device=a.device)
            gr[:32] = torch.randn(32, 2048, generator=g, device=a.device) * 1e-3
            if t % period == 0:
                gr[32:48] = torch.randn(16, 2048, generator=g, device=a.device) * rare
            if t == 0:
                gr[48:] = torch.randn(16, 2048, generator=g, device=a.device) * once
            p.grad = gr.clone(); ref.grad = gr.clone()
            before = p.detach().clone()
            opt.step(); ropt.step()
            d = torch.nan_to_num((p.detach() - before).abs(), nan=float("inf")).max().item()
            worst = max(worst, d)
            if d > 10 * lr:
                bad += 1; first = t if first is None else first
        fin = bool(torch.isfinite(p).all())
        print(f"| {backend} | {case} | {first} | {bad} | {worst:.3g} | {(p - ref).abs().max().item():.3g} | {fin} |", flush=True)
