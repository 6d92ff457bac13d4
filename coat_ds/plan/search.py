"""From measurements to a plan: a cost model linear in the micro-batch, and the search for
the assignment with the most tokens/s whose predicted peak fits a budget.

Prediction, for choices a (one per layer) at micro-batch b, with held_i(c, b) the bytes
layer i's forward leaves allocated under c and prefix_j the sum of held over layers 0..j:
    step(a, b) = step_base(b) + sum_i seconds_i(a_i, b)
    peak(a, b) = fixed + max(S + head(a, b), max over recomputed layers j of
                             prefix_j - grads_0..j + remat(b))
S is prefix over every layer: the start of backward, everything held, with the head's
transient (logits, loss; the largest of head_c over the non-recomputed choices used). The
second term is backward reaching a recomputed layer j: the layers before it still held, its
own activations rematerialised, the gradients of layers 0..j not allocated yet. head_c is
the rest of the all-c run's measured peak, remat the rest of the all-recompute run's (at its
largest j); step_base is the all-base run's step time and seconds_i(c, b) the all-c run's
step time above it shared equally by the layers. Each is a line in b through the two
measured micro-batches (one measured: proportional to b); the peak is never below `fixed`.

Measured with an optimizer that steps in backward (Measurements.step_in_backward), `fixed`
holds, for gradients, only the most that optimizer holds during backward (one bucket plus
the largest parameter's gradient), and grads_0..j is 0: no gradient waits to be allocated.

The search is exact for this model: per micro-batch and per set of choices allowed, a dynamic
programme over layers keeps every (prefix bytes, seconds) point not beaten on both (a Pareto
front); a recomputed layer's condition is a cap on the prefix where it is chosen, so the
front stays exact. Past `MAX_FRONT` points the front is thinned to the fastest point per
byte bucket (real bytes kept, so what it returns still fits).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from .measurements import Measurements
from .plan import Plan

__all__ = ["CostModel", "search_plan", "best_assignment", "MAX_FRONT"]

MAX_FRONT = 20000  # Pareto points kept per layer before the front is thinned
_REC = "recompute"


def _line(b1: int, y1: float, b2: int, y2: float) -> tuple[float, float]:
    if b1 == b2:  # one measured micro-batch: proportional, exact there
        return 0.0, y1 / b1
    slope = (y2 - y1) / (b2 - b1)
    return y1 - slope * b1, slope


@dataclass(frozen=True)
class CostModel:
    """Costs linear in the micro-batch: each entry an (intercept, slope) pair."""

    layers: tuple[str, ...]  # decoder layer fqns, model order
    choices: tuple[str, ...]  # choices that were measured; the first is the time base
    seq_len: int  # tokens per sequence
    fixed_bytes: float  # parameters + gradients + optimizer state
    layer_grad_bytes: tuple[float, ...]  # per layer: its gradients' bytes
    layer_bytes: tuple[tuple[tuple[float, float], ...], ...]  # [layer][choice] bytes held to backward
    layer_s: tuple[tuple[tuple[float, float], ...], ...]  # [layer][choice] seconds above the base choice
    transient: tuple[tuple[float, float], ...]  # [choice] head transient; for "recompute": remat
    base_s: tuple[float, float]  # step time with every layer on the base choice
    compile_memory_budget: float | None = None  # torch.compile activation-memory budget measured under; None: torch's

    @classmethod
    def per_compile_budget(cls, m: Measurements, batches: tuple[int, int] | None = None) -> tuple["CostModel", ...]:
        """One cost model per torch.compile budget measured (torch's own first); `search_plan`
        takes them together and returns the best plan under any of them."""
        return tuple(cls.from_measurements(m, batches, compile_budget=b) for b in m.compile_budgets)

    @classmethod
    def from_measurements(cls, m: Measurements, batches: tuple[int, int] | None = None, *,
                          compile_budget: float | None = None) -> "CostModel":
        """The costs measured under `compile_budget` (None: torch's own partition)."""
        choices = m.choices
        if batches is None:
            batches = tuple(sorted({r.batch for r in m.runs}))[:2]
        b1, b2 = batches[0], batches[-1]
        n = len(m.layers)
        base = choices[0]
        # Stepped in backward, a layer's gradients are freed as soon as they are complete:
        # none wait in the fixed part to be taken off before backward reaches their layer
        # (what it holds during backward, at most, is in the fixed part: in_backward_grad_bytes).
        grads = tuple(0.0 if m.step_in_backward else float(g) for g in m.layer_grad_bytes)

        def fit(f):
            return _line(b1, f(b1), b2, f(b2))

        def run_of(c: str, b: int):
            return m.run(c, b, compile_budget)

        def rest(c: str, b: int) -> float:
            run = run_of(c, b)
            if c != _REC:
                return run.peak_bytes - m.fixed_bytes - sum(run.layer_bytes)
            prefix = list(itertools.accumulate(run.layer_bytes))
            g = list(itertools.accumulate(grads))
            return run.peak_bytes - m.fixed_bytes - max(p - x for p, x in zip(prefix, g))

        layer_bytes = tuple(tuple(fit(lambda b, c=c: run_of(c, b).layer_bytes[i]) for c in choices) for i in range(n))
        layer_s = tuple(tuple(fit(lambda b, c=c: (run_of(c, b).step_s - run_of(base, b).step_s) / n) for c in choices)
                        for _ in range(n))
        transient = tuple(fit(lambda b, c=c: rest(c, b)) for c in choices)
        return cls(m.layers, choices, m.seq_len, float(m.fixed_bytes), grads, layer_bytes, layer_s, transient,
                   fit(lambda b: run_of(base, b).step_s), compile_budget)

    @staticmethod
    def at(line: tuple[float, float], b: int) -> float:
        return line[0] + line[1] * b

    def predict(self, assignment, b: int) -> tuple[float, float]:
        """(peak bytes, step seconds) of choices `assignment` (names, one per layer) at micro-batch b."""
        idx = [self.choices.index(c) for c in assignment]
        held = [self.at(self.layer_bytes[i][j], b) for i, j in enumerate(idx)]
        terms = []
        heads = [self.at(self.transient[j], b) for j in set(idx) if self.choices[j] != _REC]
        if heads:
            terms.append(sum(held) + max(heads))
        if _REC in assignment:
            remat = self.at(self.transient[self.choices.index(_REC)], b)
            prefix, grads = itertools.accumulate(held), itertools.accumulate(self.layer_grad_bytes)
            terms += [p - g + remat for p, g, c in zip(prefix, grads, assignment) if c == _REC]
        peak = max(self.fixed_bytes, self.fixed_bytes + max(terms))
        step = self.at(self.base_s, b) + sum(self.at(self.layer_s[i][j], b) for i, j in enumerate(idx))
        return peak, step


def best_assignment(options: list[list[tuple[float, float]]], budget: float,
                    caps: list[list[float]] | None = None) -> tuple[list[int], float, float] | None:
    """Indices (one per layer) minimising total seconds with total bytes <= budget and, where
    option j is taken at layer i, the bytes of layers 0..i <= caps[i][j]; with their (bytes,
    seconds); None where nothing fits. `options[i][j]` = (bytes, seconds)."""
    # The least bytes the layers after i can add (negative where a layer frees more than it
    # holds): a partial sum is dropped only when no completion can fit.
    rest = [0.0] * (len(options) + 1)
    for i in range(len(options) - 1, -1, -1):
        rest[i] = rest[i + 1] + min(ob for ob, _ in options[i])
    front = [(0.0, 0.0, -1, -1)]  # (bytes, seconds, parent index in the previous front, option)
    history = []
    for i, opts in enumerate(options):
        cap = caps[i] if caps is not None else [float("inf")] * len(opts)
        cand = [(fb + ob, fs + os_, k, j) for k, (fb, fs, _, _) in enumerate(front) for j, (ob, os_) in enumerate(opts)
                if fb + ob + rest[i + 1] <= budget and fb + ob <= cap[j]]
        if not cand:
            return None
        cand.sort(key=lambda t: (t[0], t[1]))
        kept, best_s = [], float("inf")
        for t in cand:
            if t[1] < best_s:
                kept.append(t)
                best_s = t[1]
        if len(kept) > MAX_FRONT:
            kept = _thin(kept)
        history.append(kept)
        front = kept
    k = min(range(len(front)), key=lambda i: (front[i][1], front[i][0]))
    total_b, total_s = front[k][0], front[k][1]
    picks = []
    for level in reversed(history):
        _, _, parent, j = level[k]
        picks.append(j)
        k = parent
    return picks[::-1], total_b, total_s


def _thin(front: list[tuple]) -> list[tuple]:
    """At most MAX_FRONT points: the fastest point of each byte bucket (bytes are real, so
    what fits stays fitting; only near-ties in bytes are lost)."""
    lo, hi = front[0][0], front[-1][0]
    width = (hi - lo) / MAX_FRONT or 1.0
    out = {}
    for t in front:
        key = int((t[0] - lo) / width)
        if key not in out or t[1] < out[key][1]:
            out[key] = t
    return sorted(out.values(), key=lambda t: t[0])


def _best_for(model: CostModel, subset: tuple[str, ...], b: int, room: float):
    """Fastest assignment over `subset` at micro-batch b within `room` bytes above fixed."""
    cols = [model.choices.index(c) for c in subset]
    heads = [model.at(model.transient[j], b) for j in cols if model.choices[j] != _REC]
    total = room - max(heads) if heads else float("inf")
    caps = None
    if _REC in subset:
        remat = model.at(model.transient[model.choices.index(_REC)], b)
        grads = list(itertools.accumulate(model.layer_grad_bytes))
        caps = [[room - remat + grads[i] if c == _REC else float("inf") for c in subset]
                for i in range(len(model.layers))]
    opts = [[(model.at(model.layer_bytes[i][j], b), model.at(model.layer_s[i][j], b)) for j in cols]
            for i in range(len(model.layers))]
    found = best_assignment(opts, total, caps)
    return None if found is None else [subset[j] for j in found[0]]


def search_plan(model: CostModel | tuple[CostModel, ...], budget_bytes: float, *, max_batch: int | None = None,
                micro_batches: tuple[int, ...] | None = None, choices: tuple[str, ...] | None = None) -> Plan | None:
    """The plan with the most tokens/s whose predicted peak is <= budget_bytes, over
    micro-batches 1, 2, 4, ... <= max_batch (or exactly `micro_batches`) and the allowed
    choices (default: all measured); None where no micro-batch fits. Given several cost
    models (`CostModel.per_compile_budget`), the best plan under any of them, carrying the
    torch.compile budget it was measured under."""
    if isinstance(model, CostModel):
        model = (model,)
    if (max_batch is None) == (micro_batches is None):
        raise ValueError("search_plan: give max_batch or micro_batches (one of them)")
    if micro_batches is None:
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"search_plan: max_batch: got {max_batch!r}; allowed: an integer >= 1")
        micro_batches = tuple(2 ** k for k in range(max_batch.bit_length()))
    elif not micro_batches or any(not isinstance(b, int) or b < 1 for b in micro_batches):
        raise ValueError(f"search_plan: micro_batches: got {micro_batches!r}; allowed: integers >= 1")
    found = [p for p in (_search_one(m, budget_bytes, micro_batches, choices) for m in model) if p is not None]
    # Ties go to the first model: torch's own partition, which per_compile_budget lists first.
    return max(found, key=lambda p: p.micro_batch / p.predicted_step_s, default=None)


def _search_one(model: CostModel, budget_bytes: float, micro_batches: tuple[int, ...], choices) -> Plan | None:
    allowed = [c for c in (choices or model.choices) if c in model.choices]
    if not allowed:
        raise ValueError(f"choices {choices!r}: none of them was measured ({model.choices})")
    if model.fixed_bytes > budget_bytes:
        return None
    best = None
    for b in micro_batches:
        for r in range(1, len(allowed) + 1):
            # A subset fixes which head transient applies; the assignment found may use fewer
            # choices (a smaller transient), and the subset of exactly those is tried too.
            for subset in itertools.combinations(allowed, r):
                names = _best_for(model, subset, b, budget_bytes - model.fixed_bytes)
                if names is None:
                    continue
                peak, step = model.predict(names, b)
                if step <= 0 or peak > budget_bytes:
                    continue
                tps = b * model.seq_len / step
                tie = best is not None and abs(tps - best[0]) <= 1e-12 * tps
                if best is None or (tps > best[0] and not tie) or (tie and peak < best[2]):
                    best = (tps, names, peak, step, b)
    if best is None:
        return None
    _, names, peak, step, b = best
    return Plan(tuple(zip(model.layers, names)), b, model.seq_len, peak, step, budget_bytes,
                model.compile_memory_budget)
