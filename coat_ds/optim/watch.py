"""A warning for a CoatAdamW that was built but replaced: another optimizer steps under
DeepSpeed while no CoatAdamW ever has.

Two real cases train with FP32 AdamW states and say nothing (transformers 5.23, accelerate
1.15): HF Trainer under DeepSpeed drops `Trainer(optimizers=(CoatAdamW(...), None))`
(`deepspeed_init` sets `trainer.optimizer = None` and builds its own), and Accelerate under
ZeRO-Offload swaps a client optimizer for DeepSpeedCPUAdam unless `zero_force_ds_cpu_optimizer`
is false. The dropped CoatAdamW may be garbage already, so the check counts constructions
instead of holding instances: a global step pre-hook, installed by the first CoatAdamW and
removed as soon as every CoatAdamW built so far has stepped or the warning was given.
"""
from __future__ import annotations

import sys
import warnings
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["note_built", "REPLACED_MESSAGE"]

REPLACED_MESSAGE = (
    "coat_ds: a CoatAdamW was created in this process, but DeepSpeed is stepping {name} and no CoatAdamW has "
    "stepped: training runs without FP8 optimizer states. Hugging Face Trainer under DeepSpeed drops "
    "Trainer(optimizers=(CoatAdamW(...), ...)) and builds its own optimizer: name the optimizer in the DeepSpeed "
    "JSON ({{\"type\": \"CoatAdamW\"}} after coat_ds.register_deepspeed()) or pass "
    "optimizer_cls_and_kwargs=(coat_ds.CoatAdamW, kwargs). Accelerate under ZeRO-Offload replaces a client "
    "optimizer by DeepSpeedCPUAdam unless the JSON sets \"zero_force_ds_cpu_optimizer\": false."
)

_pending = 0  # CoatAdamW instances built whose first step has not been seen
_stepped: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_handle = None
_watched: type | None = None  # CoatAdamW, handed over by its constructor (watch does not import it)


def _under_deepspeed() -> bool:
    return "deepspeed" in sys.modules and torch.distributed.is_available() and torch.distributed.is_initialized()


def _stop() -> None:
    global _handle, _pending
    _pending = 0
    if _handle is not None:
        _handle.remove()
        _handle = None


def _pre_step(optimizer, args, kwargs):
    global _pending
    if isinstance(optimizer, _watched):
        if optimizer not in _stepped:
            _stepped.add(optimizer)
            _pending -= 1
            if _pending <= 0:
                _stop()
        return None
    if _under_deepspeed():
        warnings.warn(REPLACED_MESSAGE.format(name=type(optimizer).__name__), UserWarning, stacklevel=3)
        _stop()
    return None


def note_built(watched: type) -> None:
    """Called by every CoatAdamW constructor with the class whose instances count as
    stepping (CoatAdamW itself: a subclass counts too)."""
    global _pending, _handle, _watched
    _watched = watched
    _pending += 1
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(_pre_step)
