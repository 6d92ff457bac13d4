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

import torch

from ..._compat import deepspeed as ds_compat
from ...optim import CoatAdamW

__all__ = ["register_deepspeed", "mark_zero_tested", "is_registered"]

NAME = "CoatAdamW"


def register_deepspeed() -> None:
    """Add exactly two things, both idempotent: the attribute `torch.optim.CoatAdamW` (the class
    `coat_ds.CoatAdamW` itself, which DeepSpeed looks up by name and calls with the JSON's
    `optimizer.params`), and `coat_ds.CoatAdamW` to DeepSpeed's list
    `deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS` (so ZeRO needs no
    `zero_allow_untested_optimizer`). Nothing else in torch or DeepSpeed changes.

    Raises RuntimeError if `torch.optim.CoatAdamW` already names something else."""
    existing = getattr(torch.optim, NAME, None)
    if existing is not None and existing is not CoatAdamW:
        raise RuntimeError(f"torch.optim.{NAME} is already set to {existing!r}; not replacing it")
    setattr(torch.optim, NAME, CoatAdamW)
    mark_zero_tested()


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
