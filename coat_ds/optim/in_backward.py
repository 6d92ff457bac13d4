"""CoatAdamW's update inside backward: each parameter steps as soon as its gradient is
complete and the gradient is freed, so no FP32 gradient waits for `step()`.

* Trigger: the parameter's post-accumulate-grad hook. Under FSDP2 that hook fires on the
  sharded DTensor after reduce-scatter (on FSDP's reduce stream, which the default stream
  waits for at the end of backward). Elsewhere it fires on the local gradient, so in a
  world of several ranks a plain (non-DTensor) parameter is refused: DDP and FSDP1 reduce
  gradients only after that hook has run.
* DDP (`CoatAdamW.register_ddp(model)`): a comm hook steps each bucket once DDP has
  all-reduced it (the gradients stay in DDP's bucket, which DDP keeps anyway: no memory is
  saved there, the update only moves into backward); the post-accumulate hook leaves DDP's
  parameters alone.
* Batching: ready parameters wait in a bucket of up to `BUCKET_NUMEL` elements, stepped
  by one fused launch per (param group, dtype) as in `step()`; the rest is stepped by a
  callback at the end of backward. A launch on a CUDA plain parameter runs on a side
  stream, beside backward's GEMMs; `step()` makes the current stream wait for it.
* Clipping (`max_grad_norm`): the global norm of a step's gradients is known only once
  backward ends, after most of them were applied. Each step therefore scales its
  gradients by min(1, max_grad_norm / (norm + 1e-6)) with the norm of the previous
  step's gradients (torch's clip_grad_norm_ formula). The first step runs unclipped and,
  once its norm is known, its moments are scaled as clipping would have scaled them: its
  update m / sqrt(v) = sign(g) is a clipped step's up to eps. The current norm is
  accumulated on the fly and kept where a non-finite one would zero every update. The
  coefficient lives on the device (no sync) and goes into the param groups' state dict as
  `in_backward_clip_coef`.
* Accumulation: inside `optimizer.accumulating()` the hooks do nothing and gradients
  accumulate as usual; the first backward outside it steps.
* Groups with `nonfinite="raise"` are not stepped in backward: an exact raise needs every
  gradient before anything changes, so their gradients wait for `step()`.
"""
from __future__ import annotations

import contextlib
import math
import threading
import warnings
from collections import defaultdict
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .._compat.torch import queue_backward_callback
from ..memory.tensors import local_tensor
from . import state as st
from .moment import MOMENTS, Fp8Moment

__all__ = ["InBackward", "InBackwardMethods", "BUCKET_NUMEL", "CLIP_KEY"]

# Elements of gradient held before a bucket is stepped: one launch per ~256 MB of FP32
# gradient keeps the host cost near one fused step's while holding little memory.
BUCKET_NUMEL = 1 << 26
CLIP_KEY = "in_backward_clip_coef"

_NO_CALLBACK = ("CoatAdamW(step_in_backward=True) steps the parameters left in the last bucket of each backward in "
                "step() instead: their gradients live until then")


def check_max_grad_norm(max_grad_norm, step_in_backward: bool):
    if max_grad_norm is None:
        return None
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) \
            or not 0 < max_grad_norm < math.inf:
        raise ValueError(f"max_grad_norm must be a finite number > 0 or None, got {max_grad_norm!r}")
    if not step_in_backward:
        raise ValueError("max_grad_norm clips inside backward (step_in_backward=True); with step() clip before "
                         "it, e.g. torch.nn.utils.clip_grad_norm_")
    return float(max_grad_norm)


