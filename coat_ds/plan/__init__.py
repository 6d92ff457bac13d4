"""Memory planner: per decoder layer, keep the saved activations, compress them to FP8 (with
or without FP8 linears) or recompute them, whichever gives the most tokens/s within a memory
budget, from measured costs (docs/planner.md)."""
from .apply import AppliedPlan, ApplyConfig, apply_plan
from .layers import decoder_layers, training_loss
from .measure import measure_choices, measure_plan
from .measurements import ChoiceRun, MeasureConfig, Measurements
from .plan import CHOICES, Plan, load_plan
from .recompute import compile_layer
from .search import CostModel, best_assignment, search_plan
from .verify import search_verified

__all__ = ["CHOICES", "Plan", "load_plan", "apply_plan", "ApplyConfig", "AppliedPlan", "compile_layer", "decoder_layers",
           "training_loss", "MeasureConfig", "ChoiceRun", "Measurements", "measure_choices", "measure_plan",
           "CostModel", "best_assignment", "search_plan", "search_verified"]

