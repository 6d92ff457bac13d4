"""Does torch.compile's own activation-memory budget help beside the planner's choices?
(issue 18: "under torch.compile, torch's own activation-memory budget option where it helps").

Every decoder layer of HF LlamaForCausalLM (as bench/plan_bench.py builds it: vocab 32000,
FP32 master + BF16 autocast, micro-batch 8 x 2048, CoatAdamW) on one uniform choice, compiled
with `torch._functorch.config.activation_memory_budget` = each budget (1.0 is torch's
default partition), each run in a process of its own; prints ms/step, tokens/s and peak GB,
with tokens/s and peak as ratios to the same choice at budget 1.0 of the same call.

    python bench/torch_budget.py --shape 1b 7b --choices keep fp8_linear --budgets 1.0 0.5 0.2
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch


def child(shape: str, choice: str, budget: float, bs: int, seq: int, steps: int) -> dict:
    import torch._functorch.config as functorch_config

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import plan_bench
    from coat_ds.plan import MeasureConfig, Plan, decoder_layers, measure_plan

    # Read by the min-cut partitioner when each layer's graph is compiled (its first call).
    functorch_config.activation_memory_budget = budget
    model = plan_bench._build(shape, seq)
    plan_bench._compile(model, True)
    plan = Plan.uniform([f for f, _ in decoder_layers(model)], choice, bs, seq)
    got = measure_plan(model, plan, plan_bench._optimizer("coat"),
                       config=MeasureConfig(seq_len=seq, batches=(bs,), timed_steps=steps, warmup_steps=2))
    return {"shape": shape, "choice": choice, "budget": budget, "bs": bs, "seq": seq, "ms": got.step_s * 1e3,
            "peak_gb": got.peak_bytes / 1e9}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="+", default=["1b", "7b"])
    ap.add_argument("--choices", nargs="+", default=["keep", "fp8_linear"])
    ap.add_argument("--budgets", nargs="+", type=float, default=[1.0, 0.5, 0.2])
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--child", nargs=3, metavar=("SHAPE", "CHOICE", "BUDGET"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        shape, choice, budget = args.child
        print("RESULT " + json.dumps(child(shape, choice, float(budget), args.bs, args.seq, args.steps)), flush=True)
        return
    if 1.0 not in args.budgets:
        ap.error("--budgets: include 1.0 (torch's default partition), the baseline of the ratios")
    print(f"# {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    rows = []
    for shape in args.shape:
        for choice in args.choices:
            for budget in args.budgets:
                cmd = [sys.executable, __file__, "--child", shape, choice, str(budget), "--bs", str(args.bs),
                       "--seq", str(args.seq), "--steps", str(args.steps)]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                row = json.loads(found[-1][7:]) if found else {
                    "shape": shape, "choice": choice, "budget": budget,
                    "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("| shape | choice | budget | ms/step | tokens/s | vs budget 1.0 | peak GB | vs budget 1.0 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "ms" not in r:
            print(f"| {r['shape']} | {r['choice']} | {r['budget']} | failed: {r['error'][:80]} | | | | |")
            continue
        base = next((b for b in rows if b["shape"] == r["shape"] and b["choice"] == r["choice"]
                     and b["budget"] == 1.0 and "ms" in b), None)
        tps = r["bs"] * r["seq"] / r["ms"] * 1e3
        vs_t = f"{base['ms'] / r['ms']:.3f}x" if base else "-"
        vs_m = f"{r['peak_gb'] / base['peak_gb']:.3f}x" if base else "-"
        print(f"| {r['shape']} | {r['choice']} | {r['budget']} | {r['ms']:.1f} | {tps:,.0f} | {vs_t} | "
              f"{r['peak_gb']:.2f} | {vs_m} |")


if __name__ == "__main__":
    main()
