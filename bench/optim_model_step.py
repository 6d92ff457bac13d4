"""Optimizer step inside a training loop: torch AdamW(fused=True) vs CoatAdamW on the 350m
preset (coat_ds.model, 304M parameters in 171 tensors, 12 x 1024 tokens, BF16 autocast, one
GPU). Forward + backward first, then `opt.step()` timed on the host (launch) and to the end of
its GPU work (synchronize before and after).

    python bench/optim_model_step.py

Median of 20 steps after 5 warm-up steps.
"""
import statistics
import time

import torch

from coat_ds import CoatAdamW
from coat_ds.model import Llama, model_config

dev = "cuda"
for name in ("adamw", "coat"):
    torch.manual_seed(0)
    model = Llama(model_config("350m", max_seq_len=1024)).to(dev)
    opt = (torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
           if name == "adamw" else CoatAdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1))
    x = torch.randint(0, 256, (12, 1024), device=dev)
    y = torch.randint(0, 256, (12, 1024), device=dev)
    fb, st, tot = [], [], []
    for i in range(25):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        loss.item()
        if i >= 5:
            fb.append((t1 - t0) * 1e3)
            st.append((t2 - t1) * 1e3)
            tot.append((t3 - t1) * 1e3)
    n = sum(p.numel() for p in model.parameters())
    k = len(list(model.parameters()))
    print(f"{name}: {k} tensors {n / 1e6:.0f}M | fwd+bwd {statistics.median(fb):.1f} ms | "
          f"step host {statistics.median(st):.2f} ms | step total {statistics.median(tot):.2f} ms")
    del model, opt
