"""CoatAdamW: AdamW with FP8 moments, per-group scales and Dynamic Range Expansion."""
from __future__ import annotations

import copy
import dataclasses
import itertools
from collections import defaultdict
from itertools import compress, repeat
from operator import attrgetter, is_not
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from ..config import AdamWHyperparams, OptimStateConfig
from ..kernels import AdamWSlot
from ..memory.tensors import local_tensor as _local
from . import master, sharded
from . import state as st
from . import watch
from .loading import check_state, is_fp32_layout, merge_groups
from .group_step import GroupStep
from .in_backward import InBackward, InBackwardMethods, check_max_grad_norm
from .nonfinite import SkipCounter, first_nonfinite

__all__ = ["CoatAdamW", "nonfinite_groups"]

_CONFIG_KEYS = tuple(OptimStateConfig.__dataclass_fields__)
_OPTION_DEFAULTS = {f.name: f.default for f in dataclasses.fields(OptimStateConfig)}

_GRAD = attrgetter("grad")
# Prepared steps kept: ZeRO-3 steps each sub-group's own tensor list.
_MAX_GROUP_STEPS = 256


def _lr_value(lr):
    """`lr` as a number: a one-element tensor (torch.optim.AdamW accepts one) is read, which
    costs a sync per param group and step when it lives on a GPU."""
    if not torch.is_tensor(lr):
        return lr
    if lr.numel() != 1 or lr.is_complex():
        raise ValueError(f"lr must be a float or a one-element real tensor, got a {lr.dtype} tensor of shape "
                         f"{tuple(lr.shape)}")
    return float(lr.item())


