"""Accuracy: loss parity with torch AdamW, its summary over seeds, and the moment quantization
table (the analogue of Table 1 of the COAT paper).

    # loss parity, CPU-sized (a few minutes on 2 cores), then the 304M GPU run
    OMP_NUM_THREADS=1 python bench/accuracy.py parity --preset tiny --steps 300 --batch-size 8 --seq-len 64 \\
        --device cpu --variants adamw,coat,coat_act,coat_nodre --max-data-bytes 8000000 --out docs/img/loss_parity_cpu_tiny
    python bench/accuracy.py parity --preset 350m --steps 600 --batch-size 12 --seq-len 1024 --lr 3e-4 \\
        --warmup 60 --device cuda --out docs/img/loss_parity_350m
    # one process per seed, all at once on one GPU, then the paired summary (tokens/s not comparable)
    python bench/accuracy.py parity --preset 350m ... --variants adamw,coat_fp8 --compile --seeds 1337 1338 1339 --out DIR
    python bench/accuracy.py summary DIR/compiled_seed*.json [--bound 0.01]
    python bench/accuracy.py quant-table [--preset small --steps 150 --json docs/img/quant_table.json]
    # where compression's gradient error goes, eager and compiled, after 150 AdamW steps
    python bench/accuracy.py grad-error --preset 350m --device cuda --batch-size 12 --seq-len 1024 --pair-vocab 32000

parity: each variant starts from the same seed (identical initial weights), sees the same batches
(a batch is a pure function of seed and step) and follows the same LR schedule (linear warm-up,
cosine to 10%), with gradient clipping at 1.0; on CUDA under BF16 autocast with FP32 master
weights, on CPU in FP32. Writes <out>.json (curves, final train and validation loss, tokens/s)
and <out>.png. summary: per variant, the mean and spread of the validation loss and of its
paired difference to torch AdamW (same seed, same batches); a parity claim rests on 3+ seeds.
quant-table: trains a preset with torch AdamW, then the MSE of m / sqrt(v) after a quantize ->
dequantize round trip of its moments for every pair of {E4M3, E5M2} x {DRE or not} (groups of
128), and groups holding exact zeros: our DRE against OUR MODEL of the published reference
kernel's choice of min (see `reference_kernel_roundtrip`).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import textwrap
import time

import _common as C  # noqa: F401  (puts the measured tree's coat_ds on the path)
import torch

from coat_ds import (ActivationConfig, CoatAdamW, Fp8LinearConfig, compress_activations,  # noqa: E402
                     convert_to_fp8_linear, fuse_lm_head_loss)
from coat_ds.io.atomic import atomic_write  # noqa: E402
from coat_ds.train.data import DataConfig, TokenData, batch_seed, load_data  # noqa: E402
from coat_ds.kernels import get_format, reference as R  # noqa: E402
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

def pair_tokens(data: TokenData, vocab: int) -> TokenData:
    """`data` (bytes) in a vocabulary of `vocab` tokens, for a realistically sized LM head
    without a downloaded tokenizer: each byte pair at an even offset is one token (256 + its
    rank) if it is among the vocab - 256 pairs most frequent at even offsets of the train
    split, else its two bytes. Deterministic, a pure function of the data."""
    if not 256 < vocab <= 256 + 65536:
        raise SystemExit(f"--pair-vocab must be in (256, {256 + 65536}], got {vocab}")
    train = data.train.long()
    pairs = train[:train.numel() // 2 * 2].view(-1, 2)
    freq = torch.bincount(pairs[:, 0] * 256 + pairs[:, 1], minlength=65536)
    rank = torch.full((65536,), -1, dtype=torch.long)
    rank[torch.sort(freq, descending=True, stable=True).indices[:vocab - 256]] = torch.arange(vocab - 256)

    def encode(t: torch.Tensor) -> torch.Tensor:
        t = t.long()
        p = t[:t.numel() // 2 * 2].view(-1, 2)
        r = rank[p[:, 0] * 256 + p[:, 1]]
        one = r >= 0
        width = torch.where(one, 1, 2)
        at = torch.cumsum(width, 0) - width
        out = torch.empty(int(width.sum()), dtype=torch.long)
        out[at[one]] = 256 + r[one]
        out[at[~one]], out[at[~one] + 1] = p[~one, 0], p[~one, 1]
        return out

    tr, va = encode(data.train), encode(data.val)
    return TokenData(tr, va, vocab, f"{data.description}, as {vocab} byte-pair tokens ({tr.numel():,} train / "
                     f"{va.numel():,} val)")


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
    model = Llama(model_config(args.preset, max_seq_len=max(args.seq_len, 16), vocab_size=data.vocab_size)).to(device)
    betas = (0.9, 0.95)
    if variant == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=betas, weight_decay=args.weight_decay,
                                fused=device.type == "cuda")
    else:
        in_backward = dict(step_in_backward=True, max_grad_norm=1.0) if variant.endswith("_sib") else {}
        opt = CoatAdamW(model.parameters(), lr=args.lr, betas=betas, weight_decay=args.weight_decay,
                        dynamic_range_expansion=variant != "coat_nodre", **in_backward)
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
            g["lr"] = lr_at(step, args.steps, args.warmup, args.lr)
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



def deterministic() -> None:
    """Kernels whose sums do not depend on timing (no atomic float adds: SDPA's and the
    embedding's backward), cuBLAS with a fixed workspace, Inductor without autotuning: two
    runs of one seed then end bit for bit alike, so a paired difference is the variants' own,
    not run-to-run noise. Before the first CUDA call: cuBLAS reads its setting at start."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    # NaN-filling every torch.empty costs time and checks nothing this run needs.
    torch.utils.deterministic.fill_uninitialized_memory = False


def act_overrides(pairs: list[str]) -> dict:
    """--act-config KEY=VALUE pairs as ActivationConfig keywords ("true"/"false" as bools,
    digits as ints), checked by building the config once."""
    fields = {f.name for f in dataclasses.fields(ActivationConfig)}
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or key not in fields:
            raise SystemExit(f"--act-config {pair!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(fields))}")
        low = value.lower()
        out[key] = low == "true" if low in ("true", "false") else int(value) if value.lstrip("-").isdigit() else value
    try:
        ActivationConfig(**out)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"--act-config: {e}") from None
    return out


