"""From measurements to a plan: a linear cost model per layer and choice, and the search for
the assignment with the most tokens/s whose predicted peak fits a budget.

Prediction, for choices a (one per layer) at micro-batch b:
    peak(a, b) = fixed + sum_i bytes_i(a_i, b) + max over choices c used in a of transient_c(b)
    step(a, b) = step_base(b) + sum_i seconds_i(a_i, b)
and the peak never below `fixed`. bytes_i(c, b): what layer i's forward leaves allocated
under c; transient_c(b): the rest of the measured peak of the all-c run (logits and loss,
gradients, a recomputed layer's activations in backward); step_base is the all-base run's step time, seconds_i(c, b) the
all-c run's step time above it, shared equally by the layers. Each is linear in b through
the two measured micro-batches. The search is exact for this model: per micro-batch and per
set of choices allowed, a dynamic programme over layers keeps every (bytes, seconds) point
not beaten on both (a Pareto front); past `MAX_FRONT` points the front is thinned on bytes
rounded up, so what it returns still fits.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from .measure import Measurements
from .plan import Plan

__all__ = ["CostModel", "search_plan", "best_assignment", "MAX_FRONT"]

MAX_FRONT = 20000  # Pareto points kept per layer before the front is thinned


def _line(b1: int, y1: float, b2: int, y2: float) -> tuple[float, float]:
    slope = (y2 - y1) / (b2 - b1)
    return y1 - slope * b1, slope


@dataclass(frozen=True)
class CostModel:
    """Linear-in-micro-batch costs: each entry an (intercept, slope) pair."""

    layers: tuple[str, ...]  # decoder layer fqns, model order
    choices: tuple[str, ...]  # choices that were measured; the first is the time base
    seq_len: int  # tokens per sequence
    fixed_bytes: float  # parameters + gradients + optimizer state
    layer_bytes: tuple[tuple[tuple[float, float], ...], ...]  # [layer][choice] bytes left allocated by forward
    layer_s: tuple[tuple[tuple[float, float], ...], ...]  # [layer][choice] seconds above the base choice
    transient: tuple[tuple[float, float], ...]  # [choice] peak not covered by fixed + layers
    base_s: tuple[float, float]  # step time with every layer on the base choice

    @classmethod
    def from_measurements(cls, m: Measurements, batches: tuple[int, int] | None = None) -> "CostModel":
        choices = m.choices
        if batches is None:
            batches = tuple(sorted({r.batch for r in m.runs}))[:2]
        b1, b2 = batches
        n = len(m.layers)
        base = choices[0]

        def fit(f):
            return _line(b1, f(b1), b2, f(b2))

        layer_bytes = tuple(tuple(fit(lambda b, c=c: m.run(c, b).layer_bytes[i]) for c in choices) for i in range(n))
        layer_s = tuple(tuple(fit(lambda b, c=c: (m.run(c, b).step_s - m.run(base, b).step_s) / n) for c in choices)
                        for _ in range(n))
        transient = tuple(fit(lambda b, c=c: m.run(c, b).peak_bytes - m.fixed_bytes - sum(m.run(c, b).layer_bytes))
                          for c in choices)
        return cls(m.layers, choices, m.seq_len, float(m.fixed_bytes), layer_bytes, layer_s, transient,
                   fit(lambda b: m.run(base, b).step_s))

    @staticmethod
    def at(line: tuple[float, float], b: int) -> float:
        return line[0] + line[1] * b

    def predict(self, assignment, b: int) -> tuple[float, float]:
        """(peak bytes, step seconds) of choices `assignment` (names, one per layer) at micro-batch b."""
        idx = [self.choices.index(c) for c in assignment]
        peak = self.fixed_bytes + sum(self.at(self.layer_bytes[i][j], b) for i, j in enumerate(idx))
        peak += max(self.at(self.transient[j], b) for j in set(idx))
        # Below the batches where activations dominate, the peak is at the end of backward:
        # every gradient allocated, activations gone. A line through two such batches would
        # go under it.
        peak = max(peak, self.fixed_bytes)
        step = self.at(self.base_s, b) + sum(self.at(self.layer_s[i][j], b) for i, j in enumerate(idx))
        return peak, step


def best_assignment(options: list[list[tuple[float, float]]], budget: float) -> tuple[list[int], float, float] | None:
    """Indices (one per layer) minimising total seconds with total bytes <= budget, with
    their (bytes, seconds); None where nothing fits. `options[i][j]` = (bytes, seconds)."""
    # The least bytes the layers after i can add (negative where a layer frees more than it
    # holds): a partial sum is dropped only when no completion can fit.
    rest = [0.0] * (len(options) + 1)
    for i in range(len(options) - 1, -1, -1):
        rest[i] = rest[i + 1] + min(ob for ob, _ in options[i])
    front = [(0.0, 0.0, -1, -1)]  # (bytes, seconds, parent index in the previous front, option)
    history = []
    for i, opts in enumerate(options):
        cand = [(fb + ob, fs + os_, k, j) for k, (fb, fs, _, _) in enumerate(front) for j, (ob, os_) in enumerate(opts)
                if fb + ob + rest[i + 1] <= budget]
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


def search_plan(model: CostModel, budget_bytes: float, *, max_batch: int,
                choices: tuple[str, ...] | None = None) -> Plan | None:
    """The plan with the most tokens/s whose predicted peak is <= budget_bytes, over
    micro-batches 1, 2, 4, ... <= max_batch and the allowed choices (default: all measured);
    None where no micro-batch fits."""
    allowed = [c for c in (choices or model.choices) if c in model.choices]
    if not allowed:
        raise ValueError(f"choices {choices!r}: none of them was measured ({model.choices})")
    if model.fixed_bytes > budget_bytes:
        return None
    best = None
    b = 1
    while b <= max_batch:
        for r in range(1, len(allowed) + 1):
            for subset in itertools.combinations(allowed, r):
                cols = [model.choices.index(c) for c in subset]
                room = budget_bytes - model.fixed_bytes - max(model.at(model.transient[j], b) for j in cols)
                opts = [[(model.at(model.layer_bytes[i][j], b), model.at(model.layer_s[i][j], b)) for j in cols]
                        for i in range(len(model.layers))]
                found = best_assignment(opts, room)
                if found is None:
                    continue
                names = [subset[j] for j in found[0]]
                peak, step = model.predict(names, b)
                if step <= 0:
                    continue
                tps = b * model.seq_len / step
                if best is None or tps > best[0] * (1 + 1e-12) or (abs(tps - best[0]) <= 1e-12 * tps and peak < best[2]):
                    best = (tps, names, peak, step, b)
        b *= 2
    if best is None:
        return None
    _, names, peak, step, b = best
    return Plan(tuple(zip(model.layers, names)), b, model.seq_len, peak, step, budget_bytes)
