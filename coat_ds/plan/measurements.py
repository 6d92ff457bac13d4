"""What the planner measures: how (`MeasureConfig`), one configuration's result (`ChoiceRun`)
and a model's, everything the search reads (`Measurements`, saved and read back as JSON).
`measure.py` takes the measurements."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .plan import CHOICES, compile_budget

__all__ = ["MeasureConfig", "ChoiceRun", "Measurements"]


def _is_compile_budget(value) -> bool:
    try:
        return compile_budget("compile_budgets", value) is not None
    except ValueError:
        return False


@dataclass(frozen=True)
class MeasureConfig:
    """How the planner measures a model."""

    seq_len: int = 2048  # tokens per sequence
    batches: tuple[int, ...] = (1, 2)  # micro-batches each choice is measured at: two (a line), or one (proportional)
    choices: tuple[str, ...] = ("keep", "fp8", "recompute")  # measured and searched; the first is the time base
    timed_steps: int = 3  # timed steps per choice and micro-batch (their median is the step time)
    warmup_steps: int = 1  # untimed steps before each measurement (compilation, allocator, optimizer state)
    autocast: bool | None = None  # BF16 autocast around forward; None: on CUDA only
    seed: int = 0  # token ids of the measured steps
    compile_budgets: tuple[float, ...] = ()  # torch.compile activation-memory budgets measured beside torch's own
    # Micro-batches per optimizer step of the run planned for. Above 1, an optimizer that steps
    # in backward (CoatAdamW(step_in_backward=True)) is measured inside `accumulating()`: the
    # run holds every gradient across its micro-batches, so the plan must too.
    grad_accumulation: int = 1

    def __post_init__(self):
        if not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ValueError(f"MeasureConfig.seq_len: got {self.seq_len!r}; allowed: an integer >= 1")
        b = tuple(self.batches)
        if len(b) not in (1, 2) or not all(isinstance(x, int) and x >= 1 for x in b) or (len(b) == 2 and b[0] >= b[1]):
            raise ValueError(f"MeasureConfig.batches: got {self.batches!r}; allowed: one integer >= 1, or two "
                             "with 1 <= b1 < b2")
        object.__setattr__(self, "batches", b)
        choices = tuple(self.choices)
        bad = [c for c in choices if c not in CHOICES]
        if bad or not choices or len(set(choices)) != len(choices):
            raise ValueError(f"MeasureConfig.choices: got {self.choices!r}; allowed: distinct names of {CHOICES}")
        object.__setattr__(self, "choices", choices)
        if not isinstance(self.timed_steps, int) or self.timed_steps < 1:
            raise ValueError(f"MeasureConfig.timed_steps: got {self.timed_steps!r}; allowed: an integer >= 1")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"MeasureConfig.warmup_steps: got {self.warmup_steps!r}; allowed: an integer >= 0")
        if self.autocast not in (None, True, False):
            raise ValueError(f"MeasureConfig.autocast: got {self.autocast!r}; allowed: true, false or null")
        try:
            budgets = tuple(self.compile_budgets)
        except TypeError:
            budgets = None
        if budgets is None or not all(_is_compile_budget(b) for b in budgets) or len(set(budgets)) != len(budgets):
            raise ValueError(f"MeasureConfig.compile_budgets: got {self.compile_budgets!r}; allowed: distinct "
                             "numbers in [0, 1]")
        object.__setattr__(self, "compile_budgets", tuple(float(b) for b in budgets))
        if not isinstance(self.grad_accumulation, int) or isinstance(self.grad_accumulation, bool) \
                or self.grad_accumulation < 1:
            raise ValueError(f"MeasureConfig.grad_accumulation: got {self.grad_accumulation!r}; allowed: an "
                             "integer >= 1")


@dataclass(frozen=True)
class ChoiceRun:
    """One measured configuration: every layer on `choice`, at `batch` sequences."""

    choice: str  # the choice every layer had
    batch: int  # micro-batch (sequences)
    layer_bytes: tuple[int, ...]  # per layer, model order: bytes its forward left allocated, its input released
    peak_bytes: int  # the step's peak, resident bytes included
    step_s: float  # median time of one training step (forward, backward, optimizer step)
    compile_budget: float | None = None  # torch.compile's activation-memory budget it ran under; None: torch's own


@dataclass(frozen=True)
class Measurements:
    """Everything the search needs, as measured."""

    layers: tuple[str, ...]  # decoder layer fqns, model order
    seq_len: int  # tokens per sequence of every measured step
    device: str  # where it was measured
    meter: str  # what the byte figures come from
    params_bytes: int  # parameters (distinct storages)
    grads_bytes: int  # gradients after backward (stepped in backward: only raise-mode groups' are left)
    optimizer_state_bytes: int  # optimizer state but step counters, after steps
    runs: tuple[ChoiceRun, ...]  # one per measured choice and micro-batch
    layer_grad_bytes: tuple[int, ...]  # per layer: bytes of its parameters' gradients (allocated as backward passes it)
    # The measured optimizer stepped each parameter in backward and freed its gradient
    # (CoatAdamW(step_in_backward=True), no gradient accumulation).
    step_in_backward: bool = False
    # With step_in_backward: the most gradient bytes held during backward (in_backward_grad_bytes:
    # one bucket plus the largest parameter's gradient, at most every gradient); else 0.
    in_backward_grad_bytes: int = 0

    @property
    def fixed_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.in_backward_grad_bytes + self.optimizer_state_bytes

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.choice for r in self.runs))

    @property
    def compile_budgets(self) -> tuple[float | None, ...]:
        """torch.compile activation-memory budgets measured (None: torch's own), in order."""
        return tuple(dict.fromkeys(r.compile_budget for r in self.runs))

    def run(self, choice: str, batch: int, compile_budget: float | None = None) -> ChoiceRun:
        for r in self.runs:
            if r.choice == choice and r.batch == batch and r.compile_budget == compile_budget:
                return r
        at = "" if compile_budget is None else f" under compile budget {compile_budget:g}"
        raise KeyError(f"no measurement of {choice!r} at micro-batch {batch}{at}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Measurements":
        runs = tuple(ChoiceRun(**{**r, "layer_bytes": tuple(r["layer_bytes"])}) for r in d["runs"])
        return cls(**{**d, "layers": tuple(d["layers"]), "runs": runs,
                      "layer_grad_bytes": tuple(d["layer_grad_bytes"])})
