"""Measured costs of each choice: short training steps with every decoder layer on one choice,
at two micro-batches.

Per layer, the bytes a layer's forward leaves allocated (what backward will read, plus its
output, less its input where nothing keeps it) come from the allocator:
`torch.cuda.memory_allocated` before and after the layer on CUDA, the storage tracker of
coat_ds.memory.meters on CPU, read in forward hooks on the layer.
The step's peak (CUDA: `max_memory_allocated` over forward, backward and optimizer step;
CPU: resident bytes + the tracker's peak over forward and backward) and its time (median of
timed steps, perf_counter after a device synchronize) are read for the whole model. The
fixed part (parameters, gradients, optimizer state) is read from the tensors themselves.

An optimizer that steps in backward (CoatAdamW(step_in_backward=True)) is measured doing
so: its gradients are gone after backward, and the measured peaks hold what it holds during
backward. In the fixed part its gradients are `in_backward_grad_bytes`, the most it can hold.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time
from typing import Callable

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from .._compat.torch import activation_memory_budget
from ..memory import local_tensor, meter_for, resident_bytes, unique_storage_bytes
from ..optim import in_backward
from ..optim.state import state_bytes, state_tensors
from .apply import ApplyConfig, apply_plan
from .layers import decoder_layers, training_loss, vocab_size_of
from .measurements import ChoiceRun, MeasureConfig, Measurements
from .plan import Plan

__all__ = ["measure_choices", "measure_plan", "in_backward_grad_bytes", "steps_in_backward"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_tensor(args, kwargs):
    for x in (*args, kwargs.get("hidden_states"), *kwargs.values()):
        if torch.is_tensor(x):
            return x
    return None


def steps_in_backward(optimizer) -> bool:
    """The optimizer steps each parameter in backward and frees its gradient there."""
    return bool(getattr(optimizer, "step_in_backward", False))


def in_backward_grad_bytes(optimizer) -> int:
    """The most gradient bytes CoatAdamW(step_in_backward=True) holds during one backward
    over its parameters (this rank's shards): ready gradients wait in a bucket that is
    stepped (or, with clipping, held) once it reaches `in_backward.BUCKET_NUMEL` elements, so
    at most BUCKET_NUMEL - 1 elements plus the parameter that fills it, and never more than
    every gradient. With `max_grad_norm`, the BF16 copies held for step() as well (all of
    them by the end of backward). Gradients the optimizer keeps for step()
    (nonfinite="raise" groups) are left after backward and measured there."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    sizes = [(local_tensor(p).numel(), local_tensor(p).element_size()) for p in params]
    if not sizes:
        return 0
    total = sum(n * e for n, e in sizes)
    widest = max(e for _, e in sizes)
    bucket = min(total, (in_backward.BUCKET_NUMEL - 1) * widest + max(n * e for n, e in sizes))
    if optimizer.max_grad_norm is None:
        return bucket
    return bucket + sum(n * min(e, 2) for n, e in sizes)


class _LayerBytes:
    """Forward hooks reading the meter around each layer while a meter is set.

    A layer's bytes are what its forward left allocated, less its input where that input is
    gone by the start of backward: the caller drops it (HF: `hidden_states = layer(...)`, or
    `inputs_embeds` at the end of the model's forward), and whether anything else keeps it
    is this layer's choice (kept and recomputed layers save it, FP8 layers save codes). A
    weak reference to the input's storage tells. Counted at the post-hook alone, every FP8
    layer looked one hidden state larger and the head's transient one hidden state per layer
    smaller, which mispredicted mixed plans.

    On for the whole run, not only the measured step: compiled layers guard on their
    hooks, so hooks added and removed around one step would recompile them twice per run."""

    def __init__(self, layers: list[nn.Module]):
        self.meter, self.before, self.held, self.inputs = None, {}, [], []
        self.handles = []
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self._post(i)))
        self.n = len(layers)

    def start(self, meter) -> None:
        self.meter, self.before, self.held, self.inputs = meter, {}, [0] * self.n, [None] * self.n

    def stop(self) -> tuple[int, ...]:
        """Per layer, at the start of backward: bytes its forward left that are still held."""
        self.meter = None
        released = [-nbytes if ref is not None and ref.expired() else 0 for ref, nbytes in
                    (x or (None, 0) for x in self.inputs)]
        self.inputs = [None] * self.n
        return tuple(h + r for h, r in zip(self.held, released))

    def _pre(self, i):
        @torch.compiler.disable
        def hook(module, args, kwargs):
            if self.meter is not None:
                self.before[i] = self.meter.now
                x = _first_tensor(args, kwargs)
                if x is not None:
                    storage = x.untyped_storage()
                    self.inputs[i] = (StorageWeakRef(storage), storage.nbytes())
        return hook

    def _post(self, i):
        @torch.compiler.disable
        def hook(module, args, output):
            if self.meter is not None:
                self.held[i] = self.meter.now - self.before.pop(i)
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


