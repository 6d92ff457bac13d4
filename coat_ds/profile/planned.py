"""`python -m coat_ds.profile --plan`: per decoder layer, each choice measured, the plan with
the most tokens/s within the budget searched and written, then the plan and the uniform
choices (every layer kept = BF16 activations, every layer recomputed = full activation
checkpointing, every layer FP8 = coat_ds compress-all) run at the plan's micro-batch,
predicted against measured."""
from __future__ import annotations

import gc
import os

import torch

from .._compat.torch import raise_recompile_limit
from ..models.llama import Llama
from ..optim import CoatAdamW
from ..plan import CostModel, MeasureConfig, Plan, measure_choices, measure_plan, search_verified
from .trainee import load_side
from .report import write_json, write_markdown

__all__ = ["profile_plan", "plan_tables"]

# The activations are BF16 under autocast (CUDA), FP32 on a CPU.
_UNIFORM = (("keep", "every layer kept (BF16 baseline)"), ("recompute", "full activation checkpointing"),
            ("fp8", "coat_ds compress-all (every layer FP8)"), ("fp8_linear", "coat_ds FP8 linears + compress-all"))


def _pct(predicted: float, measured: float) -> str:
    return f"{100 * (predicted / measured - 1):+.1f}%" if measured else "-"


def plan_tables(result: dict) -> str:
    """Markdown: the per-layer table (held bytes per choice at the plan's micro-batch, time
    above the base choice, the choice taken), then predicted vs measured per row."""
    plan, b = result["plan"], result["plan"]["micro_batch"]
    costs = result["per_layer"]
    choices = result["choices"]
    head = ("| layer | " + " | ".join(f"{c}: held MB @ b={b}" for c in choices) + " | "
            + " | ".join(f"{c}: ms vs {choices[0]}" for c in choices[1:]) + " | plan |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in costs:
        cells = [f"{row['held_bytes'][c] / 1e6:.2f}" for c in choices]
        cells += [f"{row['ms_vs_base'][c]:+.2f}" for c in choices[1:]]
        lines.append(f"| {row['layer']} | " + " | ".join(cells) + f" | {plan['layers'][row['layer']]} |")
    lines += ["", f"| run @ micro-batch {b} x {result['seq_len']} | predicted peak GB | measured peak GB | error "
              "| predicted ms/step | measured ms/step | error | tokens/s (measured) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['name']} | {r['predicted_peak_bytes'] / 1e9:.4f} | {r['peak_bytes'] / 1e9:.4f} | "
                     f"{_pct(r['predicted_peak_bytes'], r['peak_bytes'])} | {r['predicted_step_s'] * 1e3:.1f} | "
                     f"{r['step_s'] * 1e3:.1f} | {_pct(r['predicted_step_s'], r['step_s'])} | "
                     f"{r['tokens_per_s']:,.0f} |")
    grads = ("gradients held during backward by an optimizer stepping there"
             if result["measurements"].get("step_in_backward") else "gradients")
    lines += ["", f"Budget {result['budget_bytes'] / 1e9:.3f} GB per rank; fixed part (parameters, {grads}, "
              f"optimizer state) {result['fixed_bytes'] / 1e9:.4f} GB; every row trains with the same optimizer "
              f"({result['optimizer']}). Meter: {result['meter']}."]
    return "\n".join(lines)


def profile_plan(opts, mcfg, seq_len: int, device: torch.device, budget: float, say) -> dict:
    """The --plan run, one process; writes DIR/plan.json, DIR/plan_report.json and .md."""
    coat = load_side("coat", opts.config, step_in_backward=opts.step_in_backward)
    torch.manual_seed(opts.seed)
    with torch.device(device):
        model = Llama(mcfg)
    if opts.compile:
        raise_recompile_limit(64)
        for block in model.blocks:
            block.compile()

    def optimizer(params):
        return CoatAdamW(params, **coat.coat_kwargs)

    config = MeasureConfig(seq_len=seq_len, batches=opts.measure_batches, choices=opts.choices,
                           timed_steps=max(1, opts.throughput_steps), seed=opts.seed,
                           compile_budgets=opts.compile_budgets)
    say(f"[plan] measuring {', '.join(config.choices)} at micro-batches {config.batches} "
        f"(every layer on one choice per run)")
    m = measure_choices(model, optimizer, config=config, say=say)
    costs = CostModel.per_compile_budget(m)
    by_budget = {c.compile_memory_budget: c for c in costs}

    def run(name: str, p: Plan) -> dict:
        say(f"[plan] running {name} at micro-batch {p.micro_batch}")
        got = measure_plan(model, p, optimizer, config=config)
        peak, step = by_budget[p.compile_memory_budget].predict([c for _, c in p.layers], p.micro_batch)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"name": name, "layers": dict(p.layers), "predicted_peak_bytes": peak, "peak_bytes": got.peak_bytes,
                "predicted_step_s": step, "step_s": got.step_s, "tokens_per_s": p.micro_batch * seq_len / got.step_s,
                "fits_budget": got.peak_bytes <= budget}

    tried: list[dict] = []

    def measure(p: Plan) -> tuple[float, float]:
        tried.append(run(f"plan, search {len(tried) + 1}", p))
        return tried[-1]["peak_bytes"], tried[-1]["step_s"]

    # The pick is run; where it measures over the budget, the search runs again with the
    # model's error for it as a margin (coat_ds/plan/verify.py).
    plan, attempts = search_verified(costs, budget, measure, max_batch=opts.max_batch, say=say)
    if not attempts:  # the search found nothing to run
        raise SystemExit(f"--plan: nothing fits {budget / 1e9:.3f} GB: the fixed part alone is "
                         f"{m.fixed_bytes / 1e9:.3f} GB (parameters, gradients, optimizer state)")
    if plan is None:
        plan = attempts[-1]["plan"]
        say(f"[plan] WARNING: no plan measured within {budget / 1e9:.3f} GB after {len(attempts)} searches; "
            f"writing the last one ({attempts[-1]['peak_bytes'] / 1e9:.3f} GB measured)")
    for i, (row, a) in enumerate(zip(tried, attempts)):
        row["search_budget_bytes"] = a["search_budget_bytes"]
        if i == len(tried) - 1:
            row["name"] = "plan"
        elif not row["fits_budget"]:
            row["name"] = f"plan, search {i + 1} (over budget, replaced)"
    say(plan.summary())
    plan.save(os.path.join(opts.out, "plan.json"))
    b = plan.micro_batch
    runs = [(name, Plan.uniform(m.layers, c, b, seq_len)) for c, name in _UNIFORM if c in m.choices]
    rows = [run(name, p) for name, p in runs] + tried
    chosen = by_budget[plan.compile_memory_budget]  # the per-layer table: costs under the plan's budget
    per_layer = [{"layer": fqn,
                  "held_bytes": {c: chosen.at(chosen.layer_bytes[i][j], b) for j, c in enumerate(chosen.choices)},
                  "ms_vs_base": {c: 1e3 * chosen.at(chosen.layer_s[i][j], b) for j, c in enumerate(chosen.choices)}}
                 for i, fqn in enumerate(chosen.layers)]
    result = {"plan": plan.to_dict(), "seq_len": seq_len, "budget_bytes": budget, "fixed_bytes": m.fixed_bytes,
              "choices": list(chosen.choices), "per_layer": per_layer, "rows": rows, "meter": m.meter,
              "optimizer": f"CoatAdamW{'(step_in_backward=True)' if coat.step_in_backward else ''} from "
                           f"{coat.config_path}", "measurements": m.to_dict()}
    table = plan_tables(result)
    result["markdown"] = table
    print("\n" + table, flush=True)
    write_json(result, os.path.join(opts.out, "plan_report.json"))
    write_markdown(table, os.path.join(opts.out, "plan_report.md"))
    say(f"wrote {', '.join(os.path.join(opts.out, f) for f in ('plan.json', 'plan_report.json', 'plan_report.md'))}")
    return result
