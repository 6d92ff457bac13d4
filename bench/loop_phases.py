"""Where the time of bench/loss_parity.py's training step goes, by phase, per variant: the
same loop (350m preset, 12 x 1024 tokens, BF16 autocast, an LR that changes every step,
gradient clipping, a loss.item() per step), each phase closed by a synchronize.

    python bench/loop_phases.py            # eager
    python bench/loop_phases.py --compile  # every block compiled, as loss_parity.py --compile

Prints, per variant, medians over 10 steps each (of 20, after 8 warm-up steps): the whole
step without extra synchronizes (what loss_parity.py's tokens/s measures), from the even
steps; then from the odd ones forward, backward, clipping and opt.step() each to the end of
its GPU work, and opt.step()'s host time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from coat_ds import CoatAdamW, compress_activations
from coat_ds.data import DataConfig, batch_seed, load_data
from coat_ds.model import Llama, model_config
from loss_parity import lr_at


def run(variant: str, compile_blocks: bool, data, steps: int = 28, warmup: int = 8) -> dict:
    torch.manual_seed(1337)
    model = Llama(model_config("350m", max_seq_len=1024)).cuda()
    if variant == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    else:
        opt = CoatAdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    handle = compress_activations(model) if variant == "coat_act" else None
    if compile_blocks:
        for block in model.blocks:
            block.compile()
    phases = {k: [] for k in ("step", "forward", "backward", "clip", "opt.step", "opt.step host")}
    for i in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(i, 600, 60, 3e-4)
        x, y = data.batch("train", 12, 1024, batch_seed(1337, i, 0, 0, "train"))
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        synced = i % 2 == 1  # odd steps: phases; even steps: the step as loss_parity runs it
        torch.cuda.synchronize()
        t = [time.perf_counter()]

        def mark():
            if synced:
                torch.cuda.synchronize()
                t.append(time.perf_counter())

        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        mark()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        mark()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        mark()
        h0 = time.perf_counter()
        opt.step()
        h1 = time.perf_counter()
        mark()
        loss.item()
        t.append(time.perf_counter())
        if i >= warmup:
            if synced:
                for k, a, b in (("forward", 0, 1), ("backward", 1, 2), ("clip", 2, 3), ("opt.step", 3, 4)):
                    phases[k].append((t[b] - t[a]) * 1e3)
                phases["opt.step host"].append((h1 - h0) * 1e3)
            else:
                phases["step"].append((t[-1] - t[0]) * 1e3)
    if handle is not None:
        handle.remove()
    return {k: statistics.median(v) for k, v in phases.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--variants", default="adamw,coat,coat_act")
    args = ap.parse_args()
    data = load_data(DataConfig(max_bytes=32_000_000))
    rows = {v: run(v, args.compile, data) for v in args.variants.split(",")}
    mode = "compiled" if args.compile else "eager"
    print(f"\n## loss_parity.py's step by phase, ms, {mode} ({torch.cuda.get_device_name()})")
    cols = list(next(iter(rows.values())))
    print(f"{'variant':<10}" + "".join(f"{c:>15}" for c in cols))
    for v, r in rows.items():
        print(f"{v:<10}" + "".join(f"{r[c]:>15.1f}" for c in cols))


if __name__ == "__main__":
    main()