class _Session:
    """Training steps of one model and a throwaway optimizer, measured; on close the
    parameters are put back as they were and the optimizer is dropped."""

    def __init__(self, model: nn.Module, optimizer_factory: Callable, config: MeasureConfig, loss_fn, vocab_size):
        self.model, self.config = model, config
        self.loss_fn = loss_fn or training_loss
        self.vocab = vocab_size or vocab_size_of(model)
        named = decoder_layers(model)
        self.fqns, self.layers = [f for f, _ in named], [m for _, m in named]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.device = self.params[0].device
        self.autocast = self.device.type == "cuda" if config.autocast is None else config.autocast
        self.snapshot = [p.detach().to("cpu", copy=True) for p in self.params]
        self.opt = optimizer_factory(self.params)
        # Accumulated micro-batches hold every gradient until the last one's backward: an
        # optimizer that would step in backward is measured holding them.
        self.hold_grads = config.grad_accumulation > 1 and steps_in_backward(self.opt)
        self.stepped_in_backward = steps_in_backward(self.opt) and not self.hold_grads
        self.layer_bytes = _LayerBytes(self.layers)
        self.gen = torch.Generator().manual_seed(config.seed)
        self.grads_bytes = 0

    def ids(self, batch: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (batch, self.config.seq_len + 1), generator=self.gen).to(self.device)

    def forward(self, batch_ids: torch.Tensor) -> torch.Tensor:
        ctx = (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast
               else contextlib.nullcontext())
        with ctx:
            return self.loss_fn(self.model, batch_ids)

    def backward(self, loss: torch.Tensor) -> None:
        with self.opt.accumulating() if self.hold_grads else contextlib.nullcontext():
            loss.backward()

    def step(self, batch: int) -> None:
        self.backward(self.forward(self.ids(batch)))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def measured_step(self, batch: int) -> tuple[tuple[int, ...], int]:
        """(bytes each layer's forward left allocated, the step's peak with resident bytes)."""
        opt, device = self.opt, self.device
        opt.zero_grad(set_to_none=True)
        gc.collect()
        x = self.ids(batch)
        _sync(device)
        resident = resident_bytes(device, [*self.params, *state_tensors(*opt.state.values())])
        meter = meter_for(device)
        hooks = self.layer_bytes
        hooks.start(meter)
        held = None
        # The CPU tracker is a dispatch mode, and torch.compile skips every frame it meets
        # under one, for good: compiled layers would run eagerly from this step on. So on
        # CPU the measured step runs eagerly, on purpose and without touching the compiled
        # code; the warm-up and timed steps stay compiled.
        eager = torch.compiler.set_stance("force_eager") if device.type != "cuda" else contextlib.nullcontext()
        meter.start()
        try:
            with eager:
                loss = self.forward(x)
                held = hooks.stop()
                self.backward(loss)
                del loss
            self.grads_bytes = unique_storage_bytes(p.grad for p in self.params)
            if device.type != "cuda":
                meter.stop()  # the tracker would trace every op of a pure-torch optimizer step (slow)
            opt.step()
            peak = resident + meter.peak
        finally:
            meter.stop()
            hooks.meter = None
            opt.zero_grad(set_to_none=True)
        return held, peak

    def run(self, choice: str, batch: int) -> ChoiceRun:
        """Warm-up steps, one measured step, timed steps (median), at `batch`."""
        for _ in range(self.config.warmup_steps):
            self.step(batch)
        held, peak = self.measured_step(batch)
        times = []
        for _ in range(self.config.timed_steps):
            _sync(self.device)
            t0 = time.perf_counter()
            self.step(batch)
            _sync(self.device)
            times.append(time.perf_counter() - t0)
        return ChoiceRun(choice, batch, held, peak, statistics.median(times))

    def state_bytes(self) -> int:
        return state_bytes(*self.opt.state.values(), storages=True)

    def close(self) -> None:
        self.layer_bytes.remove()
        # An optimizer that steps in backward hooks the parameters, and the hooks keep it
        # alive: left on, the dropped optimizer would go on stepping the model in every
        # later backward.
        if hasattr(self.opt, "remove_backward_hooks"):
            self.opt.remove_backward_hooks()
        with torch.no_grad():
            for p, s in zip(self.params, self.snapshot):
                p.copy_(s)
        self.opt = None
        gc.collect()


