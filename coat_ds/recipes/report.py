"""What `prepare` did, edit by edit: the report it returns and logs."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..activation.api import ActivationCompression

__all__ = ["Step", "PrepareReport"]


@dataclass(frozen=True)
class Step:
    """One edit of a recipe: applied or skipped, and what it touched or why not."""

    name: str
    applied: bool
    detail: str

    def __str__(self) -> str:
        return f"  {self.name:<20} {'applied' if self.applied else 'skipped'}: {self.detail}"


@dataclass(frozen=True)
class PrepareReport:
    """What `prepare` did: the recipe, the model it saw, each edit, and what is left to the
    optimizer and the compile call."""

    recipe: str
    model: str  # what the model was taken for, e.g. "Hugging Face LlamaForCausalLM"
    steps: tuple[Step, ...]
    optimizer_options: dict = field(default_factory=dict)  # for CoatAdamW(...), e.g. step_in_backward
    activations: ActivationCompression | None = None  # compress_activations' handle (stats, remove)

    def applied(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.steps if s.applied)

    def __getitem__(self, name: str) -> Step:
        for s in self.steps:
            if s.name == name:
                return s
        raise KeyError(f"no step {name!r}; steps: {', '.join(s.name for s in self.steps)}")

    def __str__(self) -> str:
        lines = [f"coat_ds.prepare(recipe={self.recipe!r}) on {self.model}:"] + [str(s) for s in self.steps]
        if self.optimizer_options:
            opts = ", ".join(f"{k}={v!r}" for k, v in self.optimizer_options.items())
            lines.append(f"  optimizer: CoatAdamW(..., {opts}) where the engine allows it (FSDP2)")
        return "\n".join(lines)
