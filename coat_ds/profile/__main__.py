"""`python -m coat_ds.profile --model small --budget-gb 0.05`: see docs/profiler.md."""
import torch.distributed as dist

from .options import parse_options
from .run import profile

if __name__ == "__main__":
    profile(parse_options())
    if dist.is_available() and dist.is_initialized():
        # A gloo group still alive while the interpreter shuts down can SIGABRT and turn a
        # finished run into a failed exit status: end it here, on every rank together.
        dist.barrier()
        dist.destroy_process_group()
