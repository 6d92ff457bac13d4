"""The memory planner end to end: HF LlamaForCausalLM from a config (nothing downloaded), FP32
master weights + BF16 autocast, every decoder layer compiled, micro-batch 8 x 2048. Sides,
each in a fresh process (honest peaks): BF16 (torch AdamW), BF16 + full checkpointing,
coat_ds compress-all (CoatAdamW + every layer FP8), the planner's measurement run, and the
plan found at 90/60/40% of BF16's measured peak (CoatAdamW + apply_plan). Prints tokens/s,
predicted vs measured peak and step time, and a table last.

    python bench/plan_bench.py                      # both shapes (7b layer shapes, ~1b)
    python bench/plan_bench.py --shape 7b --budgets 0.6
    python bench/plan_bench.py --tiny --in-process  # CPU, tiny sizes (what CI runs)
    python bench/plan_bench.py --shape 1b --compile-budgets 0.5 0.2  # torch.compile budgets as well
    python bench/plan_bench.py --shape 1b 7b --choices keep fp8_linear --torch-budgets 1.0 0.5 0.2

--torch-budgets: no planner; every layer on one choice, compiled with torch's own
`activation_memory_budget` at each value (1.0: torch's default partition, the baseline of
the ratios), each in a process of its own.

The planner measures at the benchmark's micro-batch and at half of it (each cost a line in
the micro-batch) and plans over micro-batches 1, 2, 4, ... up to the benchmark's; a plan
identical to one already run is not run again. The budget 'ckpt' is full checkpointing's
measured peak (the plan's tokens/s at that memory against checkpointing's). Predictions are shown
for the rows trained with CoatAdamW (compress-all and the plans), the optimizer the
measurement run used; the BF16 rows train with torch AdamW's FP32 moments."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import tempfile
import time

import _common as C
import torch

SIDES = ("bf16", "bf16_ckpt", "coat", "measure", "plan")


def _build(shape: str, seq: int):
    return C.hf_llama(shape, seq)


def _compile(model, compile_layers: bool) -> None:
    if compile_layers:
        C.compile_layers(model)


def _optimizer(side: str):
    import coat_ds

    if side in ("bf16", "bf16_ckpt"):
        fused = torch.cuda.is_available()
        return lambda params: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=fused)
    return lambda params: coat_ds.CoatAdamW(params, lr=1e-4, weight_decay=0.0)


def run_side(shape: str, side: str, bs: int, seq: int, steps: int, compile_layers: bool,
             plan_file: str | None = None, choices: tuple[str, ...] = ("keep", "fp8", "recompute"),
             compile_budgets: tuple[float, ...] = ()) -> dict:
    """One side in this process: its result as a dict (the parent reads it as JSON)."""
    from coat_ds.plan import MeasureConfig, Plan, decoder_layers, load_plan, measure_choices, measure_plan

    model = _build(shape, seq)
    fqns = [f for f, _ in decoder_layers(model)]
    # Compiled: the first step compiles, the second settles the allocator.
    config = MeasureConfig(seq_len=seq, batches=(bs,), choices=choices, timed_steps=steps,
                           warmup_steps=2 if compile_layers else 1)
    _compile(model, compile_layers)  # the plan's hooks and checkpointing are guarded on: they recompile
    t0 = time.perf_counter()
    if side == "measure":
        # Two micro-batches make each cost a line (fixed + per sample), so that the search
        # can also weigh smaller micro-batches; one would make every cost proportional.
        config = dataclasses.replace(config, batches=_measured_batches(bs), compile_budgets=compile_budgets)
        m = measure_choices(model, _optimizer(side), config=config, say=lambda s: print(s, flush=True))
        return {"shape": shape, "side": side, "bs": bs, "seq": seq, "measurements": m.to_dict(),
                "wall_s": time.perf_counter() - t0}
    if side == "plan":
        plan = load_plan(plan_file)
        bs = plan.micro_batch
        config = dataclasses.replace(config, batches=(bs,))
    else:
        plan = Plan.uniform(fqns, {"bf16": "keep", "bf16_ckpt": "recompute", "coat": "fp8"}[side], bs, seq)
    got = measure_plan(model, plan, _optimizer(side), config=config)
    return {"shape": shape, "side": side, "bs": bs, "seq": seq, "ms": got.step_s * 1e3, "peak_gb": got.peak_bytes / 1e9,
            "plan": plan.to_dict(), "wall_s": time.perf_counter() - t0}


def _measured_batches(bs: int) -> tuple[int, int]:
    return (max(1, bs // 2), bs) if bs > 1 else (bs, bs)


def _run(args, shape: str, side: str, plan_file: str | None = None) -> dict:
    """`side` in a process of its own (or here with --in-process); failures become a row."""
    if args.in_process:
        return run_side(shape, side, args.bs, args.seq, args.steps, not args.no_compile, plan_file, tuple(args.choices),
                        tuple(args.compile_budgets))
    argv = ["--shape", shape, "--bs", str(args.bs), "--seq", str(args.seq), "--steps", str(args.steps), "--choices",
            *args.choices] + (["--no-compile"] if args.no_compile else [])
    if args.compile_budgets:
        argv += ["--compile-budgets", *map(str, args.compile_budgets)]
    if plan_file:
        argv += ["--plan-file", plan_file]
    name = side if not plan_file else os.path.basename(plan_file)[:-5]
    res = C.run_child(argv, side, log=args.log_dir and os.path.join(args.log_dir, f"{shape}_{name}.log"))
    return res if "error" not in res else {"shape": shape, "side": side, "bs": args.bs, "seq": args.seq, **res}


def torch_budget_side(shape: str, spec: str, bs: int, seq: int, steps: int) -> dict:
    """One choice on every layer, compiled with torch's activation-memory budget."""
    import torch._functorch.config as functorch_config

    from coat_ds.plan import MeasureConfig, Plan, decoder_layers, measure_plan

    choice, budget = spec.split("@")
    # Read by the min-cut partitioner when each layer's graph is compiled (its first call).
    functorch_config.activation_memory_budget = float(budget)
    model = _build(shape, seq)
    _compile(model, True)
    plan = Plan.uniform([f for f, _ in decoder_layers(model)], choice, bs, seq)
    got = measure_plan(model, plan, _optimizer("coat"),
                       config=MeasureConfig(seq_len=seq, batches=(bs,), timed_steps=steps, warmup_steps=2))
    return {"shape": shape, "choice": choice, "budget": float(budget), "bs": bs, "seq": seq, "ms": got.step_s * 1e3,
            "peak_gb": got.peak_bytes / 1e9}


