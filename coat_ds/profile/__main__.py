"""`python -m coat_ds.profile --model small --budget-gb 0.05`: see docs/profiler.md."""
from ..integrations.process_group import shutdown_distributed
from .options import parse_options
from .run import profile

if __name__ == "__main__":
    profile(parse_options())
    shutdown_distributed()
