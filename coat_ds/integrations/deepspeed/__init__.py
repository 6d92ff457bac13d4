"""DeepSpeed: `initialize` (ZeRO 1/2/3 with CoatAdamW from the JSON), its checkpoints, the
registry that lets DeepSpeed's own `deepspeed.initialize` build CoatAdamW, and `config`, the
one reader of a DeepSpeed JSON. DeepSpeed itself is imported only when one of these runs."""
from .checkpoint import consolidate_checkpoint, load_checkpoint, load_fp32_checkpoint, save_checkpoint
from .engine import initialize, prepare_config, state_memory_report
from .registry import register_deepspeed

__all__ = ["initialize", "prepare_config", "state_memory_report", "save_checkpoint", "load_checkpoint",
           "consolidate_checkpoint", "load_fp32_checkpoint", "register_deepspeed"]
