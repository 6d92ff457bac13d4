"""CoatAdamW's per-parameter state layout, its byte count and its FP32 conversions.

A parameter whose whole tensor has at least `min_quant_numel` elements keeps each moment as
an `Fp8Moment` (`moment.py`: flat keys `<moment>_codes`, `_center`, `_kcode`, `_sexp`).
Smaller parameters keep FP32 `exp_avg` / `exp_avg_sq` exactly like torch.optim.AdamW.
`step` is a CPU float32 scalar. Every parameter also keeps `group_skips` (int32,
(rows, groups_per_row)): the steps each group skipped for non-finite values, so that its bias
correction uses step - group_skips. A BF16 parameter of a `master_weights="bf16+*"` group
keeps `master_remainder` (int16 / int8, its shape), the rest of its FP32 master (master.py).
"""
from __future__ import annotations

import torch

from ..config import OptimStateConfig
from ..kernels import QuantizedGroups, group_layout
from ..memory.tensors import local_tensor, unique_storage_bytes
from .moment import MOMENTS, Fp8Moment

__all__ = ["MOMENTS", "SKIPS_KEY", "REMAINDER_KEY", "is_quantized", "init_state", "zero_skips", "moment", "group_state_config",
           "kernel_moments", "state_tensors", "state_bytes", "to_fp32", "from_fp32"]

SKIPS_KEY = "group_skips"
REMAINDER_KEY = "master_remainder"


def group_state_config(group: dict) -> OptimStateConfig:
    """The OptimStateConfig a CoatAdamW param group (or its saved copy) stands for; an option
    a group lacks (`master_weights` is never saved; torch.optim.AdamW's have none) takes its
    default."""
    return OptimStateConfig(**{k: group[k] for k in OptimStateConfig.__dataclass_fields__ if k in group})


def is_quantized(state: dict) -> bool:
    return Fp8Moment.stored_in(state, MOMENTS[0])


def zero_skips(local: torch.Tensor, group_size: int) -> torch.Tensor:
    return torch.zeros(group_layout(local.shape, group_size).meta_shape, dtype=torch.int32, device=local.device)


def init_state(local: torch.Tensor, quantize: bool, cfg: OptimStateConfig) -> dict:
    state: dict = {"step": torch.zeros((), dtype=torch.float32), SKIPS_KEY: zero_skips(local, cfg.group_size)}
    for name in MOMENTS:
        if quantize:
            Fp8Moment.zeros(local.shape, local.device, name, cfg).into_state(state, name)
        else:
            state[name] = torch.zeros(local.shape, dtype=torch.float32, device=local.device)
    return state


def moment(state: dict, name: str, cfg: OptimStateConfig) -> Fp8Moment | torch.Tensor:
    """Moment `name` of `state`: an Fp8Moment, or the FP32 tensor of a small parameter."""
    return Fp8Moment.from_state(state, name, cfg) if is_quantized(state) else state[name]


def kernel_moments(state: dict, cfg: OptimStateConfig) -> tuple[QuantizedGroups | torch.Tensor, ...]:
    """(exp_avg, exp_avg_sq) as the step kernels read them: FP32 tensors or each
    Fp8Moment's inner tensors (the state's own, not copies)."""
    return tuple(m.groups if isinstance(m, Fp8Moment) else m for m in (moment(state, n, cfg) for n in MOMENTS))


def state_tensors(*states: dict) -> list[torch.Tensor]:
    """Every tensor of the per-parameter optimizer states `states` but the step counter, a
    DTensor as this rank's local shard (its global size would overstate every rank by the
    world size). Any optimizer's: CoatAdamW's codes, scales and skip counters, torch AdamW's
    FP32 moments."""
    return [local_tensor(t) for state in states for k, t in state.items() if k != "step" and torch.is_tensor(t)]


def state_bytes(*states: dict, storages: bool = False) -> int:
    """Bytes this rank holds in the per-parameter optimizer states `states` (`state_tensors`).

    By default each tensor counts numel x element size: the state's own size, defined for a
    layout on the meta device too. With `storages`, the distinct storages behind the tensors
    count instead, each once and whole: what the allocator holds where an engine keeps the
    states as views of flat buffers (padding included)."""
    tensors = state_tensors(*states)
    if storages:
        return unique_storage_bytes(tensors)
    return sum(t.numel() * t.element_size() for t in tensors)


def _fold_factor(step: float, skips: torch.Tensor, beta: float) -> torch.Tensor:
    """Per group (float64): (1 - beta**step) / (1 - beta**(step - skips)), 1 where nothing
    was skipped (or the group never updated, its moment is then zero)."""
    n = step - skips.to(torch.float64)
    own = 1.0 - torch.pow(torch.tensor(beta, dtype=torch.float64), n)
    factor = (1.0 - beta**step) / torch.where(n > 0, own, 1.0)
    return torch.where((skips > 0) & (n > 0), factor, 1.0)


def _fold(moment_fp32: torch.Tensor, factor: torch.Tensor, group_size: int) -> torch.Tensor:
    lay = group_layout(moment_fp32.shape, group_size)
    per_elem = factor.to(moment_fp32.device).repeat_interleave(group_size, dim=1)[:, :lay.cols]
    return (moment_fp32.reshape(lay.rows, lay.cols).double() * per_elem).float().reshape(moment_fp32.shape)


def to_fp32(state: dict, cfg: OptimStateConfig, betas: tuple[float, float]) -> dict:
    """torch.optim.AdamW-shaped copy of `state`: step, FP32 exp_avg and exp_avg_sq.

    torch's AdamW has one step per tensor. A group that skipped s of the tensor's t steps
    has its moments scaled by (1 - beta**t) / (1 - beta**(t - s)) (beta1 for exp_avg,
    beta2 for exp_avg_sq, `betas` of its param group), so that torch's bias correction at
    step t gives the group's own bias-corrected moments, element by element."""
    out = {"step": state["step"].clone()}
    skips = state.get(SKIPS_KEY)
    step = float(state["step"])
    for name, beta in zip(MOMENTS, betas):
        mom = moment(state, name, cfg)
        if isinstance(mom, Fp8Moment):
            out[name] = mom.to_fp32(cfg.backend)
        else:
            out[name] = mom.detach().to(torch.float32, copy=True)
        if skips is not None and bool((skips > 0).any()):
            out[name] = _fold(out[name], _fold_factor(step, skips.cpu(), beta), cfg.group_size)
    return out


def from_fp32(fp32_state: dict, local: torch.Tensor, quantize: bool, cfg: OptimStateConfig) -> dict:
    """Inverse of `to_fp32` for a parameter whose local tensor is `local`. Its moments are
    taken as torch's (skips folded in): every group starts with no skipped step, unless the
    state carries `group_skips` (CoatAdamW's own FP32 layout for small parameters)."""
    skips = fp32_state.get(SKIPS_KEY)
    state = {"step": torch.as_tensor(fp32_state["step"], dtype=torch.float32).detach().clone().cpu(),
             SKIPS_KEY: zero_skips(local, cfg.group_size) if skips is None
             else skips.detach().to(local.device, copy=True)}
    for name in MOMENTS:
        src = fp32_state[name].detach().to(device=local.device, dtype=torch.float32)
        if src.shape != local.shape:
            raise ValueError(f"{name} has shape {tuple(src.shape)}, parameter has {tuple(local.shape)}")
        if quantize:
            Fp8Moment.from_fp32(src, name, cfg).into_state(state, name)
        else:
            state[name] = src.clone()
    return state
