"""train.py's health line: the largest |weight| and the moments' distance to Adam's bound
(coat_ds.optim.health), the maximum over every rank, each with the parameter it came from."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..optim.health import CORRUPT_RATIO, moment_bound_ratios, param_absmax

__all__ = ["Health", "read_health", "param_names"]


@dataclass(frozen=True)
class Health:
    weight: float  # max |w| over every parameter (inf: one is not finite)
    weight_of: str
    ratio: float  # max |m| / (B * sqrt(v)) (inf: v is 0 where m is not, or not finite)
    ratio_of: str

    def line(self) -> str:
        return (f"health: max |w| {self.weight:.4g} ({self.weight_of}) | max |m|/(B sqrt v) {self.ratio:.3g} "
                f"({self.ratio_of})")

    def problem(self) -> str | None:
        """A warning's text where the state is not one training can go on from."""
        if not math.isfinite(self.weight):
            return f"parameter {self.weight_of} holds NaN or inf: the loss of any batch that reads it is not finite"
        if self.ratio > CORRUPT_RATIO:
            return (f"optimizer moments of {self.ratio_of} are {self.ratio:.3g}x Adam's bound |m| <= B sqrt(v) "
                    f"(rounding stays below {CORRUPT_RATIO:g}x): the state is not one AdamW can reach")
        return None

    def metrics(self) -> dict:
        return {"param_absmax": self.weight, "param_absmax_of": self.weight_of, "moment_bound_ratio": self.ratio,
                "moment_bound_ratio_of": self.ratio_of}


def read_health(optimizer: torch.optim.Optimizer, params: list[tuple[torch.Tensor, dict]], names: list[str]) -> Health:
    """Health of `params` ((tensor, param group) pairs `optimizer` steps, the same number on
    every rank) over every rank; `names[i]` names the i-th."""
    readings = torch.stack([param_absmax(params).cpu(), moment_bound_ratios(optimizer, params).cpu()])
    readings = torch.nan_to_num(readings, nan=float("inf"))  # a NaN would not survive a max over ranks
    if dist.is_initialized():
        if dist.get_backend() == "nccl":
            readings = readings.cuda()
        dist.all_reduce(readings, op=dist.ReduceOp.MAX)
    values = readings.cpu()
    if not values.numel():
        return Health(0.0, "-", 0.0, "-")
    (w, wi), (r, ri) = (values[k].max(0) for k in range(2))
    return Health(w.item(), names[wi], r.item(), names[ri])


def param_names(params: list[tuple[torch.Tensor, dict]], model: torch.nn.Module) -> list[str]:
    """The model's name of each tensor of `params`; an engine's own (DeepSpeed's flat FP32
    partitions) by their place."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id.get(id(p), f"flat partition {i}") for i, (p, _) in enumerate(params)]
