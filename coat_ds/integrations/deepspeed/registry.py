"""`register_deepspeed()`: let DeepSpeed's own `deepspeed.initialize` build CoatAdamW from
`"optimizer": {"type": "CoatAdamW", ...}`, so that Hugging Face Trainer and Accelerate, which
call `deepspeed.initialize` themselves, accept the same JSON as `coat_ds.integrations.deepspeed.initialize`.

How DeepSpeed 0.19.8 resolves `optimizer.type` (deepspeed/runtime/engine.py):
- `_do_sanity_check` asserts `_is_supported_optimizer(name)`: one of DeepSpeed's own names or
  `getattr(torch.optim, name, None) is not None`;
- `_configure_basic_optimizer` builds every name that is not DeepSpeed's own as
  `getattr(torch.optim, name)(model_parameters, **optimizer.params)`;
- under ZeRO, `_do_optimizer_sanity_check` asserts `zero_allow_untested_optimizer` unless
  `type(optimizer)` is in `deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS`.
Transformers 5.23 (integrations/deepspeed.py) fills `"auto"` in `optimizer.params.lr`, `betas`,
`eps` and `weight_decay` from `TrainingArguments` and, when the JSON has an optimizer section,
hands DeepSpeed a `DummyOptim` so that DeepSpeed builds the optimizer from the JSON; Accelerate
does the same for a `DummyOptim` of the user's.
"""
from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..._compat import deepspeed as ds_compat
from ...optim import CoatAdamW

__all__ = ["register_deepspeed", "mark_zero_tested", "is_registered", "skip_steps_on_device"]

NAME = "CoatAdamW"


def register_deepspeed() -> None:
    """Add three things, each idempotent: the attribute `torch.optim.CoatAdamW` (the class
    `coat_ds.CoatAdamW` itself, which DeepSpeed looks up by name and calls with the JSON's
    `optimizer.params`); `coat_ds.CoatAdamW` in DeepSpeed's list
    `deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS` (so ZeRO needs no
    `zero_allow_untested_optimizer`); and an optimizer step pre-hook that, at each CoatAdamW's
    first step inside a ZeRO-1/2 engine whose JSON sets `"bf16": {"check_grad_overflow":
    false}`, has it skip a step whose global gradient norm is not finite, on the device, as
    `coat_ds.integrations.deepspeed.initialize` arranges (see `_skip_on_device`). Nothing else
    in torch or DeepSpeed changes.

    Raises RuntimeError if `torch.optim.CoatAdamW` already names something else."""
    global _hook
    existing = getattr(torch.optim, NAME, None)
    if existing is not None and existing is not CoatAdamW:
        raise RuntimeError(f"torch.optim.{NAME} is already set to {existing!r}; not replacing it")
    setattr(torch.optim, NAME, CoatAdamW)
    mark_zero_tested()
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_skip_on_device)


_hook = None
_seen: "weakref.WeakSet[CoatAdamW]" = weakref.WeakSet()


def _skip_on_device(optimizer, args, kwargs) -> None:
    """At a CoatAdamW's first step, `skip_steps_on_device` with the ZeRO optimizer stepping it:
    Hugging Face Trainer and Accelerate build the engine with DeepSpeed's own initialize, so
    this is where their runs get what coat_ds's initialize sets up at once."""
    if not isinstance(optimizer, CoatAdamW) or optimizer in _seen:
        return None
    _seen.add(optimizer)
    if not optimizer.step_in_backward and not optimizer.skips_steps_by_global_norm:
        skip_steps_on_device(optimizer, ds_compat.stepping_zero_optimizer(optimizer))
    return None


def skip_steps_on_device(optimizer: CoatAdamW, zopt) -> None:
    """Where `zopt`, the ZeRO-1/2 optimizer stepping `optimizer`, was told not to check
    gradients for overflow, `optimizer` skips a step whose global gradient norm is not finite
    itself, on the device (CoatAdamW.skip_steps_by_global_norm), and rank 0 says so. DeepSpeed's
    check reads a flag back from the GPU in every step, after several kernels per gradient
    tensor, which leaves the GPU idle while the host catches up; with the check off and no
    skip, a step whose norm overflowed would clip every gradient to NaN or zero and step on it."""
    norm = None if zopt is None else ds_compat.unchecked_overflow_norm(zopt)
    if norm is None:
        return
    optimizer.skip_steps_by_global_norm(norm)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print("coat_ds: CoatAdamW skips a step whose global gradient norm is not finite, without a host sync, in "
              "place of DeepSpeed's overflow check (bf16.check_grad_overflow: true keeps DeepSpeed's)", flush=True)


def mark_zero_tested() -> None:
    """Add `coat_ds.CoatAdamW` to DeepSpeed's `ZERO_SUPPORTED_OPTIMIZERS` (idempotent): it is
    tested under ZeRO-1/2/3 and offload, and DeepSpeed warns "You are using ZeRO with an
    untested optimizer, proceed with caution" for any optimizer type not on that list.
    `coat_ds.integrations.deepspeed.initialize` does this on its own. A DeepSpeed without that
    list gets nothing added and one warning (`coat_ds._compat.deepspeed.mark_zero_tested`)."""
    ds_compat.mark_zero_tested(CoatAdamW)


def is_registered() -> bool:
    """Whether `register_deepspeed()` has run in this process (both additions present)."""
    return getattr(torch.optim, NAME, None) is CoatAdamW and ds_compat.zero_tested(CoatAdamW)
