"""How a tensor is cut into quantization groups, shared by every kernel and its twin.

Groups run along the last dimension and never cross a row: a tensor of shape (..., cols)
is viewed as (rows, cols) and each row holds ceil(cols / G) groups, the last one possibly
short. Per-group metadata therefore has shape (rows, groups_per_row), so it shards with the
parameter along any leading dimension (FSDP's Shard(0)); a 1-D tensor (DeepSpeed's flat
partition) is one row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["GroupLayout", "group_layout", "QuantizedGroups", "AdamWSlot", "AdamWHyper", "adam_bound", "new_weight_guess"]


@dataclass(frozen=True)
class GroupLayout:
    rows: int
    cols: int
    group_size: int

    @property
    def groups_per_row(self) -> int:
        return -(-self.cols // self.group_size) if self.cols else 0

    @property
    def num_groups(self) -> int:
        return self.rows * self.groups_per_row

    @property
    def meta_shape(self) -> tuple[int, int]:
        return (self.rows, self.groups_per_row)


def group_layout(shape: torch.Size | tuple[int, ...], group_size: int) -> GroupLayout:
    shape = tuple(shape)
    cols = shape[-1] if shape else 1
    numel = 1
    for s in shape:
        numel *= s
    rows = numel // cols if cols else 0
    return GroupLayout(rows, cols, group_size)


class QuantizedGroups(NamedTuple):
    """One FP8 tensor with per-group DRE metadata; x = sign(q) * (|q| * 2**sexp) ** (16/kcode) * center."""

    codes: torch.Tensor  # uint8 FP8 bit patterns, the tensor's shape
    center: torch.Tensor  # float32 (rows, groups_per_row): DRE centre c
    kcode: torch.Tensor  # uint8 (rows, groups_per_row): DRE exponent k = kcode / 16
    sexp: torch.Tensor  # int8 (rows, groups_per_row): power-of-two scale exponent

    def to(self, device) -> "QuantizedGroups":
        return QuantizedGroups(*(t.to(device) for t in self))


class AdamWSlot(NamedTuple):
    """One tensor's share of an AdamW step; m and v are FP32 tensors or QuantizedGroups.

    `skips` (int32, (rows, groups_per_row)) counts the steps each group has skipped for
    non-finite values, so its bias correction uses step - skips; None: no group has skipped
    one and this step's skips are not recorded per group.

    `remainder` (int16 or int8, the parameter's shape): with a BF16 `param`, the low part of
    its FP32 master (kernels/master.py); the step reads and writes both. None: `param` is
    the master."""

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: "QuantizedGroups | torch.Tensor"
    exp_avg_sq: "QuantizedGroups | torch.Tensor"
    skips: "torch.Tensor | None" = None
    remainder: "torch.Tensor | None" = None


class AdamWHyper(NamedTuple):
    """Scalars of one AdamW step, computed on the host (no device sync, no recompile)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step_size: float  # lr / (1 - beta1 ** step)
    bias_correction2_sqrt: float  # sqrt(1 - beta2 ** step)
    step: float  # the tensor's step count, this step included

    @classmethod
    def at_step(cls, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float):
        bc1 = 1.0 - beta1**step
        bc2 = 1.0 - beta2**step
        return cls(lr, beta1, beta2, eps, weight_decay, lr / bc1, bc2**0.5, float(step))

    @property
    def m_bound(self) -> float | None:
        """adam_bound of this step's betas: the kernels clamp a quantized first moment to it."""
        return adam_bound(self.beta1, self.beta2)

    def log2_betas(self) -> tuple[float, float]:
        """log2(beta1), log2(beta2) (-inf for 0): the kernels raise beta to a group's own
        step count as exp2(n * log2(beta))."""
        return tuple(math.log2(b) if b > 0 else float("-inf") for b in (self.beta1, self.beta2))


def adam_bound(beta1: float, beta2: float) -> float | None:
    """B with |m| <= B * sqrt(v), element by element, for every state AdamW can reach from any
    gradients (Cauchy-Schwarz over m's and v's geometric sums): (1 - b1) / sqrt((1 - b2) *
    (1 - b1**2 / b2)); None where b1**2 >= b2 (no such bound). FP8 moments rounded again at
    every step drift apart and can leave it, and then updates are no longer a few lr:
    quantized moments are clamped to it, which changes nothing AdamW could reach."""
    if not beta1 ** 2 < beta2:
        return None
    return (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1 ** 2 / beta2))


def new_weight_guess(device: torch.device) -> torch.Tensor:
    """A weight's guess state (fp8_linear.new_guess's layout) before its first quantization:
    exponent 0, which that quantization corrects as it does any wrong guess."""
    return torch.zeros(3, dtype=torch.int32, device=device)
