"""FSDP1's optimizer state for CoatAdamW: FSDP1 gathers and unflattens only FP32 tensors
shaped like its flat shards, so its checkpoints carry the moments in torch.optim.AdamW's layout
(dequantized FP32) and loading quantizes them again."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from ..optim.state import MOMENTS

__all__ = ["fsdp1_optim_state_dict", "fsdp1_load_optim_state_dict"]


def fsdp1_optim_state_dict(model: nn.Module, optim) -> dict:
    """FSDP1's optimizer state dict (full or sharded, per the `FSDP.state_dict_type` in
    force) of a CoatAdamW, in torch.optim.AdamW's layout: FSDP1 gathers and unflattens
    only FP32 tensors shaped like its flat shards, so the moments go through FP32."""
    _ensure_state(optim)
    fp32 = optim.fp32_state_dict()
    # One moment per call: FSDP1 gathers every state name of a FlatParameter into one
    # reused buffer and returns views of it, which alias when nothing copies them off the
    # device (CPU training): exp_avg would come back holding exp_avg_sq.
    merged: dict | None = None
    for name in MOMENTS:
        only = {pid: {k: v for k, v in state.items() if k not in MOMENTS or k == name}
                for pid, state in fp32["state"].items()}
        osd = FSDP.optim_state_dict(model, optim, {**fp32, "state": only})
        if merged is None:
            merged = osd
        else:
            for fqn, state in osd["state"].items():
                merged["state"].setdefault(fqn, {}).update({k: v for k, v in state.items() if k == name})
    return merged


def fsdp1_load_optim_state_dict(model: nn.Module, optim, osd: dict) -> None:
    """Inverse of `fsdp1_optim_state_dict` (under the same `FSDP.state_dict_type`): this
    rank's shard of the FP32 moments, quantized again into CoatAdamW's state."""
    optim.load_fp32_state_dict(FSDP.optim_state_dict_to_load(model, optim, osd))


@torch.no_grad()
def _ensure_state(optim) -> None:
    """Create the optimizer's state if it has none yet (a step with zero gradients and zero
    learning rate), so a checkpoint can be loaded into a freshly built optimizer."""
    params = [p for g in optim.param_groups for p in g["params"]]
    if optim.state or any(p.grad is not None for p in params):
        return  # state exists, or gradients are pending that a step would consume
    lrs = [g["lr"] for g in optim.param_groups]
    for g in optim.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optim.step()
    for g, lr in zip(optim.param_groups, lrs):
        g["lr"] = lr
    optim.zero_grad(set_to_none=True)