class InBackward:
    """The in-backward machinery of one CoatAdamW: hooks, pending bucket, clipping state."""

    def __init__(self, optimizer, max_grad_norm: float | None):
        self.opt = optimizer
        self.max_grad_norm = max_grad_norm
        self.handles: dict[int, object] = {}
        self.info: dict[int, tuple[int, int]] = {}  # id(param) -> (param group index, local numel)
        self.deferred: set[int] = set()  # param groups with nonfinite="raise"
        self.pending: dict[int, list] = defaultdict(list)
        self.pending_numel = 0
        self.in_backward = False  # a callback is queued for the running backward
        self.accumulating = False
        self.coef = 1.0  # this step's clipping coefficient: a float until the first norm
        self.norm_known = False  # a previous step's norm set `coef` (else the step is not clipped)
        self.sumsq: dict[tuple, torch.Tensor] = {}
        self.norm: torch.Tensor | None = None
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.ddp_params: set[int] = set()  # stepped by a DDP comm hook, not by their own hook
        self.ddp_stepped: list[torch.Tensor] = []  # ... this step: step() leaves them alone
        self.lock = threading.Lock()  # DDP's comm-hook callbacks may run on other threads

    def watch(self, group_index: int, params) -> None:
        for p in params:
            if p.requires_grad and id(p) not in self.handles:
                self.handles[id(p)] = p.register_post_accumulate_grad_hook(self._ready)
            self.info[id(p)] = (group_index, local_tensor(p).numel())
        self._find_deferred()
        if group_index in self.deferred:
            warnings.warn("CoatAdamW(step_in_backward=True): param groups with nonfinite='raise' are stepped in "
                          "step(), where every gradient is checked first: their gradients are kept until then",
                          RuntimeWarning, stacklevel=4)

    def _find_deferred(self) -> None:
        self.deferred = {i for i, g in enumerate(self.opt.param_groups) if g["nonfinite"] == "raise"}

    def remove_hooks(self) -> None:
        for handle in self.handles.values():
            handle.remove()
        self.handles.clear()

    # -- during backward ------------------------------------------------------------------

    def _ready(self, p: torch.Tensor) -> None:
        # Runs once per parameter and backward: kept to a few dict and attribute reads.
        if self.accumulating or p.grad is None or id(p) in self.ddp_params:
            return
        gi, numel = self.info[id(p)]
        if gi in self.deferred:
            return
        if not self.in_backward:
            self._check_world(p)
            self._check_owned(p, gi)
            self.in_backward = queue_backward_callback(self.end_of_backward, _NO_CALLBACK)
        self.pending[gi].append(p)
        self.pending_numel += numel
        if self.pending_numel >= BUCKET_NUMEL:
            self.flush()

    @staticmethod
    def _check_world(p: torch.Tensor) -> None:
        if isinstance(p, DTensor) or not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_world_size() > 1:
            raise RuntimeError(
                f"CoatAdamW(step_in_backward=True) got a plain tensor gradient in a world of {dist.get_world_size()} "
                "ranks: DDP, FSDP1 and DeepSpeed reduce gradients after the hook that would step it, so each rank "
                "would apply its own. Under DDP call optimizer.register_ddp(ddp_model) first; else shard the model "
                "with FSDP2 (fully_shard), or use step_in_backward=False")

    def _check_owned(self, p: torch.Tensor, gi: int) -> None:
        if not any(q is p for q in self.opt.param_groups[gi]["params"]):
            raise RuntimeError(
                "CoatAdamW(step_in_backward=True): a hooked parameter is no longer in its param group: an engine "
                "(DeepSpeed ZeRO) replaced the groups' parameters with its own flat partitions and reduces the "
                "gradients after this hook. step_in_backward works in one process or under FSDP2 (fully_shard)")

    def end_of_backward(self) -> None:
        self.in_backward = False
        self.flush()

    def _stream(self, grads: list[torch.Tensor]):
        """The side stream for stepping `grads`: plain CUDA tensors of one device only."""
        device = grads[0].device
        if device.type != "cuda" or any(g.device != device or isinstance(g, DTensor) for g in grads):
            return None
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def flush(self) -> None:
        """Step every pending parameter and free its gradient."""
        if self.pending:
            work, self.pending, self.pending_numel = list(self.pending.items()), defaultdict(list), 0
            self._step_and_free(work)

    def _step_and_free(self, work) -> None:
        """Step `work`, (param group index, parameters with a gradient) pairs, and free their
        gradients."""
        params = [p for _, ps in work for p in ps]
        grads = [p.grad for p in params]
        stream = self._stream(grads)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            self.step(work, grads)
        if stream is not None:
            for g in grads:
                g.record_stream(stream)  # freed below, reused only once the step has read it
        for p in params:
            p.grad = None

    # -- the step ---------------------------------------------------------------------------

    def step(self, work, grads: list[torch.Tensor], given: bool = False) -> None:
        """Step `work`, (param group index, parameters) pairs, on `grads` (theirs, in order);
        `given`: the gradients are not the parameters' .grad (DDP's reduced bucket)."""
        with self.lock:
            if self.max_grad_norm is not None:
                self._add_norms(grads)
            self.opt._step_selected(work, self._grad_scale(grads), grads if given else None)

    # -- DDP ----------------------------------------------------------------------------------

    def register_ddp(self, ddp_model) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        for p in ddp_model.parameters():
            if id(p) in self.info:
                self.ddp_params.add(id(p))

        def hook(state, bucket):
            return allreduce_hook(state, bucket).then(lambda fut: self._ddp_bucket_done(fut, bucket))

        ddp_model.register_comm_hook(None, hook)

    def _ddp_bucket_done(self, fut, bucket) -> torch.Tensor:
        reduced = fut.value()
        if not self.accumulating:
            by_group: dict[int, tuple[list, list]] = defaultdict(lambda: ([], []))
            for p, g in zip(bucket.parameters(), bucket.gradients()):
                gi = self.info[id(p)][0] if id(p) in self.info else None
                if gi is not None and gi not in self.deferred:
                    by_group[gi][0].append(p)
                    by_group[gi][1].append(g)
            if by_group:
                work = [(gi, ps) for gi, (ps, _) in by_group.items()]
                self.step(work, [g for _, gs in by_group.values() for g in gs], given=True)
                with self.lock:
                    self.ddp_stepped.extend(p for _, ps in work for p in ps)
        return reduced

    def _grad_scale(self, grads) -> torch.Tensor | None:
        if self.max_grad_norm is None or (not torch.is_tensor(self.coef) and self.coef == 1.0):
            return None
        device = local_tensor(grads[0]).device
        if not torch.is_tensor(self.coef):
            self.coef = torch.tensor(self.coef, dtype=torch.float32, device=device)
        return self.coef if self.coef.device == device else self.coef.to(device)

    def _add_norms(self, grads: list[torch.Tensor]) -> None:
        by_key: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else (None, local_tensor(g).device)
            by_key[key].append(local_tensor(g))
        for key, local in by_key.items():
            local = [t for t in local if t.numel()]
            if not local:
                continue
            sq = torch.stack([n.float() for n in torch._foreach_norm(local)]).square().sum()
            self.sumsq[key] = self.sumsq[key] + sq if key in self.sumsq else sq

    def _global_sumsq(self) -> torch.Tensor | None:
        total = None
        for (mesh, where), sq in self.sumsq.items():
            if mesh is not None:
                placements = [Partial() if isinstance(pl, Shard) else Replicate() for pl in where]
                sq = DTensor.from_local(sq, mesh, placements).full_tensor()
            total = sq if total is None else total + sq.to(total.device)
        return total

    def close_step(self) -> None:
        """The end of a step (`optimizer.step()`): step what still has a gradient, wait for
        the side streams, turn this step's norm into the next step's coefficient."""
        self.flush()
        for p in self.ddp_stepped:  # DDP copied the reduced gradient back after its step
            p.grad = None
        self.ddp_stepped = []
        work = self.opt._params_with_grads()
        if work:
            self._step_and_free(work)
        for device, stream in self.streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)
        self.in_backward = False
        self._find_deferred()  # a group's option may have been changed between steps
        total = self._global_sumsq()
        self.sumsq = {}
        if total is None:
            return
        self.norm = total.sqrt()
        prev = self.coef if torch.is_tensor(self.coef) else torch.tensor(self.coef, device=self.norm.device)
        new = (self.max_grad_norm / (self.norm + 1e-6)).clamp(max=1.0)
        finite = torch.isfinite(self.norm)
        if not self.norm_known:
            self._clip_first_moments(torch.where(finite, new, 1.0).float())
            self.norm_known = True
        self.coef = torch.where(finite, new, prev.to(self.norm.device)).float()

    def _clip_first_moments(self, coef: torch.Tensor) -> None:
        """The first step ran unclipped. Its update, m / sqrt(v) = sign(g), is what a clipped
        step gives (up to eps), but its moments would keep the unclipped scale for about
        1 / (1 - beta2) steps and shrink every later update. So once its norm is known the
        moments of parameters at their first step are scaled as clipping would have: m by
        coef, v by coef**2 (an FP8 moment exactly, through its group centres)."""
        cfg_of = self.opt._config_of()
        for p, state in self.opt.state.items():
            if not state or float(state["step"]) != 1:
                continue
            for name, power in zip(MOMENTS, (1, 2)):
                moment = st.moment(state, name, cfg_of[id(p)])
                if isinstance(moment, Fp8Moment):
                    moment.scale_(coef ** power)
                else:
                    moment.mul_((coef ** power).to(moment.device))

    # -- checkpoints ------------------------------------------------------------------------

    def coef_value(self) -> float | None:
        """The next step's coefficient for a state dict; None before any norm is known."""
        return float(self.coef) if self.norm_known else None

    def load_coef(self, value) -> None:
        self.norm_known = value is not None
        self.coef = 1.0 if value is None else float(value)


