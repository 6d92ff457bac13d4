"""Two readings of an AdamW-family optimizer's health, per parameter it steps, for a training
log: the largest |weight|, and how close the moments are to Adam's bound.

Whatever the gradients, AdamW's moments satisfy |m| <= B * sqrt(v) element by element
(kernels/layout.adam_bound), and that keeps every update within a few lr. CoatAdamW clamps a
quantized m to it at each step; what the stored FP8 moments decode to may exceed it by their
rounding (up to ~2x in groups spanning many decades). A ratio |m| / (B * sqrt(v)) far above
that is a state AdamW cannot reach: a corrupted checkpoint or a kernel fault. Both readings
work on CoatAdamW (FP8 or FP32 moments) and on torch.optim.AdamW, on this rank's tensors (a
DTensor's local shard), and return one float32 tensor on the parameters' device, one entry
per parameter, without a host sync; callers reduce over ranks.
"""
from __future__ import annotations

import torch

from ..kernels import group_layout
from ..kernels.layout import adam_bound
from ..memory.tensors import local_tensor
from .moment import MOMENTS, Fp8Moment
from .state import group_state_config, is_quantized, moment

__all__ = ["moment_bound_ratios", "param_absmax", "stepped", "CORRUPT_RATIO"]

# Far above FP8's rounding of a clamped state: a warning's threshold.
CORRUPT_RATIO = 4.0
# Elements decoded at a time: the temporaries of a whole embedding's moments would not fit
# beside a model at the edge of memory.
_CHUNK = 1 << 22


def stepped(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, dict]]:
    """(parameter, its param group) for every tensor in `optimizer.param_groups`: what the
    readings take by default. An engine that swaps its tensors in and out of the groups
    (DeepSpeed's ZeRO-3 sub-groups) names its own."""
    return [(p, group) for group in optimizer.param_groups for p in group["params"]]


def param_absmax(params: list[tuple[torch.Tensor, dict]]) -> torch.Tensor:
    """max |w| of each parameter of `params` ((tensor, param group) pairs; this rank's part; 0
    where empty; NaN where it holds a NaN)."""
    out = []
    for p, _ in params:
        t = local_tensor(p).detach()
        out.append(torch.linalg.vector_norm(t, float("inf")).float() if t.numel()
                   else torch.zeros((), dtype=torch.float32, device=t.device))
    return torch.stack(out) if out else torch.zeros(0)


def _pieces(x: Fp8Moment):
    """`x` in pieces of whole groups of its (rows, cols) view, at most ~_CHUNK elements each:
    runs of rows, or runs of one row's groups where a row is longer."""
    lay = group_layout(x.groups.codes.shape, x.group_size)

    def part(rows: slice, cols: slice, groups: slice) -> Fp8Moment:
        return x.map(lambda c: c.reshape(lay.rows, lay.cols)[rows, cols], lambda t: t[rows, groups])

    if lay.cols <= _CHUNK:
        step = max(1, _CHUNK // max(1, lay.cols))
        for r in range(0, lay.rows, step):
            yield part(slice(r, r + step), slice(None), slice(None))
        return
    per = max(1, _CHUNK // x.group_size)
    for r in range(lay.rows):
        for g in range(0, lay.groups_per_row, per):
            yield part(slice(r, r + 1), slice(g * x.group_size, (g + per) * x.group_size), slice(g, g + per))


def _moment_ratio(group: dict, state: dict, bound: float) -> torch.Tensor:
    cfg = group_state_config(group)
    m, v = (moment(state, name, cfg) for name in MOMENTS)
    if not isinstance(m, Fp8Moment):
        return _ratio(local_tensor(m).float(), local_tensor(v).float(), bound)
    m, v = (x.map(local_tensor, local_tensor) for x in (m, v))
    worst = torch.zeros((), dtype=torch.float32, device=m.groups.codes.device)
    for mp, vp in zip(_pieces(m), _pieces(v)):
        worst = torch.maximum(worst, _ratio(mp.to_fp32(cfg.backend), vp.to_fp32(cfg.backend), bound))
    return worst


def _ratio(m: torch.Tensor, v: torch.Tensor, bound: float) -> torch.Tensor:
    """max |m| / (B * sqrt(v)), 0 where m is 0, inf where only v is."""
    return torch.where(m == 0, 0.0, m.abs() / (bound * v.clamp(min=0).sqrt())).amax().float()


def moment_bound_ratios(optimizer: torch.optim.Optimizer, params: list[tuple[torch.Tensor, dict]]) -> torch.Tensor:
    """max over elements of |m| / (B * sqrt(v)) for each parameter of `params` in
    `optimizer.state` (0 where it has no moments yet or its betas have no bound)."""
    out = []
    for p, group in params:
        state, bound = optimizer.state.get(p, {}), adam_bound(*group["betas"])
        zero = torch.zeros((), dtype=torch.float32, device=local_tensor(p).device)
        if bound is None or not local_tensor(p).numel():
            out.append(zero)
        elif is_quantized(state) or all(name in state for name in MOMENTS):
            out.append(_moment_ratio(group, state, bound))
        else:
            out.append(zero)
    return torch.stack(out) if out else torch.zeros(0)
