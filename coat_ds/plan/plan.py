"""`Plan`: what each decoder layer does with its saved activations, at which micro-batch, and
what the planner predicted for it; saved and loaded as JSON, every value checked."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ..io.atomic import atomic_write

__all__ = ["CHOICES", "Plan", "load_plan", "PLAN_VERSION"]

# keep: BF16 (or whatever autocast gives) saved as is; fp8: compress_activations on the layer;
# fp8_linear: convert_to_fp8_linear + compress_activations on the layer; recompute:
# activation checkpointing of the layer (torch.utils.checkpoint, non-reentrant).
CHOICES = ("keep", "fp8", "fp8_linear", "recompute")
PLAN_VERSION = 1
_KEYS = ("version", "layers", "micro_batch", "seq_len", "predicted_peak_bytes", "predicted_step_s", "budget_bytes",
         "compile_memory_budget")


def _bad(key: str, value, allowed: str) -> ValueError:
    return ValueError(f"plan: {key}: got {value!r}; allowed: {allowed}")


def _positive_int(key: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _bad(key, value, "an integer >= 1")
    return value


def _optional_number(key: str, value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise _bad(key, value, "a finite number >= 0, or null")
    return float(value)


def compile_budget(key: str, value) -> float | None:
    """A torch.compile activation-memory budget: a number in [0, 1], or None (torch's own)."""
    value = _optional_number(key, value)
    if value is not None and value > 1:
        raise _bad(key, value, "a number in [0, 1] (torch.compile's activation-memory budget), or null")
    return value


@dataclass(frozen=True)
class Plan:
    """One choice per decoder layer, the micro-batch, and the planner's predictions."""

    layers: tuple[tuple[str, str], ...]  # (layer fqn, choice) in model order; choice one of CHOICES
    micro_batch: int  # sequences per rank per step the plan was made for
    seq_len: int  # tokens per sequence the plan was made for
    predicted_peak_bytes: float | None = None  # planner's peak for this plan (bytes per rank); None: not predicted
    predicted_step_s: float | None = None  # planner's forward+backward+step time (seconds); None: not predicted
    budget_bytes: float | None = None  # the budget the plan was searched under; None: none given
    compile_memory_budget: float | None = None  # torch.compile's activation-memory budget in [0, 1]; None: torch's own

    def __post_init__(self):
        layers = self.layers.items() if isinstance(self.layers, dict) else self.layers
        try:
            layers = tuple((fqn, choice) for fqn, choice in layers)
        except (TypeError, ValueError):
            raise _bad("layers", self.layers, "a mapping or pairs of layer fqn -> choice") from None
        if not layers:
            raise _bad("layers", self.layers, "at least one layer")
        seen = set()
        for fqn, choice in layers:
            if not isinstance(fqn, str) or not fqn:
                raise _bad("layers", fqn, "non-empty layer names (fully qualified module names)")
            if fqn in seen:
                raise _bad(f"layers[{fqn!r}]", choice, "each layer once")
            seen.add(fqn)
            if choice not in CHOICES:
                raise _bad(f"layers[{fqn!r}]", choice, " / ".join(CHOICES))
        object.__setattr__(self, "layers", layers)
        _positive_int("micro_batch", self.micro_batch)
        _positive_int("seq_len", self.seq_len)
        for key in ("predicted_peak_bytes", "predicted_step_s", "budget_bytes"):
            object.__setattr__(self, key, _optional_number(key, getattr(self, key)))
        object.__setattr__(self, "compile_memory_budget", compile_budget("compile_memory_budget",
                                                                         self.compile_memory_budget))

    @classmethod
    def uniform(cls, fqns, choice: str, micro_batch: int, seq_len: int) -> "Plan":
        """Every layer the same choice (BF16: "keep"; full checkpointing: "recompute")."""
        return cls(tuple((f, choice) for f in fqns), micro_batch, seq_len)

    def choice(self, fqn: str) -> str:
        return dict(self.layers)[fqn]

    def counts(self) -> dict[str, int]:
        """Layers per choice, every choice listed."""
        out = dict.fromkeys(CHOICES, 0)
        for _, c in self.layers:
            out[c] += 1
        return out

    def summary(self) -> str:
        """One line: choices, micro-batch and predictions."""
        mix = ", ".join(f"{n} {c}" for c, n in self.counts().items() if n)
        peak = "" if self.predicted_peak_bytes is None else f", predicted peak {self.predicted_peak_bytes / 1e9:.3f} GB"
        step = "" if self.predicted_step_s is None else f", predicted step {self.predicted_step_s * 1e3:.1f} ms"
        budget = "" if self.compile_memory_budget is None else \
            f", torch.compile activation-memory budget {self.compile_memory_budget:g}"
        return (f"plan: {len(self.layers)} layers ({mix}), micro-batch {self.micro_batch} x {self.seq_len}"
                f"{budget}{peak}{step}")

    def to_dict(self) -> dict:
        return {"version": PLAN_VERSION, "layers": dict(self.layers), "micro_batch": self.micro_batch,
                "seq_len": self.seq_len, "predicted_peak_bytes": self.predicted_peak_bytes,
                "predicted_step_s": self.predicted_step_s, "budget_bytes": self.budget_bytes,
                "compile_memory_budget": self.compile_memory_budget}

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        if not isinstance(d, dict):
            raise _bad("(top level)", type(d).__name__, "a JSON object")
        unknown = sorted(set(d) - set(_KEYS))
        if unknown:
            raise ValueError(f"plan: unknown key(s) {unknown}; allowed: {', '.join(_KEYS)}")
        for key in ("layers", "micro_batch", "seq_len"):
            if key not in d:
                raise ValueError(f"plan: missing key {key!r}")
        if d.get("version", PLAN_VERSION) != PLAN_VERSION:
            raise _bad("version", d["version"], str(PLAN_VERSION))
        if not isinstance(d["layers"], dict):
            raise _bad("layers", d["layers"], "a JSON object of layer fqn -> choice")
        return cls(tuple(d["layers"].items()), d["micro_batch"], d["seq_len"], d.get("predicted_peak_bytes"),
                   d.get("predicted_step_s"), d.get("budget_bytes"), d.get("compile_memory_budget"))

    def save(self, path: str) -> None:
        """Whole or not at all: a failed write leaves any earlier file as it was."""
        with atomic_write(path) as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")


def load_plan(path: str) -> Plan:
    """A plan file written by `Plan.save` (or by hand); errors name the file and the key."""
    try:
        with open(path) as f:
            d = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read the plan: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    try:
        return Plan.from_dict(d)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
