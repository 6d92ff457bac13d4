"""CoatAdamW's per-parameter state layout, its byte count and its FP32 conversions.

A parameter whose whole tensor has at least `min_quant_numel` elements keeps, per moment,
`<moment>_codes` (uint8 FP8 codes, the local tensor's shape) and per-group `<moment>_center`
(float32), `<moment>_kcode` (uint8, DRE exponent * 16) and `<moment>_sexp` (int8, power-of-two
scale exponent), groups laid out (rows, groups_per_row). Smaller parameters keep FP32
`exp_avg` / `exp_avg_sq` exactly like torch.optim.AdamW. `step` is a CPU float32 scalar.
"""
from __future__ import annotations

import torch

from ..config import OptimStateConfig
from ..kernels import QuantizedGroups, get_ops, group_layout

__all__ = ["MOMENTS", "is_quantized", "init_state", "moment", "state_bytes", "to_fp32", "from_fp32"]

MOMENTS = ("exp_avg", "exp_avg_sq")
_PARTS = QuantizedGroups._fields


def is_quantized(state: dict) -> bool:
    return "exp_avg_codes" in state


def _zero_moment(local: torch.Tensor, group_size: int) -> QuantizedGroups:
    lay = group_layout(local.shape, group_size)
    dev = local.device
    return QuantizedGroups(
        torch.zeros(local.shape, dtype=torch.uint8, device=dev),
        torch.ones(lay.meta_shape, dtype=torch.float32, device=dev),
        torch.full(lay.meta_shape, 16, dtype=torch.uint8, device=dev),
        torch.zeros(lay.meta_shape, dtype=torch.int8, device=dev),
    )


def init_state(local: torch.Tensor, quantize: bool, cfg: OptimStateConfig) -> dict:
    state: dict = {"step": torch.zeros((), dtype=torch.float32)}
    for name in MOMENTS:
        if quantize:
            qg = _zero_moment(local, cfg.group_size)
            state.update({f"{name}_{part}": t for part, t in zip(_PARTS, qg)})
        else:
            state[name] = torch.zeros(local.shape, dtype=torch.float32, device=local.device)
    return state


def moment(state: dict, name: str) -> QuantizedGroups | torch.Tensor:
    if is_quantized(state):
        return QuantizedGroups(*(state[f"{name}_{part}"] for part in _PARTS))
    return state[name]


def state_bytes(state: dict) -> int:
    """Bytes of the moment tensors (the step counter is not counted)."""
    return sum(t.numel() * t.element_size() for k, t in state.items() if k != "step" and torch.is_tensor(t))


def _formats(cfg: OptimStateConfig) -> dict[str, str]:
    return {"exp_avg": cfg.first_moment_format, "exp_avg_sq": cfg.second_moment_format}


def to_fp32(state: dict, cfg: OptimStateConfig) -> dict:
    """torch.optim.AdamW-shaped copy of `state`: step, FP32 exp_avg and exp_avg_sq."""
    out = {"step": state["step"].clone()}
    for name, fmt in _formats(cfg).items():
        mom = moment(state, name)
        if isinstance(mom, QuantizedGroups):
            ops = get_ops(mom.codes.device, cfg.backend)
            out[name] = ops.dequantize_groups(mom, cfg.group_size, fmt)
        else:
            out[name] = mom.detach().to(torch.float32, copy=True)
    return out


def from_fp32(fp32_state: dict, local: torch.Tensor, quantize: bool, cfg: OptimStateConfig) -> dict:
    """Inverse of `to_fp32` for a parameter whose local tensor is `local`."""
    state = {"step": torch.as_tensor(fp32_state["step"], dtype=torch.float32).detach().clone().cpu()}
    for name, fmt in _formats(cfg).items():
        src = fp32_state[name].detach().to(device=local.device, dtype=torch.float32)
        if src.shape != local.shape:
            raise ValueError(f"{name} has shape {tuple(src.shape)}, parameter has {tuple(local.shape)}")
        if quantize:
            qg = get_ops(local.device, cfg.backend).quantize_groups(src, cfg.group_size, fmt,
                                                                   cfg.dynamic_range_expansion)
            state.update({f"{name}_{part}": t for part, t in zip(_PARTS, qg)})
        else:
            state[name] = src.clone()
    return state
