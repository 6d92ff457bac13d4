"""How train.py and the profiler end the process group they ran in, whichever engine held it."""
from __future__ import annotations

import gc

import torch.distributed as dist

__all__ = ["shutdown_distributed"]


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