def torch_budgets(args) -> list[str]:
    rows = []
    for shape in args.shape:
        for choice in args.choices:
            for budget in args.torch_budgets:
                argv = ["--shape", shape, "--bs", str(args.bs), "--seq", str(args.seq), "--steps", str(args.steps)]
                rows.append({"shape": shape, "choice": choice, "budget": budget,
                             **C.run_child(argv, f"{choice}@{budget}")})
                print(json.dumps(rows[-1]), flush=True)
    lines = ["| shape | choice | budget | ms/step | tokens/s | vs budget 1.0 | peak GB | vs budget 1.0 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ms" not in r:
            lines.append(f"| {r['shape']} | {r['choice']} | {r['budget']} | failed: {r['error'][:80]} | | | | |")
            continue
        base = next((b for b in rows if b["shape"] == r["shape"] and b["choice"] == r["choice"]
                     and b["budget"] == 1.0 and "ms" in b), None)
        vs_t, vs_m = (f"{base['ms'] / r['ms']:.3f}x", f"{r['peak_gb'] / base['peak_gb']:.3f}x") if base else ("-", "-")
        lines.append(f"| {r['shape']} | {r['choice']} | {r['budget']} | {r['ms']:.1f} | "
                     f"{r['bs'] * r['seq'] / r['ms'] * 1e3:,.0f} | {vs_t} | {r['peak_gb']:.2f} | {vs_m} |")
    return lines


def bench_shape(args, shape: str, workdir: str) -> list[dict]:
    from coat_ds.plan import CostModel, Measurements, search_verified

    rows = []
    for side in ("bf16", "bf16_ckpt", "coat"):
        rows.append(_run(args, shape, side))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    measured = _run(args, shape, "measure")
    if "error" in measured or "error" in base:
        rows.append({**measured, "error": measured.get("error", "no BF16 peak to take budgets from")})
        return rows
    costs = CostModel.per_compile_budget(Measurements.from_dict(measured["measurements"]), _measured_batches(args.bs))
    for r in rows:
        if r["side"] == "coat" and "ms" in r and "fp8" in costs[0].choices:  # same optimizer: comparable
            peak, step = costs[0].predict(list(r["plan"]["layers"].values()), args.bs)
            r["predicted_peak_gb"], r["predicted_ms"] = peak / 1e9, step * 1e3
    done: dict[tuple, dict] = {}
    ckpt = next((r for r in rows if r["side"] == "bf16_ckpt" and "peak_gb" in r), None)
    micro_batches = tuple(2 ** k for k in range(args.bs.bit_length()) if 2 ** k <= args.bs)
    for spec in args.budgets:
        if spec == "ckpt":  # full checkpointing's own memory
            if ckpt is None:
                continue
            frac, label = ckpt["peak_gb"] / base["peak_gb"], "plan@ckpt"
        else:
            frac = float(spec)
            label = f"plan@{frac:.0%}"
        budget = frac * base["peak_gb"] * 1e9

        def measure(p):
            key = (p.layers, p.micro_batch, p.compile_memory_budget)
            if key not in done:
                path = os.path.join(workdir, f"{shape}_plan{int(frac * 100)}_{len(done)}.json")
                p.save(path)
                done[key] = _run(args, shape, "plan", path)
            r = done[key]
            return (r["peak_gb"] * 1e9, r["ms"] / 1e3) if "ms" in r else (float("inf"), float("inf"))

        # Each pick is run; one measured over the budget is searched again with the error
        # as a margin (coat_ds/plan/verify.py): the table shows the plan that was kept.
        plan, attempts = search_verified(costs, budget, measure, micro_batches=micro_batches)
        if not attempts:  # the search found nothing to run
            rows.append({"shape": shape, "side": label, "bs": args.bs, "seq": args.seq,
                         "budget_gb": budget / 1e9, "error": "no plan fits the budget"})
            continue
        if plan is None:
            plan = attempts[-1]["plan"]
        key = (plan.layers, plan.micro_batch, plan.compile_memory_budget)
        row = {**done[key], "side": label, "budget_gb": budget / 1e9,
               "predicted_peak_gb": plan.predicted_peak_bytes / 1e9, "predicted_ms": plan.predicted_step_s * 1e3,
               "counts": plan.counts(), "compile_memory_budget": plan.compile_memory_budget,
               "searches": len(attempts),
               "replaced": [{"counts": a["plan"].counts(), "micro_batch": a["plan"].micro_batch,
                             "peak_gb": a["peak_bytes"] / 1e9} for a in attempts[:-1]]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _verdicts(rows: list[dict]) -> list[str]:
    """Per plan row: the best of {BF16, full checkpointing, compress-all} within its budget."""
    out = []
    for r in rows:
        if not r["side"].startswith("plan@") or "ms" not in r:
            continue
        sides = [s for s in rows if s["shape"] == r["shape"] and s["side"] in ("bf16", "bf16_ckpt", "coat")
                 and "ms" in s and s["peak_gb"] <= r["budget_gb"]]
        best = max(sides, key=_tokens_per_s, default=None)
        fits = "fits" if r["peak_gb"] <= r["budget_gb"] else "OVER budget"
        vs = f"{_tokens_per_s(r) / _tokens_per_s(best):.2f}x {best['side']}'s (the fastest other side within it)" \
            if best else "no other side fits at micro-batch %d" % rows[0]["bs"]
        if r["side"] == "plan@ckpt":
            ck = next((s for s in rows if s["shape"] == r["shape"] and s["side"] == "bf16_ckpt" and "ms" in s), None)
            if ck:
                vs += f"; {_tokens_per_s(r) / _tokens_per_s(ck):.2f}x full checkpointing's tokens/s"
        out.append(f"{r['shape']} {r['side']} ({r['budget_gb']:.4g} GB): measured {fits}; tokens/s {vs}")
    return out


def _tokens_per_s(r: dict) -> float:
    return r["bs"] * r["seq"] / r["ms"] * 1e3


def _table(rows: list[dict]) -> list[str]:
    lines = ["| shape | side | micro-batch | ms/step | tokens/s | peak GB | predicted peak GB (err) "
             "| predicted ms (err) | budget GB | layers |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ms" not in r:
            lines.append(f"| {r['shape']} | {r['side']} | {r['bs']} | failed: {r.get('error', '')[:80]} | | | | | | |")
            continue
        tps = r["bs"] * r["seq"] / r["ms"] * 1e3
        pp = r.get("predicted_peak_gb")
        pm = r.get("predicted_ms")
        pp_s = f"{pp:.4g} ({100 * (pp / r['peak_gb'] - 1):+.1f}%)" if pp else "-"
        pm_s = f"{pm:.1f} ({100 * (pm / r['ms'] - 1):+.1f}%)" if pm else "-"
        counts = r.get("counts") or {}
        mix = ", ".join(f"{n} {c}" for c, n in counts.items() if n) or "-"
        if r.get("compile_memory_budget") is not None:
            mix += f"; compile budget {r['compile_memory_budget']:g}"
        budget = f"{r['budget_gb']:.4g}" if "budget_gb" in r else "-"
        lines.append(f"| {r['shape']} | {r['side']} | {r['bs']} | {r['ms']:.1f} | {tps:,.0f} | {r['peak_gb']:.4g} | "
                     f"{pp_s} | {pm_s} | {budget} | {mix} |")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(C.SHAPES), nargs="+", default=["7b", "1b"])
    ap.add_argument("--tiny", action="store_true", help="CPU-sized: tiny shape, micro-batch 4 x 64, eager")
    ap.add_argument("--side", choices=SIDES, help="run this one side here and print its JSON")
    ap.add_argument("--plan-file", help="with --side plan: the plan to run")
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per side, median (default 5; --tiny 2)")
    ap.add_argument("--budgets", nargs="+", default=["0.9", "0.6", "0.4", "ckpt"],
                    help="fractions of BF16's peak, or 'ckpt': full checkpointing's measured peak")
    ap.add_argument("--choices", nargs="+", default=None,
                    help="default: keep fp8 fp8_linear recompute (--tiny: without fp8_linear)")
    ap.add_argument("--compile-budgets", type=float, nargs="+", default=[],
                    help="torch.compile activation-memory budgets the planner measures beside torch's own")
    ap.add_argument("--no-compile", action="store_true", help="eager layers")
    ap.add_argument("--in-process", action="store_true", help="every side in this process (CPU tests)")
    ap.add_argument("--torch-budgets", type=float, nargs="+", default=None,
                    help="no planner: each --choices on every layer at each torch activation-memory budget")
    ap.add_argument("--log-dir", default=None, help="write each side's full output here")
    C.add_common(ap, ab=False)
    args = ap.parse_args(argv)
    if args.child and "@" in args.child:
        return C.emit(torch_budget_side(args.shape[0], args.child, args.bs, args.seq, args.steps or 5))
    if args.tiny:
        args.shape, args.bs, args.seq, args.no_compile = ["tiny"], 4, 64, True
    elif not torch.cuda.is_available() and not (args.side or args.child):
        raise SystemExit("needs a CUDA GPU (or --tiny)")
    args.steps = args.steps or (2 if args.tiny else 5)
    if args.choices is None:
        args.choices = (["keep", "fp8_linear"] if args.torch_budgets else
                        ["keep", "fp8", "recompute"] + ([] if args.tiny else ["fp8_linear"]))
    if args.torch_budgets and 1.0 not in args.torch_budgets:
        ap.error("--torch-budgets: include 1.0 (torch's default partition), the baseline of the ratios")
    for spec in args.budgets:
        if spec != "ckpt":
            try:
                float(spec)
            except ValueError:
                ap.error(f"--budgets: {spec!r} is neither a fraction of BF16's peak nor 'ckpt'")
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # tiny ops: threads only contend
    if args.side or args.child:
        return C.emit(run_side(args.shape[0], args.side or args.child, args.bs, args.seq, args.steps,
                               not args.no_compile, args.plan_file, tuple(args.choices), tuple(args.compile_budgets)))
    print(C.header(), flush=True)
    if args.torch_budgets:
        lines = torch_budgets(args)
        return C.finish(args, "torch_budgets", lines, lines)
    t0, rows = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as workdir:
        for shape in args.shape:
            rows += bench_shape(args, shape, workdir)
    print("\n".join(_verdicts(rows)))
    print(f"wall {time.perf_counter() - t0:.0f} s")
    C.finish(args, "plan_bench", rows, _table(rows))


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
