"""CoatAdamW's master weights (`master_weights`): what dtype a parameter must have, the
remainder that completes a BF16 parameter's FP32 master, and its conversions on load.

* "fp32": the parameter is the FP32 master, as torch.optim.AdamW's.
* "bf16+16" / "bf16+8": the parameter is BF16 (the compute weight: no cast, FSDP2 all-gathers
  it as it is) and the state keeps `master_remainder` (int16 / int8, the parameter's local
  shape): with it the step reads and writes the FP32 master (kernels/master.py: exact with 16
  bits, 15 mantissa bits with 8).

An FP32 parameter of such a group is converted when the group is added (the optimizer is
built): its data becomes BF16 in place (the same Parameter object; a DTensor's local shard
too, so build the optimizer before FSDP2's first forward) and its remainder is seeded from
the FP32 value, so nothing is lost. A BF16 parameter starts with remainder 0: its master is
its value.

Loading a state dict converts between the forms (`loaded`, `install`): a saved remainder
into an "fp32" group makes the FP32 parameter (which must hold the saved BF16 weight, so load
the model first) the joined master; into a group with the other width, the master is split
again; a saved state without one keeps the remainder the optimizer holds (seeded from the
FP32 weights it was built on) or starts at 0.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..config import OptimStateConfig
from ..kernels import master as bits
from ..memory.tensors import local_tensor
from . import sharded
from . import state as st
from .state import REMAINDER_KEY

__all__ = ["MasterMethods", "check_param", "adopt", "complete", "remainder", "loaded", "install",
           "check_saved", "remainder_of", "saved_groups", "remainder_bytes", "master_bytes"]


def _bits(cfg: OptimStateConfig) -> int:
    return bits.MASTER_KINDS[cfg.master_weights]


def check_param(p: torch.Tensor, grad: torch.Tensor, group: int, index: int, cfg: OptimStateConfig) -> None:
    """Raise ValueError unless `p` can be stepped on `grad` under `cfg`, naming the parameter."""
    if grad.is_sparse:
        raise ValueError(f"CoatAdamW does not support sparse gradients (parameter {index} of param group {group})")
    dtype = local_tensor(p).dtype
    if _bits(cfg) and dtype != torch.bfloat16:
        raise ValueError(f"CoatAdamW(master_weights={cfg.master_weights!r}) needs bfloat16 parameters; parameter "
                         f"{index} of param group {group} is {dtype}")
    if not _bits(cfg) and dtype != torch.float32:
        # Rounding each update to 8 (BF16) or 11 (FP16) bits loses every update smaller than
        # half a unit in the last place: at lr 1e-4 almost no BF16 element ever changes.
        raise ValueError(
            f"CoatAdamW needs float32 parameters (master weights); parameter {index} of param group {group} is "
            f"{dtype}. Keep FP32 parameters and compute in BF16 (torch.autocast, DeepSpeed bf16, FSDP "
            "MixedPrecisionPolicy(param_dtype=torch.bfloat16)), or pass master_weights='bf16+16': a BF16 "
            "parameter whose exact FP32 master the optimizer completes")


def _set_local(p: torch.Tensor, local: torch.Tensor) -> None:
    """Make `local` the data of parameter `p` (a DTensor: its local shard), keeping the object."""
    if isinstance(p, DTensor):
        new = torch.nn.Parameter(_like(local, p), requires_grad=p.requires_grad)
        new.__dict__.update(p.__dict__)  # swap_tensors swaps the attributes too: keep p's
        try:
            torch.utils.swap_tensors(p, new)
        except RuntimeError as e:  # autograd (a backward ran) or another holder keeps the old tensor
            raise RuntimeError("CoatAdamW(master_weights='bf16+*') converts FP32 DTensor parameters to BF16 in place "
                               "and could not: build the optimizer right after sharding, before the first forward "
                               f"({e})") from e
    else:
        p.data = local


def adopt(params, cfg: OptimStateConfig, states) -> None:
    """Under "bf16+*" (`cfg`, the group's), convert the group's FP32 parameters to BF16 in
    place, each one's remainder seeded in `states` from its FP32 value."""
    n = _bits(cfg)
    for p in params if n else ():
        local = local_tensor(p)
        if local.dtype == torch.float32:
            with torch.no_grad():
                hi, rem = bits.split(local, n)
            _set_local(p, hi)
            states[p][REMAINDER_KEY] = rem
            if isinstance(p, DTensor):
                # FSDP2 keeps the FP32 shard's buffer as its all-gather input until its lazy init
                # (the first forward) re-reads the parameter: freed now, a model converts within
                # the memory of its FP32 shards instead of FP32 and BF16 side by side.
                local.untyped_storage().resize_(0)


def complete(param_groups: list[dict], states, config) -> None:
    """Where a group is "bf16+*" (`config(group)` -> its OptimStateConfig), give every
    parameter without one its whole state (zero moments, step 0, remainder), as its first step
    would. The seeded remainders make the state non-empty, and DCP's `get_optimizer_state_dict`
    builds a fresh optimizer's state (its load template) only for an empty one; so
    `state_dict()` completes it, and a template lists every key a checkpoint holds."""
    configs = [config(g) for g in param_groups]
    if not any(map(_bits, configs)):
        return
    for group, cfg in zip(param_groups, configs):
        for p in group["params"]:
            state, local = states[p], local_tensor(p)
            if "step" not in state:
                state.update(st.init_state(local, sharded.global_numel(p) >= cfg.min_quant_numel, cfg))
            remainder(state, local, cfg)


def remainder(state: dict, local: torch.Tensor, cfg: OptimStateConfig) -> torch.Tensor | None:
    """The remainder the step reads and writes for a parameter (created as 0 on first use),
    or None for "fp32"."""
    n = _bits(cfg)
    if not n:
        return None
    if REMAINDER_KEY not in state:
        state[REMAINDER_KEY] = torch.zeros(local.shape, dtype=bits.REMAINDER_DTYPES[n], device=local.device)
    _to_width(local, state, n)
    return state[REMAINDER_KEY]


def _like(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Local tensor `value` as `p` is: a DTensor like it for a DTensor `p`."""
    if isinstance(p, DTensor):
        return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return value


class MasterMethods:
    """CoatAdamW's public face of its master weights (`self.state`, `self.param_groups`,
    `self._validate(group)` -> (hyper-parameters, OptimStateConfig))."""

    def fp32_master(self, p: torch.Tensor) -> torch.Tensor:
        """Parameter `p`'s FP32 master: `p` itself (detached) where it is FP32, else its BF16
        value joined with its remainder (a new tensor; a DTensor like `p` for a DTensor `p`)."""
        local = local_tensor(p)
        if local.dtype == torch.float32:
            return p.detach()
        rem = self.state.get(p, {}).get(REMAINDER_KEY)
        return _like(local.detach().to(torch.float32) if rem is None else bits.join(local.detach(), rem), p)

    @torch.no_grad()
    def set_fp32_master(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """Make `value` (shaped like `p`; sharded like it for a DTensor `p`) parameter `p`'s FP32
        master: copied into an FP32 `p`, else split into `p`'s BF16 value and its remainder.
        For FP32 weights loaded after the optimizer was built (an FP32 checkpoint resumed
        with master_weights="bf16+16": the model's own load_state_dict rounds them)."""
        group = next((g for g in self.param_groups if any(q is p for q in g["params"])), None)
        if group is None:
            raise ValueError("set_fp32_master: the tensor is not a parameter of this optimizer")
        local, value = local_tensor(p), local_tensor(value).to(torch.float32)
        if value.shape != local.shape:
            raise ValueError(f"set_fp32_master: value has (local) shape {tuple(value.shape)}, the parameter "
                             f"{tuple(local.shape)}")
        n = _bits(self._validate(group)[1])
        if not n:
            local.copy_(value)
            return
        hi, rem = bits.split(value, n)
        local.copy_(hi)
        state = self.state[p]
        if REMAINDER_KEY in state and state[REMAINDER_KEY].dtype == rem.dtype:
            state[REMAINDER_KEY].copy_(rem)  # in place: a prepared step keeps its addresses
        else:
            state[REMAINDER_KEY] = rem


def check_saved(pid, entry: dict, local: torch.Tensor, cfg: OptimStateConfig) -> None:
    """Raise ValueError for a saved remainder the optimizer cannot take for this parameter."""
    rem = entry.get(REMAINDER_KEY)
    if rem is None:
        return
    where = f"state dict entry for parameter {pid}, key {REMAINDER_KEY!r}"
    rem = local_tensor(rem)
    if not torch.is_tensor(rem) or rem.dtype not in bits.REMAINDER_DTYPES.values():
        raise ValueError(f"{where}: expected an int16 or int8 tensor, got {getattr(rem, 'dtype', type(rem))}")
    if tuple(rem.shape) != tuple(local.shape):
        raise ValueError(f"{where}: shape {tuple(rem.shape)}, expected {tuple(local.shape)}")
    if local.dtype == torch.float32 and not torch.equal(local, local.to(torch.bfloat16).to(torch.float32)):
        raise ValueError(f"{where}: the FP32 parameter does not hold a BF16 value; load the model's weights (saved "
                         "in BF16 with master_weights='bf16+*') before the optimizer's state, whose remainder "
                         "completes them")
    if _bits(cfg) and local.dtype != torch.bfloat16:
        raise ValueError(f"{where}: master_weights={cfg.master_weights!r} needs a bfloat16 parameter, got "
                         f"{local.dtype}")


def loaded(entry: dict, state: dict, p: torch.Tensor, current: dict | None, local: torch.Tensor) -> None:
    """Put in `state[p]` (the loaded state) the remainder to install: the saved one in `entry`
    (converted on install), else the optimizer's `current` one, on the parameter's device."""
    rem = entry.get(REMAINDER_KEY)
    if rem is None and current:
        rem = current.get(REMAINDER_KEY)
    if rem is not None:
        state[p][REMAINDER_KEY] = local_tensor(rem).detach().to(local.device, copy=True)


def remainder_of(state: dict) -> dict:
    """The remainder entry of a parameter's state, alone (empty for an FP32 master)."""
    return {REMAINDER_KEY: state[REMAINDER_KEY]} if REMAINDER_KEY in state else {}


def install(params, states, cfg: OptimStateConfig) -> None:
    """Bring the loaded remainders of `params` (in `states`) to `cfg`'s form: joined into an
    FP32 parameter ("fp32"), or split again at `cfg`'s width (the BF16 parameter rewritten)."""
    for p in params:
        if REMAINDER_KEY in states.get(p, {}):
            _to_width(local_tensor(p), states[p], _bits(cfg))


@torch.no_grad()
def _to_width(local: torch.Tensor, state: dict, n: int) -> None:
    """The master held by `local` and the state's remainder, held again with an `n`-bit
    remainder (0: in the FP32 `local` alone)."""
    rem = state[REMAINDER_KEY]
    if local.dtype == torch.bfloat16 and rem.dtype == bits.REMAINDER_DTYPES.get(n):
        return
    value = bits.join(local.to(torch.bfloat16), rem)
    if not n:
        local.copy_(value)
        del state[REMAINDER_KEY]
        return
    hi, state[REMAINDER_KEY] = bits.split(value, n)
    local.copy_(hi)


def saved_groups(sd: dict) -> dict:
    """`sd`, a state dict being saved, without `master_weights` in its param groups: not a
    saved option (the remainders in the state say what was saved), the loading optimizer's
    own holds (the parameters' dtype is its model's), and checkpoints stay loadable by DCP
    both ways across versions."""
    for group in sd["param_groups"]:
        group.pop("master_weights", None)
    return sd


def remainder_bytes(state: dict) -> int:
    rem = state.get(REMAINDER_KEY)
    return 0 if rem is None else rem.numel() * rem.element_size()


def master_bytes(param_groups: list[dict], states) -> dict:
    """The bytes this rank holds of its master weights (parameters and remainders), in all
    and per parameter element: those of the param groups, and those that have a state but are
    not in a group now (DeepSpeed ZeRO-3 empties the groups between its steps)."""
    params = {id(p): p for group in param_groups for p in group["params"]}
    params.update((id(p), p) for p in states)
    total, numel = 0, 0
    for p in params.values():
        local = local_tensor(p)
        total += local.numel() * local.element_size() + remainder_bytes(states.get(p, {}))
        numel += local.numel()
    return {"master_bytes": total, "master_bytes_per_param": total / numel if numel else 0.0}
