"""One param group's step, prepared once for a list of parameters and re-checked cheaply at
every later step.

Finding each parameter's state, checking it and sorting it into launch buckets costs a few
microseconds of Python per tensor; at a few hundred tensors that made the GPU step host-bound.
A GroupStep does that work when it is built and, at each step, verifies with a handful of
C-level passes over precomputed tuples that nothing it relied on changed:

- the address of every local parameter tensor and of every state value, in order (a state
  tensor replaced in its dict, given new storage by `.data =` as DeepSpeed's offload_states
  does, a key added or removed: the list differs), and every parameter's element count;
- for DTensor parameters, that each local shard is the same object;
- that every gradient can be stepped as prepared (dense, contiguous, the prepared dtype).

Anything else (another parameter list, other group options, a `load_state_dict`) means
another or a new GroupStep. The step counters of its parameters live in one CPU buffer, each
state's "step" a 0-d view of its element, so one add and one read serve every tensor.
"""
from __future__ import annotations

from collections import defaultdict
from itertools import chain
from operator import is_, itemgetter

import torch
from torch.distributed.tensor import DTensor

from ..config import AdamWHyperparams, OptimStateConfig
from ..kernels import AdamWHyper, AdamWSlot, get
from ..memory.tensors import local_tensor
from .nonfinite import SkipCounter

__all__ = ["GroupStep"]

_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel


def _scaled(grads: list[torch.Tensor], grad_scale: torch.Tensor | None) -> list[torch.Tensor]:
    """`grads` in FP32 multiplied by `grad_scale`, in new tensors, as the Triton step scales
    each gradient it reads (for the kernels without a scale argument)."""
    return grads if grad_scale is None else [g.float() * grad_scale.to(g.device) for g in grads]


def _picker(indices: list[int]):
    """Function taking the items at `indices` from a sequence, as a tuple."""
    if len(indices) == 1:
        i = indices[0]
        return lambda seq: (seq[i],)
    return itemgetter(*indices)


class _EachStep:
    """The prepared-launch interface over an `adamw_step` that keeps nothing between steps
    (the reference and host steps, whose per-tensor work dwarfs this bookkeeping)."""

    def __init__(self, adamw_step, slots: list[AdamWSlot], **kw):
        self.adamw_step = adamw_step
        self.slots = [s._replace(grad=None) for s in slots]
        self.kw = kw

    def accept(self, grads) -> list[torch.Tensor] | None:
        if any(g.layout != torch.strided for g in grads):
            return None
        return [g if g.is_contiguous() else g.contiguous() for g in grads]

    def __call__(self, grads: list[torch.Tensor], hyper: AdamWHyper, skipped: torch.Tensor,
                 grad_scale: torch.Tensor | None = None) -> None:
        grads = _scaled(grads, grad_scale)
        self.adamw_step([s._replace(grad=g) for s, g in zip(self.slots, grads)], hyper, skipped=skipped, **self.kw)


class _Bucket:
    """Parameters of one group sharing device, dtypes and moment kind: one launch per step."""

    def __init__(self, indices: list[int], slots: list[AdamWSlot], cfg: OptimStateConfig, plan_cache: dict):
        self.indices = indices
        self.pick = _picker(indices)
        self.slots = [s._replace(grad=None) for s in slots]
        self.ops = get("adamw", slots[0].param.device, cfg.backend)
        self.kw = dict(group_size=cfg.group_size, fmt_m=cfg.first_moment_format, fmt_v=cfg.second_moment_format,
                       dre=cfg.dynamic_range_expansion, plan_cache=plan_cache)
        prepare = self.ops.prepare
        self.launch = _EachStep(self.ops.step, slots, **self.kw) if prepare is None else prepare(slots, **self.kw)

    def split_run(self, grads, steps: list[float], hp: AdamWHyperparams, skipped: torch.Tensor,
                  grad_scale: torch.Tensor | None) -> None:
        """The step of a bucket whose tensors are at different steps (some went without a
        gradient at some step): one launch per step, nothing prepared."""
        by_step = defaultdict(list)
        for slot, grad, step in zip(self.slots, _scaled(list(grads), grad_scale), steps):
            by_step[int(step)].append(slot._replace(grad=grad if grad.is_contiguous() else grad.contiguous()))
        for step, slots in by_step.items():
            hyper = AdamWHyper.at_step(step, hp.lr, *hp.betas, hp.eps, hp.weight_decay)
            self.ops.step(slots, hyper, skipped=skipped, **self.kw)


