"""Held-out loss over a long run, one side per launch: train.py (FSDP2, compiled) on every GPU of
the machine, on a corpus given as a directory or a glob (the installed packages' Python sources
by default), tokenised with a local 32,000-id BPE, evaluated every --eval-interval steps. A side
saves every --save-interval steps into its folder and resumes from it, so a side too long for one
launch goes on in the next one on the same machine; --limit ends a launch in time, losing at most
the steps since its last save. `plot` draws every side's held-out curve against tokens seen and
prints each side's last held-out loss against bf16's:

    bash bench/device_env.sh python bench/convergence.py run bf16 --tokens 150e6 --limit 540
    bash bench/device_env.sh python bench/convergence.py run speed --tokens 150e6 --limit 540
    python bench/convergence.py plot runs/convergence --png docs/img/convergence_1b.png

Sides: bf16 (the bf16 JSON: BF16 compute, torch AdamW) and the coat JSON (CoatAdamW) with
train.py --recipe speed, memory or max_memory; --name and train.py flags after -- make variants
(`run speed --name speed_m8 -- --master-weights bf16+8`). Same seed, data, batches and schedule.
The table's last two columns show a run under load: tokens/s and peak memory from the third
logged window to the last (`run speed --micro 24 --limit 590`: the largest micro-batch, 10 min)."""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import sysconfig

import _common as C
from scaling import RECIPE_SIDES, with_micro_batch


def default_corpus() -> str:
    return os.path.join(sysconfig.get_paths()["purelib"], "**", "*.py")