def run_parity(args, argv) -> int:
    args.act_config = act_overrides(args.act_config)
    variants = [v for v in args.variants.split(",") if v]
    if any(v not in VARIANTS for v in variants):
        raise SystemExit(f"unknown variant in {args.variants!r}; choose from {', '.join(VARIANTS)}")
    if len(args.seeds) > 1:
        return run_seeds(args, argv)
    args.seed = args.seeds[0]
    device = torch.device(args.device)
    torch.backends.cuda.enable_cudnn_sdp(not args.no_cudnn_attention)
    if args.deterministic:
        deterministic()
    data = load_data(DataConfig(max_bytes=args.max_data_bytes))
    if args.pair_vocab:
        data = pair_tokens(data, args.pair_vocab)
    cfg = model_config(args.preset, max_seq_len=max(args.seq_len, 16), vocab_size=data.vocab_size)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    meta = dict(command="python bench/accuracy.py " + " ".join(argv), device=name,
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


# -- the moment quantization table -----------------------------------------------------------------

FORMATS = [("e4m3", False), ("e4m3", True), ("e5m2", False), ("e5m2", True)]
EPS = 1e-8  # AdamW's eps, added to sqrt(v) as the update does
GROUP = 128


def label(fmt: str, dre: bool) -> str:
    return fmt.upper() + ("+DRE" if dre else "")


def train_moments(preset: str, steps: int, batch_size: int, seq_len: int, seed: int, lr: float,
                  data=None) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor]], float, float]:
    """Train `preset` with torch AdamW; return [(name, m, v)] of the tensors with >= 4096
    elements, and the first and last train loss (so a reader sees that it trained)."""
    torch.manual_seed(seed)
    data = data or load_data(DataConfig(max_bytes=4_000_000))
    model = Llama(model_config(preset))
    # OLMo's betas (0.9, 0.95), which the paper's runs use: beta2 sets how far v lags g^2.
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    first = last = float("nan")
    for step in range(steps):
        x, y = data.batch("train", batch_size, seq_len, batch_seed(seed, step, 0, 0))
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        first = loss.item() if step == 0 else first
        last = loss.item()
    moments = [(n, opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
               for n, p in model.named_parameters() if p.numel() >= 4096]
    return moments, first, last


def roundtrip(x: torch.Tensor, fmt: str, dre: bool) -> torch.Tensor:
    return R.dequantize_groups(R.quantize_groups(x, GROUP, fmt, dre), GROUP, fmt)


def update_sq_err(m, v, mq, vq) -> torch.Tensor:
    """Squared error of m / (sqrt(v) + eps) per element."""
    return (mq / (vq.sqrt() + EPS) - m / (v.sqrt() + EPS)) ** 2


def quant_table(moments) -> dict[tuple[str, str], float]:
    """MSE of m/sqrt(v) over all elements of all tensors, per (first, second) format."""
    out = {}
    for fm, dm in FORMATS:
        mqs = [roundtrip(m, fm, dm) for _, m, _ in moments]
        for fv, dv in FORMATS:
            total, n = 0.0, 0
            for (_, m, v), mq in zip(moments, mqs):
                total += update_sq_err(m, v, mq, roundtrip(v, fv, dv)).sum().item()
                n += m.numel()
            out[(label(fm, dm), label(fv, dv))] = total / n
    return out


# ---- A model of the published reference kernel's DRE, for the zero-group comparison --------
#
# What the COAT reference CUDA kernel (fp8_adamw_expand) does per group of 128, as we read it:
# min and max are taken over |x| of ALL elements, zeros included, and 1e-20 is added to both;
# k = floor(16 * log2(448^2 / 2) / log2(max / min)) / 16; c = sqrt(max * min);
# y = sign(x) * (|x| / c)^k, scale = (max / c)^k / 448, code = fp8(y / scale);
# decode x = sign(q) * (q * scale)^(1/k) * c. E4M3 only there; we let `fmt` vary for symmetry.
# This is OUR code modelling that behaviour to measure its defect, not the reference's code.
REF_EPS = 1e-20
REF_K_STEPS = 16  # k rounded down to a multiple of 1/16, as our K_ONE


def reference_kernel_roundtrip(x: torch.Tensor, fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize -> dequantize flat `x` (numel a multiple of 128) the reference kernel's way:
    (decoded values, per-group k)."""
    f = get_format(fmt)
    g = x.reshape(-1, GROUP).to(torch.float32)
    a = g.abs()
    amax = a.amax(-1) + REF_EPS
    amin = a.amin(-1) + REF_EPS  # the defect: an exact zero makes this 1e-20
    target = math.log2(f.max * f.max / 2)
    # A constant or all-zero group has log2(max/min) = 0: k = +inf, as in the kernel.
    k = torch.floor(REF_K_STEPS * target / torch.log2(amax / amin)) / REF_K_STEPS
    c = torch.sqrt(amax * amin)
    scale = torch.pow(amax / c, k) / f.max
    y = torch.pow(a / c[:, None], k[:, None]) / scale[:, None]
    q = R.decode_fp8(R.encode_fp8(y, f), f)  # saturating, round-to-nearest-even, as the cast
    q = torch.where(g < 0, -q, q)
    # The decode takes its sign from the sign bit (+0 counts as positive), and with k = inf
    # it computes pow(q * scale, 0) = 1 even for q = 0: an all-zero group decodes to +c = 1e-20.
    dec = torch.pow(q.abs() * scale[:, None], 1.0 / k[:, None]) * c[:, None]
    return torch.where(torch.signbit(q), -dec, dec).reshape(x.shape), k


def zero_group_study(moments, fmt: str = "e4m3") -> dict:
    """Flat moment buffer (tensors concatenated, groups of 128 consecutive elements: the
    layout of a DeepSpeed ZeRO-1/2 partition and of the reference kernel) split into groups
    that are all nonzero, mixed (some exact zeros) and all zero; MSE of m/sqrt(v) with our
    DRE and with the reference kernel's min, per kind of group."""
    m = torch.cat([t.flatten() for _, t, _ in moments])
    v = torch.cat([t.flatten() for _, _, t in moments])
    n = m.numel() // GROUP * GROUP  # drop a ragged tail: the model handles full groups only
    m, v = m[:n], v[:n]
    ours_m, ours_v = roundtrip(m, fmt, True), roundtrip(v, fmt, True)
    ref_m, k_m = reference_kernel_roundtrip(m, fmt)
    ref_v, k_v = reference_kernel_roundtrip(v, fmt)
    zeros = (m == 0).reshape(-1, GROUP).sum(-1)
    kinds = {"nonzero": zeros == 0, "mixed": (zeros > 0) & (zeros < GROUP), "all_zero": zeros == GROUP}
    err_ours = update_sq_err(m, v, ours_m, ours_v).reshape(-1, GROUP)
    err_ref = update_sq_err(m, v, ref_m, ref_v).reshape(-1, GROUP)
    # Our kcode for the same groups, on the flat layout (one row of n elements).
    ours_k = R.quantize_groups(m, GROUP, fmt, True).kcode.float().flatten() / 16
    out = {"format": fmt, "groups": int(zeros.numel())}
    for name, sel in kinds.items():
        row = {"groups": int(sel.sum())}
        if row["groups"]:
            mse = lambda e: e[sel].mean().item()  # noqa: E731
            row.update(mse_ours=mse(err_ours), mse_reference_model=mse(err_ref),
                       k_m_ours_median=ours_k[sel].median().item(),
                       k_m_reference_median=k_m[sel].median().item(),
                       k_v_reference_median=k_v[sel].median().item())
            nz = (m.reshape(-1, GROUP) != 0) & sel[:, None]
            if nz.any():
                rel = lambda d: ((d.reshape(-1, GROUP) - m.reshape(-1, GROUP)).abs()[nz]  # noqa: E731
                                 / m.reshape(-1, GROUP).abs()[nz]).median().item()
                row.update(m_rel_err_median_ours=rel(ours_m), m_rel_err_median_reference_model=rel(ref_m))
            else:
                row.update(decoded_m_ours_max=ours_m.reshape(-1, GROUP)[sel].abs().max().item(),
                           decoded_m_reference_max=ref_m.reshape(-1, GROUP)[sel].abs().max().item(),
                           decoded_v_reference_max=ref_v.reshape(-1, GROUP)[sel].abs().max().item())
        out[name] = row
    return out


def planted_zero_study(moments, fmt: str = "e4m3") -> dict:
    """Controlled version on real values: in every all-nonzero group of the flat buffer, set
    the first element of m and v to exact zero (as if that coordinate never got a gradient)
    and measure the error on the other 127 elements, ours vs the reference-kernel model."""
    m = torch.cat([t.flatten() for _, t, _ in moments])
    v = torch.cat([t.flatten() for _, _, t in moments])
    n = m.numel() // GROUP * GROUP
    mg, vg = m[:n].reshape(-1, GROUP), v[:n].reshape(-1, GROUP)
    keep = (mg != 0).all(-1) & (vg != 0).all(-1)
    mg, vg = mg[keep].clone(), vg[keep].clone()
    mg[:, 0] = 0.0
    vg[:, 0] = 0.0
    m, v = mg.flatten(), vg.flatten()
    rest = torch.ones_like(mg, dtype=torch.bool)
    rest[:, 0] = False
    rest = rest.flatten()
    out = {"format": fmt, "groups": int(keep.sum())}
    for name, (mq, vq) in {"ours": (roundtrip(m, fmt, True), roundtrip(v, fmt, True)),
                           "reference_model": (reference_kernel_roundtrip(m, fmt)[0],
                                               reference_kernel_roundtrip(v, fmt)[0])}.items():
        out[f"mse_{name}"] = update_sq_err(m, v, mq, vq)[rest].mean().item()
        out[f"m_rel_err_median_{name}"] = ((mq - m).abs()[rest] / m.abs()[rest]).median().item()
        out[f"v_rel_err_median_{name}"] = ((vq - v).abs()[rest] / v.abs()[rest]).median().item()
    return out


def markdown(table: dict, zero: dict, planted: dict) -> str:
    cols = [label(*f) for f in FORMATS]
    best = min(table.values())
    lines = [f"| first \\ second | {' | '.join(cols)} |", "|---" * (len(cols) + 1) + "|"]
    for r in cols:
        cells = []
        for c in cols:
            s = f"{table[(r, c)]:.4g}"
            cells.append(f"**{s}**" if table[(r, c)] == best else s)
        lines.append(f"| {r} | {' | '.join(cells)} |")
    lines.append("")
    lines.append(f"DRE gain, E4M3/E4M3 -> E4M3+DRE/E4M3+DRE: "
                 f"{table[('E4M3', 'E4M3')] / table[('E4M3+DRE', 'E4M3+DRE')]:.2f}x")
    lines.append("")
    lines.append(f"Zero-containing groups (flat buffer, {zero['format'].upper()}, groups of {GROUP}):")
    lines.append("")
    lines.append("| groups | count | MSE ours | MSE reference-kernel model | median k(m) ours | "
                 "median k(m) ref. model | median rel. err of nonzero m, ours | same, ref. model |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for name in ("nonzero", "mixed", "all_zero"):
        z = zero[name]
        if not z["groups"]:
            lines.append(f"| {name} | 0 | | | | | | |")
            continue
        lines.append(f"| {name} | {z['groups']} | {z['mse_ours']:.4g} | {z['mse_reference_model']:.4g} | "
                     f"{z['k_m_ours_median']:.4g} | {z['k_m_reference_median']:.4g} | "
                     + (f"{z['m_rel_err_median_ours']:.3g} | {z['m_rel_err_median_reference_model']:.3g} |"
                        if "m_rel_err_median_ours" in z else
                        f"decodes to max {z['decoded_m_ours_max']:.3g} | decodes to max "
                        f"{z['decoded_m_reference_max']:.3g} (v: {z['decoded_v_reference_max']:.3g}) |"))
    lines.append("")
    lines.append(f"One exact zero planted into each of {planted['groups']} real all-nonzero groups "
                 f"(error on the other 127 elements):")
    lines.append("")
    lines.append("| quantizer | MSE of m/sqrt(v) | median rel. err of m | median rel. err of v |")
    lines.append("|---|---|---|---|")
    for name, title in (("ours", "ours (min over nonzeros)"), ("reference_model", "reference-kernel model")):
        lines.append(f"| {title} | {planted['mse_' + name]:.4g} | {planted['m_rel_err_median_' + name]:.3g} | "
                     f"{planted['v_rel_err_median_' + name]:.3g} |")
    return "\n".join(lines)



def run_quant_table(args, argv) -> int:
    t0 = time.time()
    data = load_data(DataConfig(max_bytes=4_000_000))
    moments, l0, l1 = train_moments(args.preset, args.steps, args.batch_size, args.seq_len, args.seed, args.lr, data)
    table = quant_table(moments)
    zmoments, zl0, zl1 = train_moments(args.zero_preset, args.zero_steps, args.batch_size, args.seq_len,
                                       args.seed, args.lr, data)
    zero, planted = zero_group_study(zmoments), planted_zero_study(moments)
    meta = dict(command="python bench/accuracy.py " + " ".join(argv),
                device=f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                torch=torch.__version__, preset=args.preset, steps=args.steps,
                tokens_per_step=args.batch_size * args.seq_len, loss_first=l0, loss_last=l1,
                zero_preset=args.zero_preset, zero_loss_first=zl0, zero_loss_last=zl1,
                elements=sum(m.numel() for _, m, _ in moments), seconds=round(time.time() - t0, 1))
    print(json.dumps(meta, indent=1))
    print(markdown(table, zero, planted))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, table={f"{a} / {b}": e for (a, b), e in table.items()}, zero_groups=zero,
                           planted_zero=planted), f, indent=1)
    return 0


# -- gradient error of compression, eager and compiled --------------------------------------------


def _sqnr_db(want: torch.Tensor, got: torch.Tensor) -> float:
    err = (want - got).pow(2).sum().clamp_min(1e-30)
    return (10 * torch.log10(want.pow(2).sum() / err)).item()


def run_grad_error(args, argv) -> int:
    """Train a model with torch AdamW, then one batch's weight gradients with
    `compress_activations` against without it, eagerly and with every block compiled: per
    parameter kind (over layers) the SQNR in dB and the norm ratio. Where compression's error
    goes, without a whole training run per question. On CUDA with deterministic kernels, so
    that the difference is compression's alone."""
    act = act_overrides(args.act_config)
    modes = args.modes.split(",")
    if any(m not in ("eager", "compiled", "compiled_cqkv") for m in modes):
        raise SystemExit(f"--modes {args.modes!r}: choose from eager, compiled, compiled_cqkv")
    device = torch.device(args.device)
    if device.type == "cuda":
        deterministic()  # else two uncompressed runs already differ (SDPA's and the embedding's backward)
    torch.manual_seed(args.seed)
    data = load_data(DataConfig(max_bytes=args.max_data_bytes))
    if args.pair_vocab:
        data = pair_tokens(data, args.pair_vocab)
    base = Llama(model_config(args.preset, max_seq_len=max(args.seq_len, 16), vocab_size=data.vocab_size)).to(device)
    bf16 = device.type == "cuda"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    opt = torch.optim.AdamW(base.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    loss = float("nan")
    for step in range(args.train_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.train_steps, args.warmup, args.lr)
        x, y = (t.to(device) for t in data.batch("train", args.batch_size, args.seq_len,
                                                  batch_seed(args.seed, step, 0, 0, "train")))
        with autocast():
            loss = base(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(base.parameters(), 1.0)
        opt.step()
        loss = loss.item()
    del opt
    base.zero_grad(set_to_none=True)
    x, y = (t.to(device) for t in data.batch("train", args.grad_batch_size, args.seq_len,
                                              batch_seed(args.seed, 10**6, 0, 0, "train")))

    def grads(compress: bool, compiled: bool, cqkv: bool = False) -> dict:
        model = copy.deepcopy(base)
        cfg = ActivationConfig(**{"eager_min_region_numel": 0, **act, **({"compress_attention_inputs": True}
                                                                           if cqkv else {})})
        handle = compress_activations(model, config=cfg) if compress else None
        if compiled:
            for block in model.blocks:
                compile_layer(block)
        with autocast():
            model(x, y).backward()
        out = {n: p.grad.float() for n, p in model.named_parameters()}
        if handle is not None:
            handle.remove()
        torch._dynamo.reset()
        return out

    rows, uncompressed = collections.defaultdict(list), {}
    for mode in modes:
        compiled = mode.startswith("compiled")
        if compiled not in uncompressed:  # compiled and compiled_cqkv share their reference
            uncompressed[compiled] = grads(False, compiled)
        want, got = uncompressed[compiled], grads(True, compiled, mode == "compiled_cqkv")
        for n in want:
            kind = n.split(".", 2)[2] if n.startswith("blocks.") else n
            rows[kind, mode].append((_sqnr_db(want[n], got[n]), (got[n].norm() / want[n].norm()).item()))
    print(json.dumps(dict(command="python bench/accuracy.py " + " ".join(argv), device=str(
        torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"), torch=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), preset=args.preset,
        train_steps=args.train_steps, train_loss=loss, act_config=act)))
    print("| parameter | " + " | ".join(f"{m}: SQNR dB, mean (min) | {m}: norm ratio, mean" for m in modes) + " |")
    print("|---|" + "---|---|" * len(modes))
    for kind in dict.fromkeys(k for k, _ in rows):
        cells = []
        for m in modes:
            v = rows[kind, m]
            cells += [f"{statistics.mean(d for d, _ in v):.1f} ({min(d for d, _ in v):.1f})",
                      f"{statistics.mean(r for _, r in v):.4f}"]
        print(f"| {kind} | " + " | ".join(cells) + " |")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("parity", help="train the variants from one seed and compare their losses")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3, help="peak LR (3e-4 for the >= 100M GPU run)")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seeds", type=int, nargs="+", default=[1337], help="several: one process per seed, then summary")
    p.add_argument("--bound", type=float, default=0.01, help="with several seeds: the summary's bound")
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
    s = sub.add_parser("summary", help="combine parity runs made with different seeds")
    s.add_argument("files", nargs="+", help="parity --out JSON files or logs; runs of one seed are merged")
    s.add_argument("--bound", type=float, default=0.01, help="allowed |mean paired difference| (0.01 = 1%%)")
    s.add_argument("--baseline", default="adamw", help="the variant the others are paired with")
    q = sub.add_parser("quant-table", help="quantization error of real AdamW moments")
    q.add_argument("--preset", default="small", help="model preset for the table (default: small, ~3.3M)")
    q.add_argument("--steps", type=int, default=150)
    q.add_argument("--batch-size", type=int, default=16)
    q.add_argument("--seq-len", type=int, default=128)
    q.add_argument("--lr", type=float, default=1e-3)
    q.add_argument("--zero-preset", default="tiny", help="preset for the zero-group study: tiny's 64-wide embedding "
                   "rows put two rows (one used byte, one unused) into some 128-groups of the flat buffer")
    q.add_argument("--zero-steps", type=int, default=150)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--json", default="", help="also write the numbers here")
    g = sub.add_parser("grad-error", help="one batch's gradient error of compression, eager and compiled, "
                       "after training with torch AdamW")
    g.add_argument("--preset", default="tiny")
    g.add_argument("--device", default="cpu")
    g.add_argument("--train-steps", type=int, default=150)
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--grad-batch-size", type=int, default=4)
    g.add_argument("--seq-len", type=int, default=128)
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--warmup", type=int, default=30)
    g.add_argument("--seed", type=int, default=1341)
    g.add_argument("--max-data-bytes", type=int, default=32_000_000)
    g.add_argument("--pair-vocab", type=int, default=0)
    g.add_argument("--modes", default="eager,compiled,compiled_cqkv", help="comma-separated: eager, compiled, "
                   "compiled_cqkv (compiled with compress_attention_inputs=True)")
    g.add_argument("--act-config", action="append", default=[], metavar="KEY=VALUE",
                   help="an ActivationConfig field (repeatable)")
    args = ap.parse_args(argv)
    if args.cmd == "summary":
        return run_summary(args.files, args.bound, args.baseline)
    if args.cmd == "grad-error":
        return run_grad_error(args, argv)
    return (run_parity if args.cmd == "parity" else run_quant_table)(args, argv)


if __name__ == "__main__":
    sys.exit(main())
