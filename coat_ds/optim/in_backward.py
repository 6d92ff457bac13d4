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
  backward ends, so no update can run before then and still be clipped exactly. With
  clipping, each bucket's FP32 gradients add to the norm and are freed, a BF16 copy kept in
  their place (2 bytes per FP32 parameter instead of 4); `step()` scales them by torch's
  clip_grad_norm_ coefficient, min(1, max_grad_norm / (norm + 1e-6)), as the fused kernel
  reads them. That is step-then-clip on BF16-rounded gradients, bit for bit. (Clipping with
  the previous step's norm instead, which keeps the update in backward, trailed
  step-then-clip's loss on the 350m parity run: a gradient spike is applied
  unclipped and its square stays in the second moment for ~1 / (1 - beta2) steps.)
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
from operator import attrgetter

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .._compat.torch import queue_backward_callback
from ..memory.tensors import local_tensor

__all__ = ["InBackward", "InBackwardMethods", "BUCKET_NUMEL"]

# Elements of gradient held before a bucket is stepped: one launch per ~256 MB of FP32
# gradient keeps the host cost near one fused step's while holding little memory.
BUCKET_NUMEL = 1 << 26
_GRAD = attrgetter("grad")
# Gradients held for a clipped step as they are; wider ones are held in BF16.
_HELD_AS_IS = (torch.bfloat16, torch.float16)

_NO_CALLBACK = ("CoatAdamW(step_in_backward=True) steps the parameters left in the last bucket of each backward in "
                "step() instead: their gradients live until then")


def check_max_grad_norm(max_grad_norm, step_in_backward: bool):
    if max_grad_norm is None:
        return None
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) \
            or not 0 < max_grad_norm < math.inf:
        raise ValueError(f"max_grad_norm must be a finite number > 0 or None, got {max_grad_norm!r}")
    if not step_in_backward:
        raise ValueError("max_grad_norm is for step_in_backward=True, whose gradients are gone before a clip "
                         "could see them; with step() clip before it, e.g. torch.nn.utils.clip_grad_norm_")
    return float(max_grad_norm)


