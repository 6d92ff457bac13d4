"""train.py's planning step: the plan of `--plan FILE`, or one searched at start for
`--memory-budget-gb B` at the run's micro-batch, the same on every rank."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..plan import (ApplyConfig, CostModel, MeasureConfig, Plan, decoder_layers, load_plan, measure_choices,
                    measure_plan, search_verified)
from .engine_setup import build_optimizer

__all__ = ["plan_for_run", "run_apply_config"]


def _optimizer_factory(ds_settings, in_backward: bool):
    # The run's optimizer as train.py builds it: with step_in_backward its gradients are
    # freed in backward, which the measured peaks then show.
    overrides = dict(step_in_backward=True, max_grad_norm=ds_settings.clip or None) if in_backward else {}

    def build(params):
        try:
            return build_optimizer(ds_settings, params, **overrides)
        except KeyError:  # a DeepSpeed-only optimizer (FusedAdam, ...): AdamW's FP32 moments are its size
            return torch.optim.AdamW(params, lr=0.0)

    return build


def _searched(model: nn.Module, budget_gb: float, ds_settings, seq_len: int, say, in_backward: bool,
              apply_config: ApplyConfig) -> Plan:
    mb = ds_settings.micro_batch
    config = MeasureConfig(seq_len=seq_len, batches=(max(1, mb // 2), mb) if mb > 1 else (1, 2), timed_steps=2,
                           grad_accumulation=ds_settings.grad_accum)
    say(f"planning for {budget_gb} GB per rank at micro-batch {mb}: measuring {', '.join(config.choices)} "
        f"at micro-batches {config.batches}")
    factory = _optimizer_factory(ds_settings, in_backward)
    # Measured as it will run: recomputed layers from FP8 inputs keep less.
    m = measure_choices(model, factory, config=config, apply_config=apply_config, say=say)

    def measure(p: Plan) -> tuple[float, float]:
        say(f"planning: running the pick ({p.summary()}) to check its peak")
        run = measure_plan(model, p, factory, config=config, apply_config=apply_config)
        return run.peak_bytes, run.step_s

    plan, attempts = search_verified(CostModel.per_compile_budget(m), budget_gb * 1e9, measure,
                                     micro_batches=(mb,), say=say)
    if plan is None and attempts:
        raise SystemExit(f"--memory-budget-gb {budget_gb}: no plan measured within it at micro-batch {mb} x "
                         f"{seq_len} after {len(attempts)} searches (the last peaked at "
                         f"{attempts[-1]['peak_bytes'] / 1e9:.3f} GB); raise the budget or lower the micro-batch")
    if plan is None:
        raise SystemExit(f"--memory-budget-gb {budget_gb}: no plan fits micro-batch {mb} x {seq_len} "
                         f"(fixed part alone {m.fixed_bytes / 1e9:.3f} GB, measured on one rank, unsharded); "
                         "raise the budget or lower the micro-batch")
    return plan


def run_apply_config(cfg) -> ApplyConfig:
    """How train.py applies its plan (`cfg`: a TrainConfig)."""
    return ApplyConfig(recompute_input_fp8=cfg.recompute_input_fp8)


def plan_for_run(cfg, model: nn.Module, ds_settings, say=print) -> Plan:
    """The run's plan: loaded (`cfg.plan`) or searched on rank 0 (`cfg.memory_budget_gb`)
    and sent to every rank, checked against the model's decoder layers."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    box: list = [None]
    if cfg.plan:
        try:
            box[0] = load_plan(cfg.plan)
        except ValueError as e:
            raise SystemExit(f"--plan: {e}") from None
    elif rank == 0:
        box[0] = _searched(model, cfg.memory_budget_gb, ds_settings, cfg.seq_len, say, cfg.step_in_backward,
                           run_apply_config(cfg))
    if not cfg.plan and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    plan = box[0]
    layers = [f for f, _ in decoder_layers(model)]
    if [f for f, _ in plan.layers] != layers:
        raise SystemExit(f"--plan {cfg.plan}: its layers {[f for f, _ in plan.layers][:3]}... are not this "
                         f"model's decoder layers {layers[:3]}... ({len(layers)})")
    if plan.micro_batch != ds_settings.micro_batch or plan.seq_len != cfg.seq_len:
        say(f"WARNING: the plan was made for micro-batch {plan.micro_batch} x {plan.seq_len}; this run is "
            f"{ds_settings.micro_batch} x {cfg.seq_len}: its predictions do not apply")
    return plan
