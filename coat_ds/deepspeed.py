"""`coat_ds.deepspeed.initialize`: the public short name for the DeepSpeed integration.

    engine, optimizer, _, scheduler = coat_ds.deepspeed.initialize(model=model, config="ds.json")
"""
from .integrations.deepspeed import initialize, prepare_config, state_memory_report
from .integrations.deepspeed_checkpoint import (
    consolidate_checkpoint,
    load_checkpoint,
    load_fp32_checkpoint,
    save_checkpoint,
)

__all__ = ["initialize", "prepare_config", "state_memory_report", "load_checkpoint", "save_checkpoint",
           "consolidate_checkpoint", "load_fp32_checkpoint"]
