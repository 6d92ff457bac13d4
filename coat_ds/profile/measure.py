"""Component bytes of one side on this rank, each from where it actually lives.

- weights: distinct storages of the engine's parameters (local shards / flat partitions) and
  FP32 master copies;
- gradients: distinct storages of the engine's gradient tensors and buffers, read right
  after backward (where they peak; ZeRO frees its partitions in the step). An optimizer that
  steps in backward has freed them by then; the most it holds during backward is recorded
  apart (`in_backward_gradient_bytes`) and counted in the sum of components;
- optimizer states: every state tensor of the optimizer but the step counter, after a step;
- activations: (a) the hooks' exact accounting of what autograd saves for backward (COAT: the
  compression ledger; baseline: a counting hook with the same rules), and (b) the meter (CUDA
  allocator, or the CPU storage tracker) during forward: its peak and what is still held
  when forward returns.
Activations are measured at two micro-batches; the difference over the batch difference is
the per-sample cost, so any micro-batch's activations follow as intercept + slope * batch.
"""
from __future__ import annotations

import gc
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..memory import meter_for, resident_bytes, saved_tensor_bytes, unique_storage_bytes
from ..memory.training_state import model_numel
from ..plan.measure import in_backward_grad_bytes, steps_in_backward
from .trainee import Trainee

__all__ = ["ActivationPoint", "SideMeasurement", "measure_side", "train_step", "random_batch"]


@dataclass(frozen=True)
class ActivationPoint:
    """One measured training step."""

    batch: int  # micro-batch (sequences) of this step
    hooks_bytes: int  # saved for backward as stored (COAT: FP8 codes + scales + kept tensors)
    uncompressed_bytes: int  # the same saved tensors without compression (COAT ledger; baseline = hooks_bytes)
    forward_peak_bytes: int  # meter: highest allocation above the step's start during forward
    after_forward_bytes: int  # meter: still allocated when forward returns (held for backward, plus the loss)
    backward_peak_bytes: int  # meter: highest allocation above the step's start over forward and backward
    step_peak_bytes: int | None  # CUDA allocator: the same with the optimizer step (None on CPU)
    resident_bytes: int  # allocated when the step starts (CUDA: allocator; CPU: weights + optimizer states)


