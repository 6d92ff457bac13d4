"""CoatAdamW state of DTensor (FSDP2) parameters as DTensors, so DCP can save and reshard it.

In memory every state tensor is the rank's local piece (plain tensors, the step needs no
collective). Only `state_dict()` wraps them, without copying, as DTensors on the parameter's
mesh, and `load_state_dict()` unwraps them. Two layouts of the per-group metadata:

* compact: groups run along the last dim and never cross a row, so when no placement
  shards the last dim (FSDP2's Shard(0) of a >= 2-D weight) the metadata of a
  (..., cols) parameter is a (..., groups_per_row) tensor that shards on the same dims as
  the parameter: every rank's rows carry exactly their own groups. Bit-exact on any number
  of ranks, and the checkpoint costs what the memory does.
* per element: a sharded 1-D parameter (or one sharded along its last dim) starts its local
  groups at the shard's offset, which depends on the number of ranks, so no per-group
  tensor tiles the shards. There the checkpoint repeats each group's metadata on every
  element of the group (shaped like the parameter; about 6 extra bytes per element of such
  parameters, which are norm weights and biases, a tiny share of a model). Loading on the
  same sharding finds every group uniform and restores it bit-exactly; a group that now
  mixes elements of two saved groups (different number of ranks) is decoded element by
  element and quantized again, an error of one FP8 rounding on that group only.

`group_skips` (steps each group skipped) is metadata like the others; a group that mixes
saved groups takes the largest of their counts.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..config import OptimStateConfig
from ..kernels import QuantizedGroups, get_ops, group_layout
from .state import MOMENTS, SKIPS_KEY

__all__ = ["global_numel", "mark_global_numel", "to_dtensor_state", "from_dtensor_state", "local_fp32_state",
           "wrap_like"]

_META = ("center", "kcode", "sexp")
_GLOBAL_NUMEL_ATTR = "_coat_global_numel"


def global_numel(p: torch.Tensor) -> int:
    """Elements of the whole (unsharded) parameter, used for the FP32-or-FP8 decision so
    the precision does not depend on the number of ranks."""
    if isinstance(p, DTensor):
        return p.numel()
    marked = getattr(p, _GLOBAL_NUMEL_ATTR, None)
    if marked is not None:
        return marked
    unsharded = getattr(p, "_unpadded_unsharded_size", None)  # FSDP1 FlatParameter
    return unsharded.numel() if unsharded is not None else p.numel()


def mark_global_numel(p: torch.Tensor, numel: int) -> None:
    """Record the unsharded size of a parameter whose tensor is a shard of it (FSDP1
    use_orig_params=True exposes flat 1-D views of each rank's share)."""
    setattr(p, _GLOBAL_NUMEL_ATTR, int(numel))


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def wrap_like(local: torch.Tensor, p: DTensor, shape: tuple[int, ...] | None = None) -> DTensor:
    """`local` as a DTensor with `p`'s mesh and placements (no copy, no communication)."""
    shape = tuple(p.shape) if shape is None else tuple(shape)
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_stride(shape))


def _meta_layout(p: DTensor) -> str:
    """"replicated", "compact" or "per_element"; see the module docstring."""
    if all(isinstance(pl, Replicate) for pl in p.placements):
        return "replicated"
    if p.ndim >= 2 and all(isinstance(pl, Replicate) or (type(pl) is Shard and pl.dim < p.ndim - 1)
                           for pl in p.placements):
        return "compact"
    return "per_element"


def _expand(meta: torch.Tensor, local_shape: torch.Size, group_size: int) -> torch.Tensor:
    """(rows, groups_per_row) metadata repeated onto each element of its group."""
    lay = group_layout(local_shape, group_size)
    return meta.repeat_interleave(group_size, dim=1)[:, :lay.cols].reshape(local_shape)


