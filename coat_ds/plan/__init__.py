"""Memory planner: per decoder layer, keep the saved activations, compress them to FP8 (with
or without FP8 linears) or recompute them, whichever gives the most tokens/s within a memory
budget, from measured costs (docs/planner.md)."""
from .apply import AppliedPlan, ApplyConfig, apply_plan
from .layers import decoder_layers, training_loss
from .measure import ChoiceRun, MeasureConfig, Measurements, measure_choices, measure_plan
from .plan import CHOICES, Plan, load_plan
from .search import CostModel, best_assignment, search_plan

__all__ = ["CHOICES", "Plan", "load_plan", "apply_plan", "ApplyConfig", "AppliedPlan", "decoder_layers",
           "training_loss", "MeasureConfig", "ChoiceRun", "Measurements", "measure_choices", "measure_plan",
           "CostModel",
           "best_assignment", "search_plan", "make_plan"]


def make_plan(model, optimizer_factory, budget_bytes: float, *, max_batch: int, config: MeasureConfig | None = None,
              apply_config: ApplyConfig | None = None, say=lambda s: None):
    """Measure `model` (`measure_choices`), then search (`search_plan`): (plan or None, measurements)."""
    m = measure_choices(model, optimizer_factory, config=config, apply_config=apply_config, say=say)
    return search_plan(CostModel.from_measurements(m), budget_bytes, max_batch=max_batch), m
