"""Where train.py builds its model: whole on every rank, or (`meta_start`) so that each rank
only ever holds its own shard of the weights.

- FSDP2: the model is built on the meta device (no storage), edited there (recipes, FP8
  linears, hooks) and sharded by `fully_shard`; `materialize` then allocates each rank's
  shards on its device and draws their values (coat_ds.models.sharded_init).
- DeepSpeed ZeRO-3: built inside `deepspeed.zero.Init`, which partitions each module's
  parameters as soon as it is constructed; the partitions' values are then drawn the same way.
- FSDP1, ZeRO-1/2 and a plan searched at start (`memory_budget_gb`, measured on the whole
  model) build it whole: ZeRO-1/2 keep a full replica of the weights on every rank by design.

Drawn per shard, the initial weights depend on the seed and the device type, not on the
world size; they are not those of `Llama`'s constructor, which the whole-model start keeps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..integrations.deepspeed.engine import prepare_config
from ..kernels.layout import new_weight_guess
from ..models.llama import Llama, ModelConfig
from ..models.sharded_init import init_local_shards

__all__ = ["ModelStart", "model_start", "build_model", "materialize"]

# Buffers a model may hold at start, and their initial values (to_empty leaves them unset).
_BUFFER_INIT = {"fp8_weight_guess": new_weight_guess}


@dataclass(frozen=True)
class ModelStart:
    """How the model is built."""

    where: str  # "meta" (FSDP2: built without storage), "zero3" (inside deepspeed.zero.Init) or "whole"
    note: str  # the log line saying so, and why

    @property
    def sharded(self) -> bool:
        return self.where != "whole"


def model_start(cfg, ds) -> ModelStart:
    """`cfg`: the TrainConfig; `ds`: its read_ds_settings."""
    if not cfg.meta_start:
        return ModelStart("whole", "model start: the whole model on every rank (meta_start: false)")
    if cfg.memory_budget_gb:
        return ModelStart("whole", "model start: the whole model on every rank: the plan searched for "
                          "memory_budget_gb measures the unsharded model first")
    if cfg.engine == "fsdp" and cfg.fsdp_mode == "fsdp2":
        return ModelStart("meta", "model start: on the meta device; each rank allocates and initialises only its "
                          "FSDP2 shards (weights drawn per shard: seeded, the same at any world size)")
    if cfg.engine == "deepspeed" and ds.zero_stage == 3:
        return ModelStart("zero3", "model start: inside deepspeed.zero.Init; each rank keeps only its ZeRO-3 "
                          "partitions (weights drawn per partition: seeded, the same at any world size)")
    why = (f"ZeRO-{ds.zero_stage} keeps a full replica of the weights on every rank by design"
           if cfg.engine == "deepspeed" else "FSDP1 shards a whole model")
    return ModelStart("whole", f"model start: the whole model on every rank ({why})")


def build_model(start: ModelStart, mcfg: ModelConfig, seed: int, device: torch.device, ds_config) -> Llama:
    """The model, as `start` says; `ds_config`: the DeepSpeed JSON (ZeRO-3's partitioning)."""
    if start.where == "meta":
        with torch.device("meta"):
            return Llama(mcfg)
    if start.where == "zero3":
        import deepspeed

        with deepspeed.zero.Init(config_dict_or_path=prepare_config(ds_config)[0]):
            model = Llama(mcfg)
        init_local_shards(model, model.init_std, seed)
        return model
    # Initialised where it trains: a 7B model's CPU init takes minutes per rank (one OpenMP
    # thread each under a launcher).
    with device:
        return Llama(mcfg)


def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Give a sharded meta-device model (FSDP2) storage on `device` for its local shards
    and draw their values; its buffers take their initial values."""
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            init = _BUFFER_INIT.get(name.rsplit(".", 1)[-1])
            if init is None:
                raise ValueError(f"meta_start: no initial value known for buffer {name!r}; set meta_start: false")
            buf.copy_(init(buf.device))
    init_local_shards(model, model.init_std, seed)
