"""Training-state bytes one rank holds, by kind, read from the live tensors: the weights the
optimizer steps, its state, the gradients and the weights kept for compute beside them.

Each kind counts distinct storages (views of one flat buffer count once, whole), a DTensor
or ZeRO-3 parameter by its local piece. The optimizer's own `state_bytes()` report is read
where it has one (CoatAdamW's: its moments, and, where it keeps part of the master weights
in its state, `master_bytes`); any other optimizer counts every state tensor but the step.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable

import torch
from torch import nn

from ..models.sharded_init import local_range
from ..optim.state import state_bytes
from .tensors import local_tensor, unique_storage_bytes

__all__ = ["TrainingStateBytes", "held_gradients", "gradient_bytes", "training_state_bytes", "model_numel",
           "per_rank_lines"]


@dataclass(frozen=True)
class TrainingStateBytes:
    """Bytes of training state on one rank (or summed over ranks)."""

    master: int  # weights the optimizer steps: FP32 masters (or a BF16 parameter and its remainder)
    optimizer: int  # optimizer state (moments, scales, skip counters), step counters excluded
    gradients: int  # alive after backward, before the step: the parameters', the engine's, those held for the step
    compute: int  # weights kept for compute beside the masters (DeepSpeed's BF16 parameters); FSDP2 gathers them per layer only while used

    @classmethod
    def sum(cls, states: Iterable["TrainingStateBytes"]) -> "TrainingStateBytes":
        """Each kind summed over `states` (several ranks')."""
        return cls(*(sum(v) for v in zip(*(s.as_dict().values() for s in states))))

    @property
    def total(self) -> int:
        return self.master + self.optimizer + self.gradients + self.compute

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def per_param(self, numel: float) -> dict[str, float]:
        """Each kind, and the total, over `numel` parameters."""
        return {k: v / numel for k, v in {**self.as_dict(), "total": self.total}.items()}

    def describe(self, numel: float) -> str:
        """Bytes per parameter over `numel` parameters, as logs show them."""
        per = self.per_param(numel)
        return (f"master {per['master']:.2f} | optimizer {per['optimizer']:.2f} | gradients {per['gradients']:.2f} | "
                f"compute copies {per['compute']:.2f} | total {per['total']:.2f}")


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _model_weights(model: nn.Module) -> list[torch.Tensor]:
    """What this rank holds of the model's parameters: a DTensor's shard, ZeRO-3's partition
    and, for a parameter ZeRO-3 keeps whole between uses (its persistence threshold), that
    whole tensor too."""
    return [t for p in model.parameters() for t in (local_range(p).flat, local_tensor(p.data)) if t.numel()]


def _weights(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return _model_weights(model) + [local_tensor(p) for p in _optimizer_params(optimizer)]


def held_gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Gradients an optimizer keeps for its step after freeing the parameters' own:
    CoatAdamW stepping in backward with clipping holds BF16 copies until step()."""
    held = getattr(optimizer, "held_gradients", None)
    return held() if callable(held) else []


def gradient_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, engine_grads: Iterable = ()) -> int:
    """Gradient bytes alive now (read after backward): the gradients of the model's and the
    optimizer's parameters, `engine_grads` (an engine's gradient buffers) and those the
    optimizer holds, leaving out any storage that is a weight's."""
    weights = {t.untyped_storage().data_ptr() for t in _weights(model, optimizer)}
    params = [*model.parameters(), *_optimizer_params(optimizer)]
    grads = [p.grad for p in params] + list(engine_grads) + held_gradients(optimizer)
    return unique_storage_bytes(g for g in grads if g is not None and
                                local_tensor(g).untyped_storage().data_ptr() not in weights)


def training_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, gradients: int,
                         masters: Iterable[torch.Tensor] | None = None) -> TrainingStateBytes:
    """This rank's training state (read after a step, once the optimizer state exists);
    `gradients`: `gradient_bytes` read after that step's backward; `masters`: the tensors the
    optimizer steps where its param groups do not hold them between steps (ZeRO-3's FP32
    partitions), else its parameters."""
    report = optimizer.state_bytes() if callable(getattr(optimizer, "state_bytes", None)) else None
    masters = [local_tensor(p) for p in (_optimizer_params(optimizer) if masters is None else masters)]
    if isinstance(report, dict):
        moments = int(report["state_bytes"])
        master = int(report.get("master_bytes", unique_storage_bytes(masters)))
    else:
        moments, master = state_bytes(*optimizer.state.values()), unique_storage_bytes(masters)
    taken = {t.untyped_storage().data_ptr() for t in masters}
    compute = [t for t in _model_weights(model) if t.untyped_storage().data_ptr() not in taken]
    return TrainingStateBytes(master, moments, gradients, unique_storage_bytes(compute))


def model_numel(model: nn.Module) -> int:
    """Elements of the whole model (sharded or partitioned parameters counted whole)."""
    return sum(local_range(p).numel for p in model.parameters())


def per_rank_lines(per_rank: list[TrainingStateBytes], numel: int) -> list[str]:
    """Log lines of bytes per parameter: each rank's (its bytes over its share, numel over the
    ranks), then all ranks' together (their bytes over numel)."""
    total = TrainingStateBytes.sum(per_rank)
    lines = [f"  rank {r}: {b.describe(numel / len(per_rank))} ({b.total / 1e9:.4g} GB)" for r, b in enumerate(per_rank)]
    return lines + [f"  all ranks: {total.describe(numel)} ({total.total / 1e9:.4g} GB for {numel:,} parameters)"]
