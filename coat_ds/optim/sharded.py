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
saved groups takes the largest of their counts. A master remainder (`master_weights`) is
shaped and sharded like the parameter, so DCP saves and reshards it exactly.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..config import OptimStateConfig
from ..kernels import QuantizedGroups, group_layout
from ..memory.tensors import local_tensor
from .moment import MOMENTS, Fp8Moment
from .state import REMAINDER_KEY, SKIPS_KEY

__all__ = ["PER_ELEMENT", "global_numel", "mark_global_numel", "to_dtensor_state", "from_dtensor_state",
           "local_fp32_state", "wrap_like"]

_GLOBAL_NUMEL_ATTR = "_coat_global_numel"
# State keys of FP32-layout tensors shaped like the parameter (sharded like it).
PER_ELEMENT = (*MOMENTS, REMAINDER_KEY)


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


def _wrap_meta(meta: torch.Tensor, p: DTensor, layout: str, group_size: int) -> DTensor:
    """(rows, groups_per_row) per-group tensor of `p`'s local shard as a DTensor in `layout`."""
    local = local_tensor(p)
    if layout == "replicated":
        return wrap_like(meta, p, meta.shape)
    if layout == "compact":
        gpr = group_layout(local.shape, group_size).groups_per_row
        return wrap_like(meta.reshape(*local.shape[:-1], gpr), p, (*p.shape[:-1], gpr))
    return wrap_like(_expand(meta, local.shape, group_size), p)


def to_dtensor_state(state: dict, p: DTensor, cfg: OptimStateConfig) -> dict:
    """The state of DTensor parameter `p` with every shaped tensor wrapped like `p`."""
    layout = _meta_layout(p)
    out = dict(state)
    for name in MOMENTS:
        if Fp8Moment.stored_in(state, name):
            m = Fp8Moment.from_state(state, name, cfg)
            m.map(lambda codes: wrap_like(codes, p), lambda meta: _wrap_meta(meta, p, layout, cfg.group_size)
                  ).into_state(out, name)
        elif name in state:
            out[name] = wrap_like(state[name], p)
    if SKIPS_KEY in state:
        out[SKIPS_KEY] = _wrap_meta(state[SKIPS_KEY], p, layout, cfg.group_size)
    if REMAINDER_KEY in state:
        out[REMAINDER_KEY] = wrap_like(state[REMAINDER_KEY], p)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bitwise equality (float32 compared through its bits, so -0.0 and NaN are values too)."""
    if a.dtype == torch.float32:
        return a.view(torch.int32) == b.view(torch.int32)
    return a == b


def _compress(saved: Fp8Moment, name: str, cfg: OptimStateConfig) -> Fp8Moment:
    """Per-element metadata back to per-group; groups that are not uniform (they mix
    elements of different saved groups) are decoded element-wise and re-quantized."""
    codes = saved.groups.codes
    lay = group_layout(codes.shape, cfg.group_size)
    g = cfg.group_size
    flat = saved.map(lambda c: c.reshape(lay.rows, lay.cols), lambda t: t.reshape(lay.rows, lay.cols))
    first = flat.map(lambda c: codes.clone(), lambda t: t[:, ::g].contiguous())
    mixed = torch.zeros(lay.rows, lay.groups_per_row * g, dtype=torch.bool, device=codes.device)
    for head, every in zip(first.groups[1:], flat.groups[1:]):
        mixed[:, :lay.cols] |= ~_same(_expand(head, codes.shape, g).reshape(lay.rows, lay.cols), every)
    mixed_groups = mixed.reshape(lay.rows, lay.groups_per_row, g).any(-1)
    if not bool(mixed_groups.any()):
        return first
    values = Fp8Moment(flat.groups, saved.fmt, 1).to_fp32("torch").reshape(codes.shape)
    fresh = Fp8Moment.from_fp32(values, name, dataclasses.replace(cfg, backend="torch")).groups
    in_mixed = _expand(mixed_groups, codes.shape, g)
    return Fp8Moment(QuantizedGroups(torch.where(in_mixed, fresh.codes, codes),
                                     *(torch.where(mixed_groups, new, old)
                                       for new, old in zip(fresh[1:], first.groups[1:]))), saved.fmt, g)


def from_dtensor_state(saved: dict, p: DTensor, cfg: OptimStateConfig) -> dict:
    """Inverse of `to_dtensor_state`: this rank's plain local tensors, dtypes kept."""
    local = local_tensor(p)
    layout = _meta_layout(p)
    lay = group_layout(local.shape, cfg.group_size)
    state = {k: local_tensor(v) for k, v in saved.items()}
    for name in MOMENTS:
        if not Fp8Moment.stored_in(state, name):
            continue
        m = Fp8Moment.from_state(state, name, cfg)
        if m.groups.codes.shape != local.shape:
            raise ValueError(f"{name}_codes has local shape {tuple(m.groups.codes.shape)}, parameter has "
                             f"{tuple(local.shape)}")
        if layout == "per_element":
            m = _compress(m, name, cfg)
        else:
            m = m.map(lambda codes: codes, lambda meta: meta.reshape(lay.meta_shape))
        m.into_state(state, name)
    if SKIPS_KEY in state:
        state[SKIPS_KEY] = _local_skips(state[SKIPS_KEY], local, layout, cfg.group_size)
    return state


def _local_skips(skips: torch.Tensor, local: torch.Tensor, layout: str, group_size: int) -> torch.Tensor:
    """This rank's (rows, groups_per_row) skip counts from their saved layout."""
    lay = group_layout(local.shape, group_size)
    skips = local_tensor(skips)
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
    out = {k: local_tensor(v) if k in PER_ELEMENT else v for k, v in state.items()}
    if SKIPS_KEY in out and isinstance(p, DTensor):
        out[SKIPS_KEY] = _local_skips(out[SKIPS_KEY], local_tensor(p), _meta_layout(p), cfg.group_size)
    return out
