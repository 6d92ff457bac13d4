"""DeepSpeed: `initialize` (ZeRO 1/2/3 with CoatAdamW from the JSON), its checkpoints, the
registry that lets DeepSpeed's own `deepspeed.initialize` build CoatAdamW, `config`, the one
reader of a DeepSpeed JSON, and torch.compile per decoder layer under ZeRO-3 (`zero3`).
DeepSpeed itself is imported only when one of these runs."""
from .checkpoint import consolidate_checkpoint, load_checkpoint, load_fp32_checkpoint, save_checkpoint
from .engine import initialize, prepare_config, state_memory_report
from .registry import register_deepspeed
from .zero3 import compile_zero3_layers

__all__ = ["initialize", "prepare_config", "state_memory_report", "save_checkpoint", "load_checkpoint",
           "consolidate_checkpoint", "load_fp32_checkpoint", "register_deepspeed", "compile_zero3_layers"]