class GroupStep:
    """The prepared step of `params` (all with a gradient) under `cfg`; `slots` are theirs
    (local tensor, a gradient, moments, group skips), `states` their state dicts."""

    def __init__(self, params: list[torch.Tensor], states: list[dict], slots: list[AdamWSlot],
                 cfg: OptimStateConfig, plan_cache: dict):
        self.params = tuple(params)
        self.cfg = cfg
        self.dtensor = any(isinstance(p, DTensor) for p in params)
        self.locals = tuple(s.param for s in slots)
        self.numels = list(map(_numel, self.locals))
        self.steps = torch.tensor([float(state["step"]) for state in states], dtype=torch.float32)
        for i, state in enumerate(states):
            state["step"] = self.steps[i]
        try:
            self.addresses = self._addresses(self.locals, states)
        except (TypeError, RuntimeError):  # a state value that is not a tensor with storage: never reused
            self.addresses = None
        by_kind: dict[tuple, list[int]] = defaultdict(list)
        for i, s in enumerate(slots):
            quant = not torch.is_tensor(s.exp_avg)
            by_kind[(quant, s.param.device, s.param.dtype, s.grad.dtype)].append(i)
        self.buckets = [_Bucket(idx, [slots[i] for i in idx], cfg, plan_cache) for idx in by_kind.values()]

    @staticmethod
    def _addresses(locals_, states) -> list[int]:
        return list(map(_data_ptr, chain(locals_, chain.from_iterable(map(dict.values, states)))))

    def check(self, state: dict, grads: list[torch.Tensor]) -> tuple | None:
        """What `run` takes for this step's gradients (one per parameter, in order), or None
        where anything this GroupStep relies on changed (then build another)."""
        if self.dtensor:
            locals_ = list(map(local_tensor, self.params))
            if not all(map(is_, locals_, self.locals)):
                return None
            grads = list(map(local_tensor, grads))
        else:
            locals_ = self.params
        try:
            if self._addresses(locals_, map(state.get, self.params)) != self.addresses:
                return None
        except (TypeError, RuntimeError):  # a parameter without state, a value that is not a tensor with storage
            return None
        if list(map(_numel, locals_)) != self.numels:
            return None
        return self.take(grads)

    def take(self, grads: list[torch.Tensor]) -> tuple | None:
        """(local gradients, what each bucket's launch takes for them), or None where one
        cannot be stepped as prepared."""
        single = len(self.buckets) == 1
        taken = []
        for bucket in self.buckets:
            t = bucket.launch.accept(grads if single else bucket.pick(grads))
            if t is None:
                return None
            taken.append(t)
        return grads, taken

    def run(self, taken: tuple, hp: AdamWHyperparams, skips: SkipCounter, grad_scale: torch.Tensor | None = None) -> None:
        """Step every parameter once; `grad_scale` (float32, shape ()): the gradients are taken
        multiplied by it (a clipping coefficient on the device)."""
        grads, per_bucket = taken
        self.steps.add_(1)
        steps = self.steps.tolist()
        single = len(self.buckets) == 1
        for bucket, t in zip(self.buckets, per_bucket):
            b_steps = steps if single else bucket.pick(steps)
            skipped = skips.counter(bucket.slots[0].param.device)
            if b_steps.count(b_steps[0]) == len(b_steps):
                hyper = AdamWHyper.at_step(int(b_steps[0]), hp.lr, *hp.betas, hp.eps, hp.weight_decay)
                bucket.launch(t, hyper, skipped, grad_scale)
            else:
                bucket.split_run(grads if single else bucket.pick(grads), b_steps, hp, skipped, grad_scale)
