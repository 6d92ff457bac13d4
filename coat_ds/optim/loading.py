"""What `CoatAdamW.load_state_dict` accepts: the param groups it takes from a state dict and
the checks every per-parameter state passes before anything in the optimizer changes.

A state dict may come from CoatAdamW (any version) or from `torch.optim.AdamW`: options it
lacks are taken from the optimizer's current group, torch-only options that would change the
update (`amsgrad`, `maximize`) are refused, and a state tensor that the step would misread
(wrong dtype or shape, FP8 codes that are NaN/inf in the group's format, a centre that is not
positive and finite, an exponent outside its range, non-finite moments, a group skip count
outside [0, step]) is refused with an error naming the parameter and the key. `group_skips`
is optional (older CoatAdamW state dicts and torch's lack it: no group skipped).
"""
from __future__ import annotations

import math

import torch

from ..config import OptimStateConfig
from ..kernels import get_format, group_layout
from ..kernels.fp8 import K_MAX_CODE
from .master import check_saved
from .moment import MOMENTS, PART_DTYPES, Fp8Moment, moment_format
from .state import REMAINDER_KEY, SKIPS_KEY

__all__ = ["merge_groups", "check_state", "is_fp32_layout", "QUANT_KEYS"]

QUANT_KEYS = tuple(k for m in MOMENTS for k in Fp8Moment.keys(m))
# torch.optim.AdamW options whose non-default value asks for an update CoatAdamW does not do.
_UNSUPPORTED = {"amsgrad": False, "maximize": False}
# The power-of-two scale 2**sexp is built from the exponent's bits: exact only in this range.
_SEXP_RANGE = (-126, 127)


def merge_groups(current: list[dict], saved: list[dict]) -> list[dict]:
    """The param groups after loading `saved`: its options (as torch does), every option it
    lacks taken from the current group, `params` and `master_weights` kept (the parameters'
    dtype is the model's; a saved master converts on load, optim/master.py). Raises before
    returning anything."""
    if len(current) != len(saved):
        raise ValueError(f"loaded state dict has {len(saved)} parameter group(s), the optimizer has {len(current)}")
    merged = []
    for i, (cur, sav) in enumerate(zip(current, saved)):
        if len(cur["params"]) != len(sav["params"]):
            raise ValueError(f"param_groups[{i}] has {len(sav['params'])} parameters in the loaded state dict, "
                             f"{len(cur['params'])} in the optimizer")
        for key, default in _UNSUPPORTED.items():
            if sav.get(key, default) != default:
                raise ValueError(f"param_groups[{i}][{key!r}] = {sav[key]!r}: CoatAdamW does not implement it")
        group = {**{k: v for k, v in cur.items() if k != "params"}, **sav, "params": cur["params"]}
        if "master_weights" in cur:
            group["master_weights"] = cur["master_weights"]
        if "param_names" in cur and "param_names" not in sav:
            group["param_names"] = cur["param_names"]
        merged.append(group)
    return merged


def is_fp32_layout(state: dict) -> bool:
    """True for torch.optim.AdamW's layout (FP32 `exp_avg`/`exp_avg_sq`), also used by
    CoatAdamW for small parameters."""
    return not any(k in state for k in QUANT_KEYS)


def _fail(pid, key, why: str):
    raise ValueError(f"state dict entry for parameter {pid}, key {key!r}: {why}")


def _check_tensor(pid, key, t, dtype, shape) -> torch.Tensor:
    if not torch.is_tensor(t):
        _fail(pid, key, f"expected a tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        _fail(pid, key, f"dtype {t.dtype}, expected {dtype}")
    if tuple(t.shape) != tuple(shape):
        _fail(pid, key, f"shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def _check_step(pid, step) -> None:
    value = step.item() if torch.is_tensor(step) and step.numel() == 1 else step
    if torch.is_tensor(value) or not isinstance(value, (int, float)) or isinstance(value, bool):
        _fail(pid, "step", f"expected a number or a one-element tensor, got {step!r}")
    if not math.isfinite(value) or value < 0 or value != int(value):
        _fail(pid, "step", f"expected a whole number >= 0, got {value!r}")


def check_state(pid, state, local: torch.Tensor, cfg: OptimStateConfig) -> None:
    """Raise ValueError naming `pid` and the key unless `state` is a CoatAdamW (or
    torch.optim.AdamW) state the step can use on a parameter whose local tensor is `local`."""
    if not isinstance(state, dict):
        _fail(pid, None, f"expected a dict, got {type(state).__name__}")
    fp32 = is_fp32_layout(state)
    expected = {"step", *(MOMENTS if fp32 else QUANT_KEYS)}
    for key in sorted(expected - state.keys()):
        _fail(pid, key, "missing")
    for key in sorted(set(state) - expected - {SKIPS_KEY, REMAINDER_KEY}, key=str):
        _fail(pid, key, "unexpected key" + (" (mixes the FP32 and FP8 layouts)" if key in MOMENTS else ""))
    _check_step(pid, state["step"])
    check_saved(pid, state, local, cfg)
    lay = group_layout(local.shape, cfg.group_size)
    if SKIPS_KEY in state:
        skips = _check_tensor(pid, SKIPS_KEY, state[SKIPS_KEY], torch.int32, lay.meta_shape)
        step = float(state["step"])
        if bool(((skips < 0) | (skips.to(torch.float64) > step)).any()):
            _fail(pid, SKIPS_KEY, f"holds counts outside [0, step = {step:g}]")
    if fp32:
        for name in MOMENTS:
            t = _check_tensor(pid, name, state[name], None, local.shape)
            if not t.is_floating_point():
                _fail(pid, name, f"dtype {t.dtype}, expected a floating dtype")
            if not bool(torch.isfinite(t).all()):
                _fail(pid, name, "holds NaN or inf")
        if bool((state["exp_avg_sq"] < 0).any()):
            _fail(pid, "exp_avg_sq", "holds negative values")
        return
    for name in MOMENTS:
        fmt = moment_format(cfg, name)
        key = dict(zip(PART_DTYPES, Fp8Moment.keys(name)))
        codes = _check_tensor(pid, key["codes"], state[key["codes"]], PART_DTYPES["codes"], local.shape)
        code_max = get_format(fmt).code_max
        if bool(((codes & 0x7F) > code_max).any()):
            _fail(pid, key["codes"], f"holds codes that are NaN or inf in {fmt} (the group's format)")
        meta = {p: _check_tensor(pid, key[p], state[key[p]], PART_DTYPES[p], lay.meta_shape)
                for p in ("center", "kcode", "sexp")}
        if not bool((torch.isfinite(meta["center"]) & (meta["center"] > 0)).all()):
            _fail(pid, key["center"], "holds values that are not finite and > 0")
        if not bool(((meta["kcode"] >= 1) & (meta["kcode"] <= K_MAX_CODE)).all()):
            _fail(pid, key["kcode"], f"holds values outside [1, {K_MAX_CODE}]")
        lo, hi = _SEXP_RANGE
        if not bool(((meta["sexp"] >= lo) & (meta["sexp"] <= hi)).all()):
            _fail(pid, key["sexp"], f"holds values outside [{lo}, {hi}]")