@contextlib.contextmanager
def _compile_budget(budget: float | None, *, reset: bool):
    """torch's activation-memory budget set to `budget` (None: left as it is), with
    torch.compile's caches reset on entry and exit where `reset`."""
    if reset:
        torch.compiler.reset()
    try:
        with activation_memory_budget(budget):
            yield
    finally:
        if reset:
            torch.compiler.reset()


def measure_choices(model: nn.Module, optimizer_factory: Callable, *, config: MeasureConfig | None = None,
                    apply_config: ApplyConfig | None = None, loss_fn: Callable | None = None,
                    vocab_size: int | None = None, say: Callable[[str], None] = lambda s: None) -> Measurements:
    """Measure `model` with every decoder layer on each of `config.choices` in turn, and
    again under each of `config.compile_budgets`.

    `optimizer_factory(params)` builds the optimizer the plan will train with (its state is
    part of the fixed bytes); it is dropped afterwards and the parameters are put back as
    they were. `loss_fn(model, ids)` gives the loss of token ids (batch, seq_len + 1);
    default: `training_loss`. The model's own compilation or wrapping stays as it is.

    torch reads its activation-memory budget when it compiles a graph and does not guard on
    it, so with `compile_budgets` torch.compile's caches are reset (`torch.compiler.reset()`)
    before each budget and after the last: every compiled function recompiles on its next
    call, under the budget it runs with."""
    config = config if config is not None else MeasureConfig()
    s = _Session(model, optimizer_factory, config, loss_fn, vocab_size)
    runs = []
    try:
        for budget in (None, *config.compile_budgets):
            at = "" if budget is None else f" (compile budget {budget:g})"
            with _compile_budget(budget, reset=bool(config.compile_budgets)):
                for choice in config.choices:
                    plan = Plan.uniform(s.fqns, choice, config.batches[-1], config.seq_len)
                    applied = apply_plan(model, plan, config=apply_config)
                    try:
                        for b in config.batches:
                            r = dataclasses.replace(s.run(choice, b), compile_budget=budget)
                            runs.append(r)
                            say(f"[plan] {choice} at micro-batch {b}{at}: layers hold "
                                f"{sum(r.layer_bytes) / 1e9:.4f} GB, peak {r.peak_bytes / 1e9:.4f} GB, "
                                f"step {r.step_s * 1e3:.1f} ms")
                    finally:
                        applied.remove()
        opt_bytes = s.state_bytes()
        held_bytes = in_backward_grad_bytes(s.opt) if s.stepped_in_backward else 0
    finally:
        s.close()
    grad_bytes = tuple(sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
                       for layer in s.layers)
    return Measurements(tuple(s.fqns), config.seq_len, str(s.device), meter_for(s.device).kind,
                        unique_storage_bytes(s.params), s.grads_bytes, opt_bytes, tuple(runs), grad_bytes,
                        s.stepped_in_backward, held_bytes)


def measure_plan(model: nn.Module, plan: Plan, optimizer_factory: Callable, *, config: MeasureConfig | None = None,
                 apply_config: ApplyConfig | None = None, loss_fn: Callable | None = None,
                 vocab_size: int | None = None) -> ChoiceRun:
    """The plan applied and run at its micro-batch and sequence length, measured as
    `measure_choices` measures each choice (`choice` of the result: "plan"); the model is
    left as it was."""
    config = dataclasses.replace(config or MeasureConfig(), seq_len=plan.seq_len)
    s = _Session(model, optimizer_factory, config, loss_fn, vocab_size)
    try:
        # apply_plan sets the plan's budget; the reset makes graphs compile under it.
        with _compile_budget(None, reset=plan.compile_memory_budget is not None):
            applied = apply_plan(model, plan, config=apply_config)
            try:
                return dataclasses.replace(s.run("plan", plan.micro_batch),
                                           compile_budget=plan.compile_memory_budget)
            finally:
                applied.remove()
    finally:
        s.close()
