"""CoatAdamW: AdamW with FP8 moments, per-group scales and Dynamic Range Expansion."""
from __future__ import annotations

import itertools
from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor

from ..config import AdamWHyperparams, OptimStateConfig
from ..kernels import AdamWHyper, AdamWSlot, get_ops
from . import sharded
from . import state as st
from . import watch

__all__ = ["CoatAdamW"]

_CONFIG_KEYS = tuple(OptimStateConfig.__dataclass_fields__)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank owns: a DTensor's local shard, else `t` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


class CoatAdamW(torch.optim.Optimizer):
    """AdamW whose moments are stored in FP8 with per-group DRE (about 2.09 bytes/param).

    A drop-in for `torch.optim.AdamW` (decoupled weight decay, bias correction). Every
    option below may also be set per param group. On CUDA the step is one fused Triton
    launch per (dtype, step) bucket of a param group; elsewhere the pure-torch reference.

    Args:
        lr, betas, eps, weight_decay: as `torch.optim.AdamW`.
        first_moment_format, second_moment_format: "e4m3" (default) or "e5m2".
        group_size: elements per quantization group (power of two, default 128).
        dynamic_range_expansion: apply DRE before quantizing (default True).
        min_quant_numel: parameters with fewer elements (counted on the whole, unsharded
            tensor) keep FP32 moments (default 4096).
        nonfinite: a group (`group_size` elements) whose gradient or new moments are not
            finite keeps its parameter and moments unchanged and is counted in
            `nonfinite_groups()`; "raise" also raises after the step (this synchronises).
        backend: "auto", "triton" or "torch".
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, first_moment_format: str = "e4m3",
                 second_moment_format: str = "e4m3", group_size: int = 128,
                 dynamic_range_expansion: bool = True, min_quant_numel: int = 4096,
                 nonfinite: str = "skip", backend: str = "auto"):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        first_moment_format=first_moment_format, second_moment_format=second_moment_format,
                        group_size=group_size, dynamic_range_expansion=dynamic_range_expansion,
                        min_quant_numel=min_quant_numel, nonfinite=nonfinite, backend=backend)
        self._validate(defaults)
        super().__init__(params, defaults)
        self._plan_cache: dict = {}
        self._entries: dict = {}
        self._skipped: dict[torch.device, torch.Tensor] = {}
        watch.note_built()

    @staticmethod
    def _validate(group: dict) -> tuple[AdamWHyperparams, OptimStateConfig]:
        hp = AdamWHyperparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        return hp, OptimStateConfig(**{k: group[k] for k in _CONFIG_KEYS})

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _, cfg = self._validate(group)
        group["first_moment_format"] = cfg.first_moment_format
        group["second_moment_format"] = cfg.second_moment_format

    # -- the step -------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            hp, cfg = self._validate(group)
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            entries = [self._entry(p, cfg) for p in params]
            # One call for every counter and one read back: per-parameter tensor ops and
            # .item() calls cost more host time than the GPU step of a 1B model takes.
            steps = [self.state[p]["step"] for p in params]
            torch._foreach_add_(steps, 1)
            step_values = torch.stack(steps).tolist()
            buckets: dict[tuple, list[AdamWSlot]] = defaultdict(list)
            for p, (local, m, v, quant), step in zip(params, entries, step_values):
                grad = _local(p.grad)
                if grad.is_sparse:
                    raise ValueError("CoatAdamW does not support sparse gradients")
                if not grad.is_contiguous():
                    grad = grad.contiguous()
                buckets[(quant, int(step), local.device, local.dtype, grad.dtype)].append(
                    AdamWSlot(local, grad, m, v))
            for (quant, step, device, *_), slots in buckets.items():
                hyper = AdamWHyper.at_step(step, hp.lr, *hp.betas, hp.eps, hp.weight_decay)
                get_ops(device, cfg.backend).adamw_step(
                    slots, hyper, group_size=cfg.group_size, fmt_m=cfg.first_moment_format,
                    fmt_v=cfg.second_moment_format, dre=cfg.dynamic_range_expansion,
                    skipped=self._skip_counter(device), plan_cache=self._plan_cache)
            if cfg.nonfinite == "raise" and self.nonfinite_groups():
                raise FloatingPointError(
                    f"CoatAdamW: {self.nonfinite_groups()} group(s) had non-finite gradients or moments; "
                    "their parameters and moments were left unchanged")
        return loss

    def _entry(self, p: torch.Tensor, cfg: OptimStateConfig) -> tuple:
        """(local tensor, exp_avg, exp_avg_sq, quantized?) of `p`, creating its state on first
        use. Cached while the state's tensors and the local shard stay the same objects."""
        local = _local(p)
        state = self.state[p]
        cached = self._entries.get(p)
        if cached is not None:
            if cached[0] is local and state.get(cached[4]) is cached[5]:
                return cached[:4]
            # The state or shard was replaced behind our back: cached kernel address
            # tables may point at the old tensors.
            self._plan_cache.clear()
        if p.grad is not None and p.grad.is_sparse:
            raise ValueError("CoatAdamW does not support sparse gradients")
        if local.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"CoatAdamW needs float32/bfloat16/float16 parameters, got {local.dtype}")
        if not state:
            state.update(st.init_state(local, sharded.global_numel(p) >= cfg.min_quant_numel, cfg))
        quant = st.is_quantized(state)
        anchor = "exp_avg_codes" if quant else "exp_avg"
        entry = (local, st.moment(state, "exp_avg"), st.moment(state, "exp_avg_sq"), quant, anchor, state[anchor])
        self._entries[p] = entry
        return entry[:4]

    def _skip_counter(self, device: torch.device) -> torch.Tensor:
        if device not in self._skipped:
            self._skipped[device] = torch.zeros((), dtype=torch.int64, device=device)
        return self._skipped[device]

    def nonfinite_groups(self) -> int:
        """Groups skipped so far for non-finite gradients or moments (reads the device)."""
        return int(sum(int(c.item()) for c in self._skipped.values()))

    # -- memory report --------------------------------------------------------------------

    def state_bytes(self) -> dict:
        """Exact bytes of this rank's moment state, and per parameter element it covers."""
        total, numel, fp8_numel = 0, 0, 0
        for p, state in self.state.items():
            if not state:
                continue
            n = _local(p).numel()
            total += st.state_bytes(state)
            numel += n
            fp8_numel += n if st.is_quantized(state) else 0
        return {"state_bytes": total, "numel": numel, "fp8_numel": fp8_numel,
                "bytes_per_param": total / numel if numel else 0.0,
                "fp32_adamw_bytes": 8 * numel}

    # -- checkpoints ----------------------------------------------------------------------

    def _config_of(self) -> dict[int, OptimStateConfig]:
        return {id(p): self._validate(g)[1] for g in self.param_groups for p in g["params"]}

    def _by_saved_id(self, saved_groups: list[dict]) -> list[tuple[int, torch.Tensor]]:
        """(id in a state dict, parameter) pairs: ids number the parameters in group order,
        as torch's state_dict / load_state_dict do."""
        ids = itertools.chain.from_iterable(g["params"] for g in saved_groups)
        return list(zip(ids, itertools.chain.from_iterable(g["params"] for g in self.param_groups)))

    def _forget_cached(self) -> None:
        # Kernel address tables and cached state views point at the replaced tensors.
        self._plan_cache.clear()
        self._entries.clear()

    def state_dict(self) -> dict:
        """As torch's; for DTensor (FSDP2) parameters every shaped state tensor is a DTensor
        on the parameter's mesh (views of the live state, see `optim/sharded.py`), so
        `torch.distributed.checkpoint` saves each rank's shard and can reshard on load."""
        sd = super().state_dict()
        cfg_of = self._config_of()
        for pid, p in self._by_saved_id(sd["param_groups"]):
            if isinstance(p, DTensor) and pid in sd["state"]:
                sd["state"][pid] = sharded.to_dtensor_state(sd["state"][pid], p, cfg_of[id(p)])
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but state tensors keep their dtypes (FP8 codes stay uint8, metadata
        and FP32 moments stay float32) and only move to the parameter's device. DTensor
        state (from `state_dict()` of a sharded optimizer, possibly resharded by DCP) is
        taken as this rank's local shard."""
        saved = state_dict["state"]
        super().load_state_dict({**state_dict, "state": {}})
        cfg_of = self._config_of()
        for pid, p in self._by_saved_id(state_dict["param_groups"]):
            if pid not in saved:
                continue
            entry = saved[pid]
            if isinstance(p, DTensor):
                entry = sharded.from_dtensor_state(entry, p, cfg_of[id(p)])
            device = _local(p).device
            self.state[p] = {k: (v.detach().clone().cpu() if k == "step" else v.detach().to(device, copy=True))
                             if torch.is_tensor(v) else v for k, v in entry.items()}
        self._forget_cached()

    def fp32_state_dict(self) -> dict:
        """This optimizer's state in torch.optim.AdamW's layout (FP32 exp_avg/exp_avg_sq);
        DTensors like the parameter for DTensor parameters."""
        sd = super().state_dict()
        pairs = self._by_saved_id(sd["param_groups"])
        cfg_of = self._config_of()
        sd["state"] = {pid: st.to_fp32(self.state[p], cfg_of[id(p)]) for pid, p in pairs if self.state.get(p)}
        for pid, p in pairs:
            if isinstance(p, DTensor) and pid in sd["state"]:
                sd["state"][pid] = {k: sharded.wrap_like(v, p) if k in st.MOMENTS else v
                                    for k, v in sd["state"][pid].items()}
        return sd

    def load_fp32_state_dict(self, state_dict: dict) -> None:
        """Load a torch.optim.AdamW-layout state dict (e.g. from `fp32_state_dict` or from
        torch.optim.AdamW itself), quantizing its moments. DTensor moments (of a sharded
        optimizer) give this rank's local shard."""
        super().load_state_dict({**state_dict, "state": {}})
        cfg_of = self._config_of()
        for pid, p in self._by_saved_id(state_dict["param_groups"]):
            if pid in state_dict["state"]:
                cfg = cfg_of[id(p)]
                quant = sharded.global_numel(p) >= cfg.min_quant_numel
                fp32 = sharded.local_fp32_state(state_dict["state"][pid])
                self.state[p] = st.from_fp32(fp32, _local(p), quant, cfg)
        self._forget_cached()
