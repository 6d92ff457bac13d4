"""What train.py's FSDP engine takes from a DeepSpeed JSON, how it sizes optimizer state, and
how train.py and the profiler end the process group they run in.

One JSON stays the single source of truth for both engines: an FSDP run reads the same
micro-batch, gradient accumulation, clipping, BF16 switch and optimizer section that DeepSpeed
would, so `--engine deepspeed` and `--engine fsdp` train the same thing.
"""
from __future__ import annotations

import gc
import json
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .integrations.deepspeed import prepare_config
from .optim import CoatAdamW

__all__ = ["DsTrainSettings", "read_ds_settings", "optimizer_settings", "build_optimizer", "optimizer_state_bytes",
           "shutdown_distributed"]

# DeepSpeed's own switches in an Adam/AdamW `params` section that torch.optim does not take:
# `torch_adam` picks torch's implementation (what we use anyway), `adam_w_mode` is read below.
_DEEPSPEED_ONLY_ADAM_KEYS = ("torch_adam", "adam_w_mode")


@dataclass(frozen=True)
class DsTrainSettings:
    """The engine-independent part of a DeepSpeed JSON."""

    micro_batch: int  # sequences per rank per micro-step
    grad_accum: int  # micro-steps per optimizer step
    clip: float  # global gradient-norm clip (0: off)
    bf16: bool  # compute in BF16 (master weights and optimizer stay FP32)
    optimizer_type: str  # "CoatAdamW", "AdamW" or "Adam"
    optimizer_params: dict  # keyword arguments of that optimizer, validated


def _batch_sizes(ds: dict, world_size: int) -> tuple[int, int]:
    """DeepSpeed's rule: train_batch_size = micro-batch x accumulation x world size; any two
    of the three determine the third (accumulation defaults to 1)."""
    micro, accum, total = (ds.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                               "train_batch_size"))
    if micro is None and total is None:
        raise ValueError("DeepSpeed config needs train_micro_batch_size_per_gpu or train_batch_size")
    if micro is None:
        micro = total // ((accum or 1) * world_size)
    if accum is None:
        accum = total // (micro * world_size) if total is not None else 1
    if total is not None and total != micro * accum * world_size:
        raise ValueError(f"DeepSpeed config: train_batch_size {total} != micro-batch {micro} x "
                         f"gradient_accumulation_steps {accum} x world size {world_size}")
    if micro < 1 or accum < 1:
        raise ValueError(f"DeepSpeed config gives micro-batch {micro}, accumulation {accum}; both must be >= 1")
    return int(micro), int(accum)


def read_ds_settings(path: str, world_size: int) -> DsTrainSettings:
    """Read the settings an FSDP run shares with DeepSpeed from the JSON at `path`."""
    with open(path) as fh:
        ds = json.load(fh)
    if (ds.get("fp16") or {}).get("enabled"):
        # FP16 needs loss scaling, which DeepSpeed does and the FSDP path does not.
        raise ValueError(f"{path}: fp16 is not supported by the FSDP engine; use bf16")
    micro, accum = _batch_sizes(ds, world_size)
    kind, params = optimizer_settings(ds, path)
    return DsTrainSettings(micro, accum, float(ds.get("gradient_clipping", 0.0)),
                           bool((ds.get("bf16") or {}).get("enabled", False)), kind, params)


def optimizer_settings(ds: dict, path: str) -> tuple[str, dict]:
    """("CoatAdamW" | "AdamW" | "Adam", keyword arguments) of the JSON's optimizer section,
    without DeepSpeed-only switches; CoatAdamW's are validated as the DeepSpeed path does."""
    section = ds.get("optimizer") or {}
    kind = str(section.get("type", ""))
    _, coat_kwargs = prepare_config(ds)
    if coat_kwargs is not None:
        return "CoatAdamW", coat_kwargs
    if kind.lower() not in ("adamw", "adam"):
        raise ValueError(f"{path}: optimizer.type must be CoatAdamW, AdamW or Adam, got {kind!r}")
    params = dict(section.get("params") or {})
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
    kind = "AdamW" if kind.lower() == "adamw" or params.get("adam_w_mode", True) else "Adam"
    params = {k: v for k, v in params.items() if k not in _DEEPSPEED_ONLY_ADAM_KEYS}
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    return kind, params


def build_optimizer(settings: DsTrainSettings, params) -> torch.optim.Optimizer:
    cls = {"CoatAdamW": CoatAdamW, "AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[settings.optimizer_type]
    return cls(params, **settings.optimizer_params)


def optimizer_state_bytes(optim: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state held by this rank: every state tensor but the step counter,
    counting a DTensor's local shard (its global numel would overstate every rank by the
    world size)."""
    total = 0
    for state in optim.state.values():
        for key, t in state.items():
            if torch.is_tensor(t) and key != "step":
                local = t.to_local() if isinstance(t, DTensor) else t
                total += local.numel() * local.element_size()
    return total


def shutdown_distributed() -> None:
    """End the default process group, on every rank together, before the interpreter exits.

    A gloo process group destroyed while the interpreter finalizes can SIGABRT ("terminate
    called without an active exception") and turn a finished run into a failed exit status.
    The engine's objects hold the group (FSDP2's parameter groups keep it, DeepSpeed's engine
    too) and sit in reference cycles, so they would only die in that finalization: collect
    them now, then end the group."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    gc.collect()
