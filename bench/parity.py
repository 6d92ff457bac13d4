"""Loss parity with torch AdamW: each variant trained from one seed, and the summary of such runs
over seeds.

    # CPU-sized, then the 304M GPU run
    OMP_NUM_THREADS=1 python bench/parity.py --preset tiny --steps 300 --batch-size 8 --seq-len 64 \\
        --device cpu --variants adamw,coat,coat_act,coat_nodre --max-data-bytes 8000000 --out docs/img/loss_parity_cpu_tiny
    python bench/parity.py --preset 350m --steps 600 --batch-size 12 --seq-len 1024 --lr 3e-4 \\
        --warmup 60 --device cuda --out docs/img/loss_parity_350m
    # one process per seed, all at once on one GPU, then the paired summary (tokens/s not comparable)
    python bench/parity.py --preset 350m ... --variants adamw,coat_fp8 --compile --seeds 1337 1338 1339 --out DIR
    python bench/parity.py --summary DIR/compiled_seed*.json [--bound 0.01]

Each variant starts from the same seed (identical initial weights), sees the same batches (a
batch is a pure function of seed and step) and follows the same LR schedule (linear warm-up,
cosine to 10%), with gradient clipping at 1.0; on CUDA under BF16 autocast with FP32 master
weights, on CPU in FP32. Writes <out>.json (curves, final train and validation loss, tokens/s)
and <out>.png. --summary: per variant, the mean and spread of the validation loss and of its
paired difference to torch AdamW (same seed, same batches); a parity claim rests on 3+ seeds.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import textwrap
import time

import _common as C
import torch

from coat_ds import (ActivationConfig, CoatAdamW, Fp8LinearConfig, compress_activations,  # noqa: E402
                     convert_to_fp8_linear, fuse_lm_head_loss, prepare)
from coat_ds.io.atomic import atomic_write  # noqa: E402
from coat_ds.train.determinism import deterministic_kernels  # noqa: E402
from coat_ds.train.data import DataConfig, batch_seed, load_data  # noqa: E402
from coat_ds.models.llama import Llama, model_config  # noqa: E402
from coat_ds.plan import ApplyConfig, Plan, apply_plan, compile_layer, decoder_layers  # noqa: E402

VARIANTS = {
    "adamw": "torch AdamW",
    "coat": "CoatAdamW (FP8 moments, DRE)",
    "coat_act": "CoatAdamW + FP8 activations",
    "coat_fp8": "CoatAdamW + FP8 activations + FP8 linears",
    "coat_fp8lin": "CoatAdamW + FP8 linears, activations saved as autograd keeps them",
    "coat_fp8lin_head": "coat_fp8lin with the head's loss in chunks (fuse_lm_head_loss), head GEMMs in BF16",
    "coat_fp8lin_head8x": "coat_fp8lin with the head's loss in chunks, its GEMMs in FP8 (fast_accum=False)",
    "coat_fp8lin_head_m16": "coat_fp8lin_head with master_weights='bf16+16' (BF16 parameters, exact FP32 masters)",
    "coat_fp8lin_head_m8": "coat_fp8lin_head with master_weights='bf16+8' (BF16 parameters, 24-bit masters)",
    "recipe_speed": "coat_ds.prepare(model, 'speed') + CoatAdamW",
    "recipe_memory": "coat_ds.prepare(model, 'memory') + CoatAdamW",
    "recipe_max_memory": "coat_ds.prepare(model, 'max_memory') + CoatAdamW stepping in backward, clipped exactly",
    "coat_fp8_e4m3g": "CoatAdamW + FP8 activations + FP8 linears, E4M3 output gradients",
    "coat_sib": "coat with step_in_backward: FP32 gradients freed in backward, clipped exactly in step()",
    "coat_fp8_sib": "coat_fp8 with step_in_backward: FP32 gradients freed in backward, clipped exactly in step()",
    "coat_rfp8": "coat with every block recomputed in backward from its input kept as FP8 codes",
    "coat_fp8_rfp8": "coat_fp8 with every block recomputed in backward from its input kept as FP8 codes",
    "coat_fp8_head": "coat_fp8 with the head's loss in chunks (fuse_lm_head_loss), head GEMMs in BF16",
    "coat_fp8_head8": "coat_fp8 with the head's loss in chunks and the head's GEMMs in FP8 (fp8=Fp8LinearConfig())",
    "coat_fp8_head8x": "coat_fp8_head8 with the logits' GEMM accumulating in full precision (fast_accum=False)",
    # A negative control, not run by default: per-group absmax FP8 moments without DRE. It
    # shows that the parity measurement can tell a good quantizer from a poor one.
    "coat_nodre": "CoatAdamW without DRE (control)",
}


# -- loss parity --------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


MASTER_SUFFIXES = {"_m16": "bf16+16", "_m8": "bf16+8"}


def run_variant(name: str, args, data, device: torch.device) -> dict:
    """Train one variant; returns its loss curve, final losses and throughput."""
    suffix = next((s for s in MASTER_SUFFIXES if name.endswith(s)), "")
    variant, master = name[:len(name) - len(suffix)], MASTER_SUFFIXES.get(suffix, "fp32")
    torch.manual_seed(args.seed)
    model = Llama(model_config(args.preset, max_seq_len=max(args.seq_len, 16), vocab_size=data.vocab_size)).to(device)
    betas = (0.9, 0.95)
    if variant == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=betas, weight_decay=args.weight_decay,
                                fused=device.type == "cuda")
    else:
        sib = variant.endswith("_sib") or variant == "recipe_max_memory"
        in_backward = dict(step_in_backward=True, max_grad_norm=1.0) if sib else {}
        opt = CoatAdamW(model.parameters(), lr=args.lr, betas=betas, weight_decay=args.weight_decay,
                        dynamic_range_expansion=variant != "coat_nodre", master_weights=master, **in_backward)
    if variant.startswith("recipe_"):  # the method at any size, as below: no eager size limits
        act = ActivationConfig(**{"eager_min_region_numel": 0, **args.act_config})
        prepare(model, variant[len("recipe_"):], fp8_linear=Fp8LinearConfig(eager_min_macs=0),
                compress_activations=None if variant == "recipe_speed" else act)
    if variant.startswith("coat_fp8"):  # coat_fp8lin too
        grad_format = "e4m3" if variant == "coat_fp8_e4m3g" else Fp8LinearConfig().grad_format
        convert_to_fp8_linear(model, config=Fp8LinearConfig(grad_format=grad_format, eager_min_macs=0))
    # The method at any size: eagerly small layers would otherwise stay exact (eager_min_*).
    compress = variant == "coat_act" or (variant.startswith("coat_fp8") and not variant.startswith("coat_fp8lin"))
    handle = compress_activations(model, config=ActivationConfig(**{"eager_min_region_numel": 0, **args.act_config})) \
        if compress else None
    head = variant.rpartition("_")[2]
    if head.startswith("head"):
        fuse_lm_head_loss(model, fp8={"head8": Fp8LinearConfig(), "head8x": Fp8LinearConfig(fast_accum=False)}.get(head))
    if variant.endswith("_rfp8"):
        plan = Plan.uniform([f for f, _ in decoder_layers(model)], "recompute", args.batch_size, args.seq_len)
        apply_plan(model, plan, config=ApplyConfig(recompute_input_fp8=True))
    if args.compile:
        for block in model.blocks:  # in place, as train.py --compile does
            compile_layer(block)
    bf16 = device.type == "cuda" and not args.fp32
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext

    def batch(split: str, step: int):
        x, y = data.batch(split, args.batch_size, args.seq_len, batch_seed(args.seed, step, 0, 0, split))
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    curve, timed_tokens, timed_s = [], 0, 0.0
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = C.lr_at(step, args.steps, args.warmup, args.lr)
        x, y = batch("train", step)
        _sync(device)
        t = time.perf_counter()
        with autocast():
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if not getattr(opt, "step_in_backward", False):  # in backward, the optimizer clips
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        curve.append(loss.item())  # syncs, so the timing below covers the whole step
        if step >= min(5, args.steps // 4):  # the first steps pay for compilation and warm-up
            timed_s += time.perf_counter() - t
            timed_tokens += x.numel()
        if args.log_interval and (step % args.log_interval == 0 or step == args.steps - 1):
            print(f"[{name}] step {step:5d} loss {curve[-1]:.4f} lr {opt.param_groups[0]['lr']:.2e}", flush=True)

    model.eval()
    with torch.no_grad(), autocast():
        # Validation: fixed held-out batches (same for every variant); "final train" is the
        # mean of the last 10% of steps' losses, less noisy than the last step alone.
        val = sum(model(*batch("val", 10**6 + i)).item() for i in range(args.eval_batches)) / args.eval_batches
    tail = curve[-max(1, args.steps // 10):]
    out = dict(variant=name, label=VARIANTS[name], curve=curve, final_train_loss=sum(tail) / len(tail),
               val_loss=val, tokens_per_s=timed_tokens / timed_s if timed_s else float("nan"),
               params=sum(p.numel() for p in model.parameters()))
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    if handle is not None:
        handle.remove()
    print(f"[{name}] final train {out['final_train_loss']:.4f} val {val:.4f} "
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


def run_parity(args, argv) -> int:
    args.act_config = C.act_overrides(args.act_config)
    variants = [v for v in args.variants.split(",") if v]
    if any(v not in VARIANTS for v in variants):
        raise SystemExit(f"unknown variant in {args.variants!r}; choose from {', '.join(VARIANTS)}")
    if len(args.seeds) > 1:
        return run_seeds(args, argv)
    args.seed = args.seeds[0]
    device = torch.device(args.device)
    torch.backends.cuda.enable_cudnn_sdp(not args.no_cudnn_attention)
    if args.deterministic:
        deterministic_kernels()
    data = load_data(DataConfig(max_bytes=args.max_data_bytes))
    if args.pair_vocab:
        data = C.pair_tokens(data, args.pair_vocab)
    cfg = model_config(args.preset, max_seq_len=max(args.seq_len, 16), vocab_size=data.vocab_size)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    meta = dict(command="python bench/parity.py " + " ".join(argv), device=name,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                torch=torch.__version__, preset=args.preset, params=cfg.num_params(), steps=args.steps,
                tokens_per_step=args.batch_size * args.seq_len, precision="bf16 autocast" if device.type == "cuda"
                and not args.fp32 else "fp32", data=data.description, lr=args.lr, warmup=args.warmup,
                seed=args.seed, compiled=args.compile, cudnn_attention=not args.no_cudnn_attention,
                deterministic=args.deterministic, act_config=args.act_config)
    print(json.dumps(meta), flush=True)
    t0, results = time.time(), []
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
    return 0


def run_seeds(args, argv) -> int:
    """One process per seed, all at once, then the paired summary of their JSONs."""
    if not args.out:
        raise SystemExit("--seeds with several seeds needs --out (a folder)")
    os.makedirs(args.out, exist_ok=True)
    base = C.child_argv(argv, ("--seeds", "--out"))
    mode = "compiled" if args.compile else "eager"
    procs = []
    for s in args.seeds:
        out = os.path.join(args.out, f"{mode}_seed{s}")
        with open(out + ".log", "w") as log:
            procs.append((out, subprocess.Popen([sys.executable, os.path.abspath(__file__), *base, "--seeds", str(s),
                                                 "--out", out], stdout=log, stderr=subprocess.STDOUT)))
    failed = [out for out, p in procs if p.wait() != 0]
    if failed:
        print("\n".join(open(out + ".log").read()[-3000:] for out in failed))
        return 1
    return run_summary([out + ".json" for out, _ in procs], args.bound, args.variants.split(",")[0])


# -- summary over seeds ---------------------------------------------------------------------------

_FINAL = re.compile(r"\[(?P<variant>\w+)\] final train (?P<train>\S+) val (?P<val>\S+) tokens/s (?P<tps>\S+)")


def read_run(path: str) -> dict:
    """A parity record: its --out JSON, or its log (the first line is the run's meta
    as JSON, and each finished variant prints `[variant] final train T val V tokens/s S`)."""
    if path.endswith(".json"):
        with open(path) as f:
            return json.load(f)
    with open(path) as f:
        lines = f.read().splitlines()
    summary = {}
    for line in lines:
        m = _FINAL.match(line)
        if m:
            summary[m["variant"]] = dict(final_train_loss=float(m["train"]), val_loss=float(m["val"]),
                                         tokens_per_s=float(m["tps"]))
    return dict(meta=json.loads(lines[0]), summary=summary)


def merge_by_seed(runs: list[dict]) -> list[dict]:
    """One record per seed: the variants of several runs made with the same seed and setup."""
    merged: dict = {}
    for run in runs:
        entry = merged.setdefault(run["meta"].get("seed"), dict(meta=run["meta"], summary={}))
        for variant, s in run["summary"].items():
            if variant in entry["summary"]:
                raise ValueError(f"seed {run['meta'].get('seed')}: variant {variant!r} appears twice")
            entry["summary"][variant] = s
    return list(merged.values())


def summarize(runs: list[dict], bound: float, baseline: str = "adamw") -> tuple[list[str], bool]:
    by_variant: dict[str, list[float]] = {}
    diffs: dict[str, list[float]] = {}
    tokens: dict[str, list[float]] = {}
    for run in runs:
        base = run["summary"].get(baseline)
        for variant, s in run["summary"].items():
            by_variant.setdefault(variant, []).append(s["val_loss"])
            tokens.setdefault(variant, []).append(s["tokens_per_s"])
            if base is not None and variant != baseline:
                diffs.setdefault(variant, []).append(s["val_loss"] / base["val_loss"] - 1)
    seeds = [r["meta"].get("seed") for r in runs]
    lines = [f"seeds: {seeds}",
             f"| variant | val loss mean ± sd | paired diff vs {baseline} mean ± sd | per seed | within bound |",
             "|---|---|---|---|---|"]
    ok = True
    for variant, vals in by_variant.items():
        sd = statistics.stdev(vals) if len(vals) > 1 else float("nan")
        d = diffs.get(variant)
        if d:
            dm = statistics.mean(d)
            dsd = statistics.stdev(d) if len(d) > 1 else float("nan")
            within = abs(dm) <= bound
            ok &= within
            cells = (f"{dm * 100:+.2f}% ± {dsd * 100:.2f}%", " / ".join(f"{x * 100:+.2f}%" for x in d),
                     "yes" if within else "**no**")
        else:
            cells = ("(baseline)", "", "")
        lines.append(f"| {variant} | {statistics.mean(vals):.4f} ± {sd:.4f} | " + " | ".join(cells) + " |")
    return lines, ok


def run_summary(files: list[str], bound: float, baseline: str = "adamw") -> int:
    runs = merge_by_seed([read_run(p) for p in files])
    if len(runs) < 3:
        print(f"warning: {len(runs)} run(s); a parity claim needs 3+ seeds", file=sys.stderr)
    lines, ok = summarize(runs, bound, baseline)
    print("\n".join(lines))
    return 0 if ok else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3, help="peak LR (3e-4 for the >= 100M GPU run)")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seeds", type=int, nargs="+", default=[1337], help="several: one process per seed, then summary")
    p.add_argument("--bound", type=float, default=0.01, help="the summary's allowed |mean paired difference| "
                   "(0.01 = 1%%), with several seeds or --summary")
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--variants", default="adamw,coat,coat_act", help="comma-separated subset of " + ",".join(VARIANTS))
    p.add_argument("--fp32", action="store_true", help="no BF16 autocast on CUDA")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder block (every variant)")
    p.add_argument("--no-cudnn-attention", action="store_true", help="SDPA without cuDNN's kernels (train.py's "
                   "--no-cudnn-attention)")
    p.add_argument("--deterministic", action="store_true", help="deterministic kernels (torch."
                   "use_deterministic_algorithms): on CUDA two runs of one seed end alike")
    p.add_argument("--max-data-bytes", type=int, default=32_000_000)
    p.add_argument("--pair-vocab", type=int, default=0, help="tokens of this vocabulary (> 256): byte pairs, the "
                   "most frequent as one token each (pair_tokens); 0: bytes")
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--act-config", action="append", default=[], metavar="KEY=VALUE",
                   help="an ActivationConfig field for the compressing variants (repeatable)")
    p.add_argument("--out", default="", help="write <out>.json and <out>.png (several seeds: a folder)")
    p.add_argument("--summary", nargs="+", default=None, metavar="FILE", help="combine the runs of these --out JSON "
                   "files or logs, made with different seeds (runs of one seed are merged), and exit")
    p.add_argument("--baseline", default="adamw", help="--summary: the variant the others are paired with")
    args = p.parse_args(argv)
    if args.summary:
        return run_summary(args.summary, args.bound, args.baseline)
    return run_parity(args, argv)


if __name__ == "__main__":
    sys.exit(main())