@dataclass(frozen=True)
class SideMeasurement:
    """Everything measured for one side on one rank."""

    side: str  # "baseline" or "coat"
    rank: int  # global rank
    meter: str  # what the allocation figures come from
    weights_bytes: int  # model parameters (local shards) + FP32 master weights
    gradients_bytes: int  # gradient tensors and buffers after backward
    optimizer_state_bytes: int  # moment state after a step (no step counters)
    points: tuple[ActivationPoint, ...]  # the measured steps, smaller batch first: two, or one where the larger did not fit
    # Optimizer stepping in backward: the most gradient bytes it holds during backward (one
    # bucket plus the largest parameter's gradient, at most every gradient); else 0.
    in_backward_gradient_bytes: int = 0
    # By kind, read from the live tensors (coat_ds.memory.training_state): master, optimizer,
    # gradients (after backward, those held for the step included), compute copies.
    training_state_bytes: dict | None = None
    model_numel: int = 0  # the whole model's parameters, which the bytes per parameter divide by

    @property
    def fixed_bytes(self) -> int:
        return self.weights_bytes + self.gradients_bytes + self.in_backward_gradient_bytes + self.optimizer_state_bytes

    @property
    def activation_slope(self) -> float:
        """Saved-for-backward bytes per sequence (hooks' accounting); from one point, its
        bytes over its batch (what a decoder saves grows with the batch and nothing else)."""
        if len(self.points) == 1:
            return self.points[0].hooks_bytes / self.points[0].batch
        a, b = self.points
        return (b.hooks_bytes - a.hooks_bytes) / (b.batch - a.batch)

    @property
    def activation_intercept(self) -> float:
        a = self.points[0]
        return a.hooks_bytes - self.activation_slope * a.batch

    def activations_at(self, batch: int) -> float:
        return self.activation_intercept + self.activation_slope * batch

    def components_total(self, batch: int) -> float:
        """Weights + gradients (stepped in backward: the most held during it) + optimizer
        states + activations of `batch` sequences."""
        return self.fixed_bytes + self.activations_at(batch)

    @property
    def engine_buffer_bytes(self) -> int:
        """What the meter saw beyond the four components at the larger measured batch: the
        engine's transient buffers (DeepSpeed's gradient-reduction bucket is 2 x
        reduce_bucket_size bytes during backward). Zero when the components cover it all
        (they overlap in time: activations are freed as gradients appear)."""
        b = self.points[-1].batch
        return max(0, int(self.measured_total() - self.components_total(b)))

    def predicted_total(self, batch: int) -> float:
        """The budget test's figure: components at `batch` + the measured engine buffers."""
        return self.components_total(batch) + self.engine_buffer_bytes

    def measured_total(self) -> int:
        """What the meter saw at the larger measured batch: resident bytes + the peak of forward
        and backward, the span the four components describe (the optimizer step's own
        temporaries are reported apart, as `step_peak_bytes`)."""
        p = self.points[-1]
        return p.resident_bytes + p.backward_peak_bytes

    @classmethod
    def from_dict(cls, d: dict) -> "SideMeasurement":
        """Back from `to_dict` (the JSON's per-rank entries): to re-run the budget test offline."""
        names = [f for f in cls.__dataclass_fields__ if f != "points" and f in d]  # older files lack defaulted ones
        return cls(**{k: d[k] for k in names}, points=tuple(ActivationPoint(**p) for p in d["points"]))

    def predicted_step_total(self, batch: int) -> float:
        """CUDA: the measured step total (optimizer step included) at the larger measured
        batch, moved by the per-sample activation bytes; else `predicted_total`."""
        p = self.points[-1]
        if p.step_peak_bytes is None:
            return self.predicted_total(batch)
        step_total = p.resident_bytes + p.step_peak_bytes + self.activation_slope * (batch - p.batch)
        return max(step_total, self.predicted_total(batch))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["points"] = [asdict(p) for p in self.points]
        d.update(fixed_bytes=self.fixed_bytes, activation_bytes_per_sample=self.activation_slope,
                 activation_intercept_bytes=self.activation_intercept,
                 components_sum_bytes=self.components_total(self.points[-1].batch),
                 engine_buffer_bytes=self.engine_buffer_bytes,
                 measured_total_bytes=self.measured_total(),
                 measured_step_total_bytes=None if self.points[-1].step_peak_bytes is None
                 else self.points[-1].resident_bytes + self.points[-1].step_peak_bytes)
        return d


def random_batch(batch: int, seq_len: int, vocab: int, device: torch.device, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed + batch)
    idx = torch.randint(0, vocab, (batch, seq_len + 1), generator=g).to(device)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def train_step(trainee: Trainee, batch: int, seq_len: int, vocab: int, seed: int) -> float:
    """One forward, backward and optimizer step at `batch` sequences; returns the loss."""
    x, y = random_batch(batch, seq_len, vocab, trainee.device, seed)
    loss = trainee.forward(x, y)
    trainee.backward(loss)
    trainee.step()
    return float(loss.detach())