class InBackward:
    """The in-backward machinery of one CoatAdamW: hooks, pending bucket, clipping state. It
    steps the optimizer through the two methods CoatAdamW keeps for it, `_work_with_grads()`
    and `_step_work(work, grads, grad_scale)`, and reads its `param_groups`."""

    def __init__(self, optimizer, max_grad_norm: float | None):
        self.opt = optimizer
        self.max_grad_norm = max_grad_norm
        self.handles: dict[int, object] = {}
        self.hooks: dict[int, object] = {}  # id(param) -> its post-accumulate-grad hook
        self.info: dict[int, tuple[int, int]] = {}  # id(param) -> (param group index, local numel)
        self.stream_device: torch.device | None = None  # every parameter a plain tensor on this GPU
        self.params_device: torch.device | None = None  # the first parameter's, when that was found
        self.deferred: set[int] = set()  # param groups with nonfinite="raise"
        self.pending: dict[int, list] = defaultdict(list)
        self.pending_numel = 0
        self.in_backward = False  # a callback is queued for the running backward
        self.accumulating = False
        self.held: dict[int, tuple[list, list]] = defaultdict(lambda: ([], []))  # with clipping: BF16 gradients
        self.sumsq: dict[tuple, torch.Tensor] = {}
        self.norm: torch.Tensor | None = None
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.ddp_stepped: list[torch.Tensor] = []  # ... this step: step() leaves them alone
        self.lock = threading.Lock()  # DDP's comm-hook callbacks may run on other threads

    def watch(self, group_index: int, params) -> None:
        for p in params:
            numel = local_tensor(p).numel()
            if p.requires_grad and id(p) not in self.handles:
                self.hooks[id(p)] = hook = self._hook(group_index, numel)
                self.handles[id(p)] = p.register_post_accumulate_grad_hook(hook)
            self.info[id(p)] = (group_index, numel)
        self._find_stream_device()
        self._find_deferred()
        if group_index in self.deferred:
            warnings.warn("CoatAdamW(step_in_backward=True): param groups with nonfinite='raise' are stepped in "
                          "step(), where every gradient is checked first: their gradients are kept until then",
                          RuntimeWarning, stacklevel=4)

    def _find_deferred(self) -> None:
        self.deferred = {i for i, g in enumerate(self.opt.param_groups) if g["nonfinite"] == "raise"}

    def _find_stream_device(self) -> None:
        """The GPU whose side stream can take every launch: where all parameters are plain
        tensors on one CUDA device (DTensors' gradients belong to FSDP's streams)."""
        params = [p for g in self.opt.param_groups for p in g["params"]]
        self.params_device = params[0].device if params else None
        devices = {p.device for p in params}
        device = devices.pop() if len(devices) == 1 else None
        plain = not any(isinstance(p, DTensor) for p in params)
        self.stream_device = device if device is not None and device.type == "cuda" and plain else None

    def remove_hooks(self, ids=None) -> None:
        """Take the hooks off every parameter, or off those whose id is in `ids`."""
        for i in list(self.handles) if ids is None else ids:
            if i in self.handles:
                self.handles.pop(i).remove()
                self.hooks.pop(i)

    # -- during backward ------------------------------------------------------------------

    def _hook(self, gi: int, numel: int):
        """The post-accumulate-grad hook of a parameter of param group `gi`, `numel` local
        elements. It runs once per parameter and backward, so it only reads what it must."""
        pending = self.pending

        def ready(p: torch.Tensor) -> None:
            if self.accumulating or gi in self.deferred:
                return
            if not self.in_backward:
                self._begin(p, gi)
            pending[gi].append(p)
            self.pending_numel += numel
            if self.pending_numel >= BUCKET_NUMEL:
                self.flush()

        return ready

    def _begin(self, p: torch.Tensor, gi: int) -> None:
        """The first parameter of a backward: check the setting, queue the end's callback."""
        if p.device != self.params_device:  # the model moved since (model.cuda())
            self._find_stream_device()
        self._check_world(p)
        self._check_owned(p, gi)
        self.in_backward = queue_backward_callback(self.end_of_backward, _NO_CALLBACK)

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

    def _stream(self):
        """The side stream for the launches, or None (see `_find_stream_device`)."""
        device = self.stream_device
        if device is None:
            return None
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def flush(self) -> None:
        """Step (with clipping: hold) every pending parameter and free its gradient."""
        if self.pending:
            work = [(gi, ps) for gi, ps in self.pending.items() if ps]
            self.pending.clear()  # the hooks hold this dict
            self.pending_numel = 0
            (self._step_and_free if self.max_grad_norm is None else self._hold)(work)

    def _hold(self, work) -> None:
        """Add `work`'s gradients to the norm and keep them in BF16 for the clipped step."""
        with self.lock:
            self._add_norms([p.grad for _, ps in work for p in ps])
            for gi, ps in work:
                params, grads = self.held[gi]
                for p in ps:
                    params.append(p)
                    grads.append(p.grad if p.grad.dtype in _HELD_AS_IS else p.grad.to(torch.bfloat16))
                    p.grad = None

    def _step_and_free(self, work) -> None:
        """Step `work`, (param group index, parameters with a gradient) pairs, and free their
        gradients."""
        grads = [list(map(_GRAD, ps)) for _, ps in work]
        stream = self._stream()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            self.step(work, grads)
        if stream is not None:
            for gs in grads:
                for g in gs:
                    g.record_stream(stream)  # freed below, reused only once the step has read it
        for _, ps in work:
            for p in ps:
                p.grad = None

    # -- the step ---------------------------------------------------------------------------

    def step(self, work, grads: list[list[torch.Tensor]], grad_scale=None) -> None:
        """Step `work`, (param group index, parameters) pairs, on `grads`, one list per pair
        (their .grad, DDP's reduced bucket or the held copies)."""
        with self.lock:
            self.opt._step_work(work, grads, grad_scale)

    # -- DDP ----------------------------------------------------------------------------------

    def register_ddp(self, ddp_model) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        # Their buckets are stepped by the comm hook below, not by their own hooks.
        self.remove_hooks([id(p) for p in ddp_model.parameters()])

        def hook(state, bucket):
            return allreduce_hook(state, bucket).then(lambda fut: self._ddp_bucket_done(fut, bucket))

        ddp_model.register_comm_hook(None, hook)

    def _ddp_bucket_done(self, fut, bucket) -> torch.Tensor:
        reduced = fut.value()
        if not self.accumulating and self.max_grad_norm is None:  # clipped: step() steps DDP's copy-back
            by_group: dict[int, tuple[list, list]] = defaultdict(lambda: ([], []))
            for p, g in zip(bucket.parameters(), bucket.gradients()):
                gi = self.info[id(p)][0] if id(p) in self.info else None
                if gi is not None and gi not in self.deferred:
                    by_group[gi][0].append(p)
                    by_group[gi][1].append(g)
            if by_group:
                work = [(gi, ps) for gi, (ps, _) in by_group.items()]
                self.step(work, [gs for _, gs in by_group.values()])
                with self.lock:
                    self.ddp_stepped.extend(p for _, ps in work for p in ps)
        return reduced

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
        """The end of a step (`optimizer.step()`): step what still has a gradient (with
        clipping: everything, by this step's coefficient) and wait for the side streams."""
        self.flush()
        for p in self.ddp_stepped:  # DDP copied the reduced gradient back after its step
            p.grad = None
        self.ddp_stepped = []
        self.in_backward = False
        self._find_deferred()  # a group's option may have been changed between steps
        work = self.opt._work_with_grads()
        if self.max_grad_norm is None:
            if work:
                self._step_and_free(work)
        else:
            self._clipped_step(work)
        for device, stream in self.streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)

    def _clipped_step(self, work) -> None:
        """Step the held BF16 gradients and `work` (parameters still holding theirs) scaled
        by clip_grad_norm_'s coefficient for the global norm of all of them."""
        if work:
            self._add_norms([p.grad for _, ps in work for p in ps])
        total = self._global_sumsq()
        held, self.held, self.sumsq = list(self.held.items()), defaultdict(lambda: ([], [])), {}
        coef = None  # only empty gradients: nothing to scale
        if total is not None:
            self.norm = total.sqrt()
            coef = (self.max_grad_norm / (self.norm + 1e-6)).clamp(max=1.0)
        if held:
            self.step([(gi, ps) for gi, (ps, _) in held], [gs for _, (_, gs) in held], grad_scale=coef)
        if work:
            self.step(work, [list(map(_GRAD, ps)) for _, ps in work], grad_scale=coef)
            for _, ps in work:
                for p in ps:
                    p.grad = None


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

    @property
    def max_grad_norm(self) -> float | None:
        """The global norm gradients are clipped to (step_in_backward only), or None."""
        return None if self._in_backward is None else self._in_backward.max_grad_norm

    def held_gradients(self) -> list[torch.Tensor]:
        """The gradients held between backward and step() (step_in_backward with clipping: the
        BF16 copies the clipped step reads); empty otherwise."""
        ib = self._in_backward
        return [] if ib is None else [g for _, grads in ib.held.values() for g in grads]

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
        """With step_in_backward and max_grad_norm: the global norm of the last step's
        gradients before clipping (a 0-d tensor on the device; reading it syncs), else None."""
        return None if self._in_backward is None else self._in_backward.norm