class CoatAdamW(InBackwardMethods, master.MasterMethods, torch.optim.Optimizer):
    """AdamW whose moments are stored in FP8 with per-group DRE (about 2.13 bytes/param).

    A drop-in for `torch.optim.AdamW` (decoupled weight decay, bias correction) on float32
    parameters (BF16 ones with `master_weights`; others are refused at the first step). Every
    option below may also be set per param group. The step is one fused Triton launch per
    (dtype, step) bucket of a param group on CUDA, a fused C++ kernel on host tensors (CPU
    training, ZeRO-Offload; coat_ds/kernels/host.py, built on first use, off with
    COAT_DS_HOST_KERNEL_DISABLE=1), and the pure-torch reference, computing the same, elsewhere.

    Args:
        lr, betas, eps, weight_decay: as `torch.optim.AdamW` (`lr` may be a one-element tensor).
        first_moment_format, second_moment_format: "e4m3" (default) or "e5m2".
        group_size: elements per quantization group (power of two, default 128).
        dynamic_range_expansion: apply DRE before quantizing (default True).
        min_quant_numel: parameters with fewer elements (counted on the whole, unsharded
            tensor) keep FP32 moments (default 4096).
        nonfinite: "skip": a group (`group_size` elements) whose gradient or new moments are
            not finite keeps its parameter and moments unchanged, is counted in
            `nonfinite_groups()` and reported by a rate-limited RuntimeWarning. "raise":
            checks the gradients first (host syncs) and raises FloatingPointError before
            anything changes.
        backend: "auto" (Triton on CUDA, else as "torch"), "triton" or "torch" (host: C++).
        master_weights: "fp32" (the parameter is the master), "bf16+16" (BF16 parameter + 16-bit
            remainder: the exact FP32 master) or "bf16+8" (+ 8 bits: 15 mantissa bits); FP32
            parameters of such a group become BF16 in place, nothing lost (optim/master.py).
        step_in_backward: step each parameter during backward, as soon as its gradient is
            complete, and free that gradient (optim/in_backward.py; docs/optimizer.md).
            `step()` then closes the step; `accumulating()` holds the step back for
            gradient accumulation. One process, FSDP2, or DDP through `register_ddp`.
        max_grad_norm: with step_in_backward, clip to this global norm as clip_grad_norm_
            before step() would: backward frees each FP32 gradient and keeps a BF16 copy,
            and step() applies the update, scaled by the exact coefficient; None: no
            clipping (the update runs in backward).
    """

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, first_moment_format: str = "e4m3",
                 second_moment_format: str = "e4m3", group_size: int = 128,
                 dynamic_range_expansion: bool = True, min_quant_numel: int = 4096,
                 nonfinite: str = "skip", backend: str = "auto", master_weights: str = "fp32",
                 step_in_backward: bool = False, max_grad_norm: float | None = None):
        if not isinstance(step_in_backward, bool):
            raise ValueError(f"step_in_backward must be True or False, got {step_in_backward!r}")
        max_grad_norm = check_max_grad_norm(max_grad_norm, step_in_backward)
        self._in_backward = InBackward(self, max_grad_norm) if step_in_backward else None
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        first_moment_format=first_moment_format, second_moment_format=second_moment_format,
                        group_size=group_size, dynamic_range_expansion=dynamic_range_expansion,
                        min_quant_numel=min_quant_numel, nonfinite=nonfinite, backend=backend,
                        master_weights=master_weights)
        self._validate(defaults)
        super().__init__(params, defaults)
        self._skips = SkipCounter()
        self._global_norm: Callable[[], torch.Tensor | None] | None = None
        self._drop_caches()
        watch.note_built(CoatAdamW)

    def __setstate__(self, state: dict) -> None:
        # Runs after deepcopy/pickle, which keep only defaults, state and param groups (an
        # optimizer pickled before an option existed gets its default), and on every load.
        super().__setstate__(state)
        for key, value in _OPTION_DEFAULTS.items():
            self.defaults.setdefault(key, value)
            for group in self.param_groups:
                group.setdefault(key, value)
        if not hasattr(self, "_skips"):
            self._skips = SkipCounter()
        if not hasattr(self, "_global_norm"):  # a copy does not keep its engine's norm
            self._global_norm = None
        if not hasattr(self, "_in_backward"):  # a copy: hooks stay with the optimizer they were made for
            self._in_backward = None
        self._drop_caches()

    def _drop_caches(self) -> None:
        # Kernel address tables and prepared steps of tensors that may have been replaced.
        self._plan_cache: dict = {}
        self._group_steps: dict[tuple[int, ...], GroupStep] = {}

    @staticmethod
    def _validate(group: dict) -> tuple[AdamWHyperparams, OptimStateConfig]:
        hp = AdamWHyperparams(_lr_value(group["lr"]), group["betas"], group["eps"], group["weight_decay"])
        return hp, OptimStateConfig(**{k: group[k] for k in _CONFIG_KEYS})

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _, cfg = self._validate(group)
        group["first_moment_format"], group["second_moment_format"] = cfg.first_moment_format, cfg.second_moment_format
        master.adopt(group["params"], cfg, self.state)
        if self._in_backward is not None:
            self._in_backward.watch(len(self.param_groups) - 1, group["params"])

    # -- the step -------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter with a gradient. With step_in_backward most
        parameters were stepped during backward; this steps any gradient still present and
        closes the step (clipping coefficient, side streams, skip report)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._in_backward is None:
            self._step_work(self._work_with_grads(), grad_scale=self._whole_step_gate())
        else:
            self._in_backward.close_step()
        self._skips.after_step()
        return loss

    @property
    def skips_steps_by_global_norm(self) -> bool:  # whether skip_steps_by_global_norm set a norm
        return self._global_norm is not None

    def skip_steps_by_global_norm(self, global_norm: Callable[[], torch.Tensor | None] | None) -> None:
        """Skip whole steps whose global gradient norm is not finite, on the device. Each
        `step()` first calls `global_norm()`: this step's gradient norm over every rank (a
        tensor on the gradients' device, the same on every rank; None: not known this step).
        Where it is NaN or inf, every group of every parameter is left unchanged and counted
        as skipped (`nonfinite_groups()`), as when its own gradient is not finite, so that no
        rank steps on what it holds of a gradient that overflowed elsewhere. The host never
        waits for the answer. `coat_ds.deepspeed_initialize` sets this, with the norm
        DeepSpeed computes for clipping, in place of DeepSpeed's own overflow check under
        ZeRO-1/2 (docs/deepspeed.md); None turns it off."""
        if global_norm is not None and not callable(global_norm):
            raise TypeError(f"global_norm must be a callable or None, got {type(global_norm).__name__}")
        if global_norm is not None and self._in_backward is not None:
            raise ValueError("skip_steps_by_global_norm: a step_in_backward optimizer steps before the global norm "
                             "is known; pass max_grad_norm to CoatAdamW instead")
        self._global_norm = global_norm

    def _whole_step_gate(self) -> torch.Tensor | None:
        """The gradient scale that skips this whole step where the global norm is not finite
        (NaN makes every group non-finite, so the kernels skip and count each), else 1."""
        norm = None if self._global_norm is None else self._global_norm()
        if norm is None:
            return None
        norm = torch.as_tensor(norm, dtype=torch.float32).reshape(())
        return torch.where(torch.isfinite(norm), 1.0, float("nan")).to(torch.float32)

    # -- the contract of the step-in-backward driver (InBackward): these two, param_groups --

    def _work_with_grads(self) -> list[tuple[int, list[torch.Tensor]]]:
        """The parameters holding a gradient: (param group index, its parameters) pairs."""
        work = []
        for gi, group in enumerate(self.param_groups):
            params = group["params"]
            present = list(map(is_not, map(_GRAD, params), repeat(None)))
            if not all(present):
                params = list(compress(params, present))
            if params:
                work.append((gi, params))
        return work

    def _step_work(self, work, grads=None, grad_scale: torch.Tensor | None = None) -> None:
        """Step `work`, (param group index, parameters) pairs, on `grads`, one list of
        gradients per pair (None: their .grad), each multiplied by `grad_scale` where given;
        whatever refuses the step (a sparse or non-float32 parameter, a non-finite gradient
        under nonfinite="raise") raises before any group changes."""
        checked, raising = [], []
        for k, (gi, params) in enumerate(work):
            group = self.param_groups[gi]
            hp, cfg = self._validate(group)
            group_grads = list(map(_GRAD, params)) if grads is None else grads[k]
            prepared = self._group_steps.get(tuple(map(id, params)))
            taken = prepared.check(self.state, group_grads) if prepared is not None and prepared.cfg == cfg else None
            if taken is None:
                for i, (p, g) in enumerate(zip(params, group_grads)):
                    master.check_param(p, g, gi, i, cfg)
                prepared = None
            checked.append((hp, cfg, params, group_grads, prepared, taken))
            if cfg.nonfinite == "raise":
                raising.extend((gi, p) for p in params)
        if raising:
            bad = first_nonfinite([_local(p.grad) for _, p in raising])
            if bad is not None:
                gi, p = raising[bad]
                index = next(i for i, q in enumerate(self.param_groups[gi]["params"]) if q is p)
                raise FloatingPointError(
                    f"CoatAdamW: parameter {index} of param group {gi} has a non-finite gradient (or one whose "
                    "square overflows float32); nothing was updated")
            skipped_before = self._skips.total()
        for hp, cfg, params, group_grads, prepared, taken in checked:
            if prepared is None:
                prepared, taken = self._prepare(params, group_grads, cfg)
            prepared.run(taken, hp, self._skips, grad_scale)
        if raising and self._skips.total() > skipped_before:
            raise FloatingPointError(
                f"CoatAdamW: {self._skips.total() - skipped_before} group(s) had moments that overflowed "
                "float32; their parameters and moments were left unchanged")

    def _prepare(self, params: list[torch.Tensor], grads: list[torch.Tensor],
                 cfg: OptimStateConfig) -> tuple[GroupStep, tuple]:
        """A new GroupStep for `params` (creating state on first use), and what its run takes
        for their gradients `grads`."""
        states, slots = [], []
        for p, g in zip(params, grads):
            local = _local(p)
            state = self.state[p]
            if "step" not in state:  # a remainder may be there since the group was added
                state.update(st.init_state(local, sharded.global_numel(p) >= cfg.min_quant_numel, cfg))
            if st.SKIPS_KEY not in state:  # state set by hand or by an older version
                state[st.SKIPS_KEY] = st.zero_skips(local, cfg.group_size)
            grad = _local(g)
            states.append(state)
            slots.append(AdamWSlot(local, grad if grad.is_contiguous() else grad.contiguous(),
                                   *st.kernel_moments(state, cfg), state[st.SKIPS_KEY],
                                   master.remainder(state, local, cfg)))
        prepared = GroupStep(params, states, slots, cfg, self._plan_cache)
        if len(self._group_steps) >= _MAX_GROUP_STEPS:
            self._group_steps.pop(next(iter(self._group_steps)))
        self._group_steps[tuple(map(id, params))] = prepared
        taken = prepared.take([s.grad for s in slots])
        if taken is None:
            raise RuntimeError("CoatAdamW: a step prepared from these gradients refused them")
        return prepared, taken

    def nonfinite_groups(self) -> int:
        """Groups skipped so far for non-finite gradients or moments (reads the device)."""
        return self._skips.total()

    # -- memory report --------------------------------------------------------------------

    def state_bytes(self) -> dict:
        """Exact bytes of this rank's moment state, per element it covers, and of its masters."""
        total, numel, fp8_numel = 0, 0, 0
        for p, state in self.state.items():
            if "step" not in state:
                continue
            n = _local(p).numel()
            total += st.state_bytes(state) - master.remainder_bytes(state)
            numel += n
            fp8_numel += n if st.is_quantized(state) else 0
        return {"state_bytes": total, "numel": numel, "fp8_numel": fp8_numel,
                "bytes_per_param": total / numel if numel else 0.0, "fp32_adamw_bytes": 8 * numel,
                **master.master_bytes(self.param_groups, self.state)}

    # -- checkpoints ----------------------------------------------------------------------

    def _config_of(self) -> dict[int, OptimStateConfig]:
        return {id(p): self._validate(g)[1] for g in self.param_groups for p in g["params"]}

    def _by_saved_id(self, saved_groups: list[dict]) -> list[tuple[int, torch.Tensor]]:
        """(id in a state dict, parameter) pairs: ids number the parameters in group order,
        as torch's state_dict / load_state_dict do."""
        ids = itertools.chain.from_iterable(g["params"] for g in saved_groups)
        return list(zip(ids, itertools.chain.from_iterable(g["params"] for g in self.param_groups)))

    def state_dict(self) -> dict:
        """As torch's; for DTensor (FSDP2) parameters every shaped state tensor is a DTensor
        on the parameter's mesh (views of the live state, see `optim/sharded.py`), so
        `torch.distributed.checkpoint` saves each rank's shard and can reshard on load."""
        master.complete(self.param_groups, self.state, lambda g: self._validate(g)[1])
        sd = master.saved_groups(super().state_dict())
        cfg_of = self._config_of()
        for pid, p in self._by_saved_id(sd["param_groups"]):
            if isinstance(p, DTensor) and pid in sd["state"]:
                sd["state"][pid] = sharded.to_dtensor_state(sd["state"][pid], p, cfg_of[id(p)])
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's (load hooks included), but state tensors keep their dtypes (FP8 codes
        stay uint8, metadata and FP32 moments stay float32) and only move to the parameter's
        device. Accepts torch.optim.AdamW state dicts (their moments are quantized) and older
        CoatAdamW ones (options they lack keep the optimizer's current values). Everything
        is checked first: a bad state dict raises ValueError naming the parameter and key,
        and the optimizer is left as it was. DTensor state (from `state_dict()` of a sharded
        optimizer, possibly resharded by DCP) is taken as this rank's local shard."""
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._install(*self._loaded(state_dict, fp32_only=False))
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _install(self, groups: list[dict], state: dict) -> None:
        self.__setstate__({"state": state, "param_groups": groups})
        for group in groups:
            master.install(group["params"], self.state, self._validate(group)[1])

    def _loaded(self, state_dict: dict, fp32_only: bool) -> tuple[list[dict], dict]:
        """(param groups, state) that loading `state_dict` gives, built without touching self."""
        groups = merge_groups(self.param_groups, copy.deepcopy(state_dict["param_groups"]))
        cfg_of = {}
        for i, group in enumerate(groups):
            try:
                _, cfg = self._validate(group)
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"param_groups[{i}] of the loaded state dict: {e}") from e
            cfg_of.update((id(p), cfg) for p in group["params"])
        id_map = dict(self._by_saved_id(state_dict["param_groups"]))
        saved = state_dict["state"]
        for pid in saved:
            if pid not in id_map:
                raise ValueError(f"state dict entry for parameter {pid!r} belongs to no param group")
        state: defaultdict = defaultdict(dict)
        for pid, p in id_map.items():
            entry = saved.get(pid)
            cfg, local = cfg_of[id(p)], _local(p)
            if not entry:
                master.loaded({}, state, p, self.state.get(p), local)
                continue
            if not isinstance(entry, dict):
                raise ValueError(f"state dict entry for parameter {pid}: expected a dict, got {type(entry).__name__}")
            if is_fp32_layout(entry):
                entry = sharded.local_fp32_state(entry, p, cfg)
            elif fp32_only:
                raise ValueError(f"state dict entry for parameter {pid} holds FP8 state: use load_state_dict")
            elif isinstance(p, DTensor):
                try:
                    entry = sharded.from_dtensor_state(entry, p, cfg)
                except (RuntimeError, KeyError) as e:
                    raise ValueError(f"state dict entry for parameter {pid}: {e}") from e
            check_state(pid, entry, local, cfg)
            if is_fp32_layout(entry):
                state[p] = st.from_fp32(entry, local, sharded.global_numel(p) >= cfg.min_quant_numel, cfg)
            else:
                state[p] = {k: (torch.as_tensor(v, dtype=torch.float32).detach().clone().cpu() if k == "step"
                                else v.detach().to(local.device, copy=True)) for k, v in entry.items()}
                # A state dict saved before groups counted their skips: none skipped.
                state[p].setdefault(st.SKIPS_KEY, st.zero_skips(local, cfg.group_size))
            master.loaded(entry, state, p, self.state.get(p), local)
        return groups, state

    def fp32_state_dict(self) -> dict:
        """This optimizer's state in torch.optim.AdamW's layout (FP32 exp_avg/exp_avg_sq, each
        group's skipped steps folded into its moments, see `state.to_fp32`); DTensors like
        the parameter for DTensor parameters."""
        sd = master.saved_groups(super().state_dict())
        pairs = self._by_saved_id(sd["param_groups"])
        cfg_of = self._config_of()
        betas_of = {id(p): tuple(g["betas"]) for g in self.param_groups for p in g["params"]}
        sd["state"] = {pid: {**st.to_fp32(state, cfg_of[id(p)], betas_of[id(p)]), **master.remainder_of(state)}
                       for pid, p in pairs if "step" in (state := self.state.get(p, {}))}
        for pid, p in pairs:
            if isinstance(p, DTensor) and pid in sd["state"]:
                sd["state"][pid] = {k: sharded.wrap_like(v, p) if k in sharded.PER_ELEMENT else v
                                    for k, v in sd["state"][pid].items()}
        return sd

    def load_fp32_state_dict(self, state_dict: dict) -> None:
        """Load a torch.optim.AdamW-layout state dict (e.g. from `fp32_state_dict` or from
        torch.optim.AdamW itself), quantizing its moments, with `load_state_dict`'s checks.
        DTensor moments (of a sharded optimizer) give this rank's local shard."""
        self._install(*self._loaded(state_dict, fp32_only=True))


def nonfinite_groups(optimizer: torch.optim.Optimizer) -> int:
    """Groups `optimizer` has skipped for non-finite values so far on this rank: 0 unless it
    is a CoatAdamW (reads the device)."""
    return optimizer.nonfinite_groups() if isinstance(optimizer, CoatAdamW) else 0