def _measured_step(trainee: Trainee, batch: int, seq_len: int, vocab: int, seed: int):
    trainee.zero_grad()
    gc.collect()
    x, y = random_batch(batch, seq_len, vocab, trainee.device, seed)
    if trainee.activations is not None:
        trainee.activations.reset_stats()
    meter = meter_for(trainee.device)
    resident = resident_bytes(trainee.device, [*trainee.weight_tensors(), *_resident_state(trainee)])
    meter.start()
    try:
        counter = saved_tensor_bytes((x, y))
        if trainee.activations is None:
            with counter:
                loss = trainee.forward(x, y)
        else:
            loss = trainee.forward(x, y)
        after_forward, forward_peak = meter.now, meter.peak
        if trainee.activations is not None:
            s = trainee.activations.stats()
            hooks, uncompressed = s.compressed_bytes, s.uncompressed_bytes
        else:
            hooks = uncompressed = counter.bytes
        trainee.backward(loss)
        backward_peak = meter.peak
        grads = unique_storage_bytes(trainee.grad_tensors())
        live = trainee.live_gradient_bytes()
        del loss
        if trainee.device.type != "cuda":
            # The CPU tracker would trace every op of the optimizer's pure-torch reference
            # step (slow), whose temporaries say nothing about the fused GPU kernel's.
            meter.stop()
        trainee.step()
        step_peak = meter.peak if trainee.device.type == "cuda" else None
    finally:
        meter.stop()
    point = ActivationPoint(batch, hooks, uncompressed, forward_peak, after_forward, backward_peak, step_peak, resident)
    return point, grads, live


def all_ranks_agree(ok: bool, device: torch.device) -> bool:
    """True on every rank iff `ok` on every rank: all ranks must take the same branch, or the
    next step's collectives would hang."""
    if not (dist.is_available() and dist.is_initialized()):
        return ok
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def free_after_oom(trainee: Trainee, say=print) -> None:
    """Drop what a step that ran out of memory left: gradients, garbage, the allocator's cache."""
    try:
        trainee.zero_grad()
    except Exception as e:  # noqa: BLE001 - cleanup after an OOM must not raise
        say(f"zero_grad after OOM failed ({type(e).__name__}); continuing")
    gc.collect()
    torch.cuda.empty_cache()


def unless_oom(trainee: Trainee, fn: Callable, say=print):
    """fn(), or None (on every rank) where it ran out of memory on some rank; memory is freed."""
    result = None
    try:
        result = fn()
    except torch.cuda.OutOfMemoryError:
        pass
    # Outside the except block: the traceback and the frames holding the step's tensors are gone.
    if result is None:
        free_after_oom(trainee, say)
    return result if all_ranks_agree(result is not None, trainee.device) else None


def _resident_state(trainee: Trainee):
    """Every optimizer state tensor, step counters too: all of it stays allocated."""
    return [t for s in trainee.optimizer().state.values() for t in s.values() if torch.is_tensor(t)]


def measure_side(trainee: Trainee, batches: tuple[int, int], seq_len: int, vocab: int, seed: int,
                 rank: int, say) -> SideMeasurement:
    name = trainee.side.name
    say(f"[{name}] warm-up step at micro-batch {batches[0]} (allocates optimizer state and engine buffers)")
    train_step(trainee, batches[0], seq_len, vocab, seed)
    points, grads, live = [], 0, 0
    for b in batches:
        say(f"[{name}] measuring a step at micro-batch {b}")
        if points and trainee.device.type == "cuda":
            # Where a larger model leaves room for one sequence only (13B under ZeRO-3 on two GPUs).
            measured = unless_oom(trainee, lambda: _measured_step(trainee, b, seq_len, vocab, seed), say)
            if measured is None:
                say(f"[{name}] micro-batch {b} does not fit: activations per sample from micro-batch "
                    f"{points[0].batch} alone (intercept taken as 0)")
                break
        else:
            measured = _measured_step(trainee, b, seq_len, vocab, seed)
        point, grads, live = measured
        points.append(point)
    opt = trainee.optimizer()
    in_bwd = in_backward_grad_bytes(opt) if steps_in_backward(opt) else 0
    return SideMeasurement(
        side=name, rank=rank, meter=meter_for(trainee.device).kind,
        weights_bytes=unique_storage_bytes(trainee.weight_tensors()),
        gradients_bytes=grads,
        optimizer_state_bytes=trainee.optimizer_state_bytes(),
        points=tuple(points), in_backward_gradient_bytes=in_bwd,
        training_state_bytes=trainee.training_state(live).as_dict(), model_numel=model_numel(trainee.model))
