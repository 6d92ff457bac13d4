"""What train.py's engines take from a DeepSpeed JSON, and how it builds and sizes their
optimizer.

One JSON stays the single source of truth for both engines, read once by `read_ds_settings`:
an FSDP run takes the same micro-batch, gradient accumulation, clipping, BF16 switch and
optimizer section that DeepSpeed would, so `--engine deepspeed` and `--engine fsdp` train the
same thing, and a value that DeepSpeed would read loosely is refused for both.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config.checks import ConfigError, boolean, choice, integer, number
from ..config import AdamWHyperparams
from ..integrations.deepspeed.config import (OPTIMIZERS, batch_sizes, check_zero_keys, gradient_clipping,
                                             load_ds_config, precision, zero_stage)
from ..integrations.deepspeed.engine import optimizer_settings
from ..optim.state import state_bytes

__all__ = ["DsTrainSettings", "read_ds_settings", "clipping_off_note", "build_optimizer", "optimizer_state_bytes"]

_ENGINES = ("deepspeed", "fsdp")


@dataclass(frozen=True)
class DsTrainSettings:
    """The engine-independent part of a DeepSpeed JSON, as one engine will run it."""

    engine: str  # the engine that runs it: "deepspeed" or "fsdp" (the latter takes no fp16, only our optimizers)
    micro_batch: int  # sequences per rank per micro-step, >= 1
    grad_accum: int  # micro-steps per optimizer step, >= 1
    clip: float  # global gradient-norm clip, >= 0 (0: off; the JSON's values <= 0 mean off, as in DeepSpeed)
    bf16: bool  # compute in BF16 (master weights and optimizer stay FP32)
    fp16: bool  # compute in FP16 with DeepSpeed's loss scaling (DeepSpeed engine only)
    zero_stage: int  # zero_optimization.stage, 0-3 (the FSDP engine shards fully whatever it says)
    optimizer_type: str  # "CoatAdamW", "AdamW", "Adam", or under DeepSpeed another of its optimizers
    optimizer_params: dict  # keyword arguments of that optimizer (ours: checked by building it once)

    def __post_init__(self):
        choice("engine", self.engine, _ENGINES)
        integer("micro_batch", self.micro_batch, lo=1)
        integer("grad_accum", self.grad_accum, lo=1)
        number("clip", self.clip, lo=0.0)
        boolean("bf16", self.bf16)
        boolean("fp16", self.fp16)
        integer("zero_stage", self.zero_stage, lo=0, hi=3)
        if self.engine == "fsdp":
            if self.fp16:
                # FP16 needs loss scaling, which DeepSpeed does and the FSDP path does not.
                raise ConfigError("fp16.enabled", True, "false under the FSDP engine (use bf16)")
            choice("optimizer.type", self.optimizer_type, tuple(OPTIMIZERS))
        if self.optimizer_type in OPTIMIZERS:
            _check_optimizer_params(self.optimizer_type, self.optimizer_params)


def _check_optimizer_params(kind: str, params: dict) -> None:
    """The optimizer's own checks, run now on a one-element parameter, so that a bad value
    fails before any model or engine is built; the error names `optimizer.params`."""
    hyper = {k: params[k] for k in ("lr", "betas", "eps", "weight_decay") if k in params}
    try:
        AdamWHyperparams(**hyper)
        OPTIMIZERS[kind]([torch.nn.Parameter(torch.zeros(1))], **params)
    except (TypeError, ValueError) as e:
        raise ValueError(f"optimizer.params of {kind}: {e}") from None


def read_ds_settings(path, world_size: int, engine: str = "fsdp") -> DsTrainSettings:
    """Read and check what `engine` takes from the DeepSpeed JSON at `path` (or a dict),
    at `world_size` ranks. Errors name the file, the key, the value and what is allowed."""
    ds = load_ds_config(path)
    try:
        micro, accum = batch_sizes(ds, world_size)
        bf16, fp16 = precision(ds)
        kind, params = optimizer_settings(ds, "", engine)
        if engine == "fsdp":  # DeepSpeed checks them itself, by its installed version's rules
            check_zero_keys(ds)
        return DsTrainSettings(engine, micro, accum, gradient_clipping(ds), bf16, fp16, zero_stage(ds), kind, params)
    except ConfigError as e:
        raise ConfigError(e.key, e.value, e.allowed, _where(path)) from None
    except ValueError as e:
        raise ValueError(f"{_where(path)}: {e}") from None


def clipping_off_note(path) -> str | None:
    """The log line for a JSON whose `gradient_clipping` is <= 0, which turns clipping off
    (DeepSpeed clips only above 0, and both engines follow it), else None."""
    clip = load_ds_config(path).get("gradient_clipping")
    if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip <= 0:
        return (f"gradient clipping: OFF (gradient_clipping is {clip} in {_where(path)}; a value <= 0 turns it off, "
                "as in DeepSpeed)")
    return None


def _where(path) -> str:
    return "DeepSpeed config" if isinstance(path, dict) else str(path)


def build_optimizer(settings: DsTrainSettings, params, **overrides) -> torch.optim.Optimizer:
    """The JSON's optimizer over `params`, `overrides` replacing keyword arguments of its params."""
    return OPTIMIZERS[settings.optimizer_type](params, **{**settings.optimizer_params, **overrides})


def optimizer_state_bytes(optim: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state held by this rank: every state tensor but the step counter,
    a DTensor's local shard (`coat_ds.optim.state.state_bytes`)."""
    return state_bytes(*optim.state.values())