def to_dtensor_state(state: dict, p: DTensor, cfg: OptimStateConfig) -> dict:
    """The state of DTensor parameter `p` with every shaped tensor wrapped like `p`."""
    local = p._local_tensor
    layout = _meta_layout(p)
    lay = group_layout(local.shape, cfg.group_size)
    out = {}
    for key, value in state.items():
        part = key.rsplit("_", 1)[-1]
        if key == "step" or not torch.is_tensor(value):
            out[key] = value
        elif part not in _META and key != SKIPS_KEY:  # FP8 codes or FP32 moments: shaped like the parameter
            out[key] = wrap_like(value, p)
        elif layout == "replicated":
            out[key] = wrap_like(value, p, value.shape)
        elif layout == "compact":
            gpr = lay.groups_per_row
            out[key] = wrap_like(value.reshape(*local.shape[:-1], gpr), p, (*p.shape[:-1], gpr))
        else:
            out[key] = wrap_like(_expand(value, local.shape, cfg.group_size), p)
    return out


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bitwise equality (float32 compared through its bits, so -0.0 and NaN are values too)."""
    if a.dtype == torch.float32:
        return a.view(torch.int32) == b.view(torch.int32)
    return a == b


def _compress(codes: torch.Tensor, meta: dict[str, torch.Tensor], cfg: OptimStateConfig, fmt: str) -> dict:
    """Per-element metadata back to per-group; groups that are not uniform (they mix
    elements of different saved groups) are decoded element-wise and re-quantized."""
    lay = group_layout(codes.shape, cfg.group_size)
    g = cfg.group_size
    flat = {k: v.reshape(lay.rows, lay.cols) for k, v in meta.items()}
    first = {k: v[:, ::g].contiguous() for k, v in flat.items()}
    mixed = torch.zeros(lay.rows, lay.groups_per_row * g, dtype=torch.bool, device=codes.device)
    for k, v in flat.items():
        mixed[:, :lay.cols] |= ~_same(_expand(first[k], codes.shape, g).reshape(lay.rows, lay.cols), v)
    mixed_groups = mixed.reshape(lay.rows, lay.groups_per_row, g).any(-1)
    out = {"codes": codes.clone(), **first}
    if not bool(mixed_groups.any()):
        return out
    ops = get_ops(codes.device, "torch")
    per_element = QuantizedGroups(codes.reshape(lay.rows, lay.cols), flat["center"], flat["kcode"], flat["sexp"])
    values = ops.dequantize_groups(per_element, 1, fmt).reshape(codes.shape)
    fresh = ops.quantize_groups(values, g, fmt, cfg.dynamic_range_expansion)
    in_mixed = _expand(mixed_groups, codes.shape, g)
    out["codes"] = torch.where(in_mixed, fresh.codes, codes)
    for k in _META:
        out[k] = torch.where(mixed_groups, getattr(fresh, k), first[k])
    return out


def from_dtensor_state(saved: dict, p: DTensor, cfg: OptimStateConfig) -> dict:
    """Inverse of `to_dtensor_state`: this rank's plain local tensors, dtypes kept."""
    local = p._local_tensor
    layout = _meta_layout(p)
    lay = group_layout(local.shape, cfg.group_size)
    state = {k: _local(v) for k, v in saved.items()}
    formats = {"exp_avg": cfg.first_moment_format, "exp_avg_sq": cfg.second_moment_format}
    for name in MOMENTS:
        if f"{name}_codes" not in state:
            continue
        codes = state[f"{name}_codes"]
        meta = {k: state[f"{name}_{k}"] for k in _META}
        if codes.shape != local.shape:
            raise ValueError(f"{name}_codes has local shape {tuple(codes.shape)}, parameter has {tuple(local.shape)}")
        if layout == "per_element":
            meta = _compress(codes, meta, cfg, formats[name])
            state[f"{name}_codes"] = meta.pop("codes")
        else:
            meta = {k: v.reshape(lay.meta_shape) for k, v in meta.items()}
        state.update({f"{name}_{k}": v for k, v in meta.items()})
    if SKIPS_KEY in state:
        state[SKIPS_KEY] = _local_skips(state[SKIPS_KEY], local, layout, cfg.group_size)
    return state


def _local_skips(skips: torch.Tensor, local: torch.Tensor, layout: str, group_size: int) -> torch.Tensor:
    """This rank's (rows, groups_per_row) skip counts from their saved layout."""
    lay = group_layout(local.shape, group_size)
    skips = _local(skips)
    if layout != "per_element":
        return skips.reshape(lay.meta_shape)
    if skips.shape != local.shape:
        raise ValueError(f"{SKIPS_KEY} has local shape {tuple(skips.shape)}, parameter has {tuple(local.shape)}")
    flat = skips.reshape(lay.rows, lay.cols)
    pad = lay.groups_per_row * group_size - lay.cols
    if pad:
        flat = torch.cat([flat, flat.new_zeros(lay.rows, pad)], dim=1)
    return flat.reshape(lay.rows, lay.groups_per_row, group_size).amax(-1)


def local_fp32_state(state: dict, p: torch.Tensor | None = None, cfg: OptimStateConfig | None = None) -> dict:
    """An FP32 (torch.optim.AdamW-layout) state's moments (and `group_skips`, given the
    DTensor parameter `p` and its config) as this rank's local tensors."""
    out = {k: _local(v) if k in MOMENTS else v for k, v in state.items()}
    if SKIPS_KEY in out and isinstance(p, DTensor):
        out[SKIPS_KEY] = _local_skips(out[SKIPS_KEY], p._local_tensor, _meta_layout(p), cfg.group_size)
    return out