def run(args) -> int:
    world = args.nproc or C.ngpu()
    tokens_per_step = args.micro * args.seq * world
    steps = math.ceil(args.tokens / tokens_per_step)
    name = args.name or args.side
    side_dir = os.path.join(args.out, name)
    os.makedirs(side_dir, exist_ok=True)
    save = os.path.join(side_dir, "ckpt")
    resume = ["--resume", save] if os.path.isfile(os.path.join(save, "latest")) else []
    kind, flags = RECIPE_SIDES[args.side]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "train.py", "--fsdp",
           "--deepspeed", with_micro_batch(f"{kind}_zero3", args.micro), "--preset", args.preset, "--seq-len", str(args.seq),
           "--data", args.data, "--tokenizer", "bpe", "--bpe-vocab-size", str(args.vocab), "--data-cache",
           os.path.join(args.out, "cache"), "--max-steps", str(steps), "--warmup-steps", str(max(1, steps // 50)),
           "--eval-interval", str(args.eval_interval), "--eval-batches", str(args.eval_batches), "--log-interval",
           str(args.log_interval), "--save-dir", save, "--save-interval", str(args.save_interval),
           "--metrics-file", os.path.join(side_dir, "metrics.jsonl"), *(["--compile"] if args.compile else []),
           *flags, *resume, *args.extra]
    print(f"{name}: {steps} steps of {args.micro} x {args.seq} tokens on {world} ranks "
          f"({steps * tokens_per_step / 1e6:.1f}M tokens){', resuming ' + save if resume else ''}", flush=True)
    json.dump({"tokens_per_step": tokens_per_step, "steps": steps}, open(os.path.join(side_dir, "run.json"), "w"))
    code = C.launch(cmd, os.path.join(side_dir, "train.log"), args.limit, append=True)
    done = max((m["step"] for m in _metrics(side_dir) if "loss" in m), default=0)
    print(f"{name}: exit {code}, at step {done} of {steps}" + (" (run it again to go on)" if done < steps else ""),
          flush=True)
    return 0 if code in (0, 124) else code


def _metrics(side_dir: str) -> list[dict]:
    path = os.path.join(side_dir, "metrics.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.isfile(path) else []


def curves(out: str) -> dict[str, list[tuple[float, float]]]:
    """Each side's (tokens seen, held-out loss) points, from its metrics file."""
    found = {}
    for side_dir in sorted(glob.glob(os.path.join(out, "*", "metrics.jsonl"))):
        side = os.path.basename(os.path.dirname(side_dir))
        records = _metrics(os.path.dirname(side_dir))
        per_step = json.load(open(os.path.join(os.path.dirname(side_dir), "run.json")))["tokens_per_step"]
        points = [(m["step"] * per_step, m["eval_loss"]) for m in records if "eval_loss" in m]
        if points:
            found[side] = sorted(points)
    return found


def plot(args) -> int:
    found = curves(args.out)
    if not found:
        raise SystemExit(f"no held-out losses under {args.out}/*/metrics.jsonl")
    base = found["bf16"][-1][1] if "bf16" in found else None
    print("| side | tokens | last held-out loss | vs bf16 | tokens/s, 3rd window -> last | peak GB, 3rd window -> last |"
          "\n|---|---|---|---|---|---|")
    for side, pts in found.items():
        vs = f"{100 * (pts[-1][1] / base - 1):+.2f}%" if base else "-"
        logs = [m for m in _metrics(os.path.join(args.out, side)) if "tokens_per_s" in m]
        # The first windows hold compilation and warm-up; a steady run keeps both columns flat.
        speed, peak = (f"{logs[2][k]:,.{d}f} -> {logs[-1][k]:,.{d}f}" if len(logs) > 2 else "-"
                       for k, d in (("tokens_per_s", 0), ("peak_mem_gb", 2)))
        print(f"| {side} | {pts[-1][0] / 1e6:.1f}M | {pts[-1][1]:.4f} | {vs} | {speed} | {peak} |")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2))
        for side, pts in found.items():
            ax.plot([t / 1e6 for t, _ in pts], [v for _, v in pts], label=f"{side} ({pts[-1][1]:.4f})", linewidth=1.2)
        ax.set_xlabel("tokens seen (millions)")
        ax.set_ylabel("held-out loss")
        ax.set_title(args.title or os.path.basename(os.path.normpath(args.out)))
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"wrote {args.png}")
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line; what follows `--` goes to train.py as it is (`run`'s extra flags)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train one side (resuming its own save folder)")
    r.add_argument("side", choices=list(RECIPE_SIDES))
    r.add_argument("--name", default="", help="the side's folder under --out (default: the side)")
    r.add_argument("--micro", type=int, default=8, help="micro-batch per rank (the shipped JSONs': 8)")
    r.add_argument("--preset", default="1b")
    r.add_argument("--seq", type=int, default=2048)
    r.add_argument("--tokens", type=float, default=150e6, help="tokens the side trains on in all")
    r.add_argument("--data", default=default_corpus(), help="a directory or glob (default: this Python's packages)")
    r.add_argument("--vocab", type=int, default=32000)
    r.add_argument("--eval-interval", type=int, default=100)
    r.add_argument("--eval-batches", type=int, default=20)
    r.add_argument("--log-interval", type=int, default=20)
    r.add_argument("--save-interval", type=int, default=500)
    r.add_argument("--no-compile", dest="compile", action="store_false")
    r.add_argument("--nproc", type=int, default=0, help="ranks (default: every GPU)")
    r.add_argument("--limit", type=float, default=540, help="seconds this launch may run")
    r.add_argument("--out", default="runs/convergence", help="... -- FLAGS: more train.py flags")
    p = sub.add_parser("plot", help="the sides' held-out curves and a table")
    p.add_argument("out", nargs="?", default="runs/convergence")
    p.add_argument("--png", default="")
    p.add_argument("--title", default="")
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    if cut < len(argv) and args.cmd != "run":
        ap.error(f"only run takes train.py flags after --, not {args.cmd}")
    args.extra = argv[cut + 1:]
    return args


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else list(argv))
    return run(args) if args.cmd == "run" else plot(args)


if __name__ == "__main__":
    sys.exit(main())