class InBackwardMethods:
    """CoatAdamW's public face of stepping in backward (`self._in_backward`: an InBackward
    or None)."""

    @property
    def step_in_backward(self) -> bool:
        return self._in_backward is not None

    @contextlib.contextmanager
    def accumulating(self):
        """With step_in_backward: backward passes inside this block only accumulate gradients
        (micro-batches before the last); the next backward outside it steps. A no-op otherwise."""
        ib = self._in_backward
        if ib is None:
            yield
            return
        before, ib.accumulating = ib.accumulating, True
        try:
            yield
        finally:
            ib.accumulating = before

    def register_ddp(self, ddp_model) -> None:
        """With step_in_backward under DDP: step each gradient bucket in backward once DDP has
        all-reduced it (a comm hook; DDP keeps its buckets, so no gradient memory is saved)."""
        if self._in_backward is None:
            raise ValueError("register_ddp steps gradient buckets in backward: build the optimizer with "
                             "step_in_backward=True")
        self._in_backward.register_ddp(ddp_model)

    def remove_backward_hooks(self) -> None:
        """With step_in_backward: take this optimizer's hooks off its parameters (before
        dropping it while the model lives on). Later backward passes only accumulate; step()
        steps what they leave."""
        if self._in_backward is not None:
            self._in_backward.remove_hooks()

    def last_grad_norm(self) -> torch.Tensor | None:
        """With step_in_backward and max_grad_norm: the global norm of the last closed step's
        gradients before clipping (a 0-d tensor on the device; reading it syncs), else None."""
        return None if self._in_backward is None else self._in_backward.norm
