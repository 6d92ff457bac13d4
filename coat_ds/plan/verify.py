"""A searched plan checked by running it: where its measured peak is over the budget, the
search runs again with the budget lowered by the error the cost model made for that plan.

The cost model is exact for uniform plans and, since each layer's input is counted where
it goes (measure.py), close for the mixed plans measured so far (docs/planner.md); but a
mixed plan's peak is still a prediction from uniform runs. A plan that does not fit is worse
than a slower one that does, so the planner measures its pick, and where it is over, plans
again with the prediction's error taken as a margin."""
from __future__ import annotations

import dataclasses
from typing import Callable

from .plan import Plan
from .search import CostModel, search_plan

__all__ = ["search_verified"]


def _same(a: Plan, b: Plan) -> bool:
    return (a.layers, a.micro_batch, a.compile_memory_budget) == (b.layers, b.micro_batch, b.compile_memory_budget)


def search_verified(model: CostModel | tuple[CostModel, ...], budget_bytes: float,
                    measure: Callable[[Plan], tuple[float, float]], *,
                    tries: int = 3, say: Callable[[str], None] = print, **search_kwargs) -> tuple[Plan | None, list]:
    """(plan, attempts): the fastest plan whose *measured* peak is within `budget_bytes`, or
    None. `measure(plan)` runs a plan and returns (peak bytes, step seconds); it is called
    at most `tries` times. Each attempt is a dict (plan, search budget, measured peak and
    step). `search_kwargs` go to `search_plan` (max_batch or micro_batches, choices)."""
    if not isinstance(tries, int) or isinstance(tries, bool) or tries < 1:
        raise ValueError(f"search_verified: tries: got {tries!r}; allowed: an integer >= 1")
    room, attempts, worst_error = budget_bytes, [], 0.0
    for _ in range(tries):
        plan = search_plan(model, room, **search_kwargs)
        if plan is None or any(_same(a["plan"], plan) for a in attempts):
            break
        peak, step = measure(plan)
        attempts.append({"plan": plan, "search_budget_bytes": room, "peak_bytes": peak, "step_s": step})
        if peak <= budget_bytes:
            return dataclasses.replace(plan, budget_bytes=budget_bytes), attempts
        worst_error = max(worst_error, peak - plan.predicted_peak_bytes)
        room = min(room - 1.0, budget_bytes - worst_error)
        say(f"[plan] measured peak {peak / 1e9:.3f} GB is over the budget {budget_bytes / 1e9:.3f} GB "
            f"(predicted {plan.predicted_peak_bytes / 1e9:.3f}); searching again within {room / 1e9:.3f} GB")
    return None, attempts
