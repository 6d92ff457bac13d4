"""Loss parity: torch AdamW vs CoatAdamW vs CoatAdamW + FP8 activations, same everything else.

    # CPU-sized (a few minutes on 2 cores)
    OMP_NUM_THREADS=1 python bench/loss_parity.py --preset tiny --steps 300 --batch-size 8 --seq-len 64 \\
        --device cpu --variants adamw,coat,coat_act,coat_nodre --max-data-bytes 8000000 \\
        --out docs/img/loss_parity_cpu_tiny
    # GPU, 304M parameters (one H100: ~7.5 minutes for all three runs, from a 40-step timing)
    python bench/loss_parity.py --preset 350m --steps 600 --batch-size 16 --seq-len 1024 \\
        --lr 3e-4 --warmup 60 --device cuda --out docs/img/loss_parity_350m

Each variant starts from the same seed (identical initial weights), sees the same batches
(a batch is a pure function of seed and step) and follows the same LR schedule (linear
warm-up, cosine to 10%), with gradient clipping at 1.0. On CUDA the forward runs under BF16
autocast with FP32 master weights for all three; on CPU in FP32 (CPU BF16 autocast is slow
and not what the GPU run measures). Writes <out>.json (curves, final train and validation
loss, tokens/s) and <out>.png (the three curves).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import sys
import textwrap
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from coat_ds import CoatAdamW, Fp8LinearConfig, compress_activations, convert_to_fp8_linear  # noqa: E402
from coat_ds.atomic import atomic_write  # noqa: E402
from coat_ds.data import DataConfig, batch_seed, load_data  # noqa: E402
from coat_ds.model import Llama, model_config  # noqa: E402

VARIANTS = {
    "adamw": "torch AdamW",
    "coat": "CoatAdamW (FP8 moments, DRE)",
    "coat_act": "CoatAdamW + FP8 activations",
    "coat_fp8": "CoatAdamW + FP8 activations + FP8 linears",
    "coat_fp8_e4m3g": "CoatAdamW + FP8 activations + FP8 linears, E4M3 output gradients",
    # A negative control, not run by default: per-group absmax FP8 moments without DRE. It
    # shows that the parity measurement can tell a good quantizer from a poor one.
    "coat_nodre": "CoatAdamW without DRE (control)",
}
DEFAULT_VARIANTS = "adamw,coat,coat_act"


def lr_at(step: int, steps: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_variant(variant: str, args, data, device: torch.device) -> dict:
    """Train one variant; returns its loss curve, final losses and throughput."""
    torch.manual_seed(args.seed)
    model = Llama(model_config(args.preset, max_seq_len=max(args.seq_len, 16))).to(device)
    betas = (0.9, 0.95)
    if variant == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=betas, weight_decay=args.weight_decay,
                                fused=device.type == "cuda")
    else:
        opt = CoatAdamW(model.parameters(), lr=args.lr, betas=betas, weight_decay=args.weight_decay,
                        dynamic_range_expansion=variant != "coat_nodre")
    if variant.startswith("coat_fp8"):
        grad_format = "e4m3" if variant == "coat_fp8_e4m3g" else Fp8LinearConfig().grad_format
        convert_to_fp8_linear(model, config=Fp8LinearConfig(grad_format=grad_format))
    handle = compress_activations(model) if variant == "coat_act" or variant.startswith("coat_fp8") else None
    if args.compile:
        for block in model.blocks:  # in place, as train.py --compile does
            block.compile()
    bf16 = device.type == "cuda" and not args.fp32
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext

    def batch(split: str, step: int):
        x, y = data.batch(split, args.batch_size, args.seq_len, batch_seed(args.seed, step, 0, 0, split))
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    curve, timed_tokens, timed_s = [], 0, 0.0
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.warmup, args.lr)
        x, y = batch("train", step)
        _sync(device)
        t = time.perf_counter()
        with autocast():
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        curve.append(loss.item())  # syncs, so the timing below covers the whole step
        if step >= min(5, args.steps // 4):  # the first steps pay for compilation and warm-up
            timed_s += time.perf_counter() - t
            timed_tokens += x.numel()
        if args.log_interval and (step % args.log_interval == 0 or step == args.steps - 1):
            print(f"[{variant}] step {step:5d} loss {curve[-1]:.4f} lr {opt.param_groups[0]['lr']:.2e}", flush=True)

    model.eval()
    with torch.no_grad(), autocast():
        # Validation: fixed held-out batches (same for every variant); "final train" is the
        # mean of the last 10% of steps' losses, less noisy than the last step alone.
        val = sum(model(*batch("val", 10**6 + i)).item() for i in range(args.eval_batches)) / args.eval_batches
    tail = curve[-max(1, args.steps // 10):]
    out = dict(variant=variant, label=VARIANTS[variant], curve=curve, final_train_loss=sum(tail) / len(tail),
               val_loss=val, tokens_per_s=timed_tokens / timed_s if timed_s else float("nan"),
               params=sum(p.numel() for p in model.parameters()))
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    if handle is not None:
        handle.remove()
    print(f"[{variant}] final train {out['final_train_loss']:.4f} val {val:.4f} "
          f"tokens/s {out['tokens_per_s']:.0f}", flush=True)
    return out


def plot(results: list[dict], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        ax.plot(r["curve"], label=f"{r['label']} (val {r['val_loss']:.4f})", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats/byte)")
    ax.set_title(f"{meta['preset']} ({meta['params'] / 1e6:.1f}M params), {meta['steps']} steps, {meta['device']}",
                 fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    footer = textwrap.fill(f"{meta['date']} — {meta['command']}", 150)
    fig.text(0.01, 0.01, footer, fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.03 * (1 + footer.count("\n")), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3, help="peak LR (3e-4 for the >= 100M GPU run)")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--eval-batches", type=int, default=20)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--fp32", action="store_true", help="no BF16 autocast on CUDA")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder block (every variant)")
    ap.add_argument("--max-data-bytes", type=int, default=32_000_000)
    ap.add_argument("--log-interval", type=int, default=50)
    ap.add_argument("--out", default="", help="write <out>.json and <out>.png")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if any(v not in VARIANTS for v in variants):
        ap.error(f"unknown variant in {args.variants!r}; choose from {', '.join(VARIANTS)}")

    device = torch.device(args.device)
    data = load_data(DataConfig(max_bytes=args.max_data_bytes))
    cfg = model_config(args.preset, max_seq_len=max(args.seq_len, 16))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    meta = dict(command="python bench/loss_parity.py " + " ".join(sys.argv[1:] if argv is None else argv),
                device=name, date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                torch=torch.__version__, preset=args.preset, params=cfg.num_params(), steps=args.steps,
                tokens_per_step=args.batch_size * args.seq_len, precision="bf16 autocast" if device.type == "cuda"
                and not args.fp32 else "fp32", data=data.description, lr=args.lr, warmup=args.warmup,
                seed=args.seed, compiled=args.compile)
    print(json.dumps(meta), flush=True)
    t0 = time.time()
    results = []
    for v in variants:
        results.append(run_variant(v, args, data, device))
        meta["seconds"] = round(time.time() - t0, 1)
        if args.out and v != variants[-1]:  # a run cut short keeps the variants it finished
            _write(args.out, meta, _summary(results), results)
    summary = _summary(results)
    print(json.dumps(summary, indent=1))
    if args.out:
        _write(args.out, meta, summary, results)
        plot(results, meta, args.out + ".png")
    return dict(meta=meta, summary=summary, runs=results)


def _summary(results: list[dict]) -> dict:
    base = next((r for r in results if r["variant"] == "adamw"), None)
    summary = {}
    for r in results:
        summary[r["variant"]] = {k: r[k] for k in ("final_train_loss", "val_loss", "tokens_per_s")}
        if base is not None:
            summary[r["variant"]]["val_rel_diff_vs_adamw"] = r["val_loss"] / base["val_loss"] - 1
    return summary


def _write(out: str, meta: dict, summary: dict, results: list[dict]) -> None:
    with atomic_write(out + ".json") as f:  # a killed run leaves the previous JSON whole
        json.dump(dict(meta=meta, summary=summary, runs=results), f, indent=1)


if __name__ == "__main__":
    main()
