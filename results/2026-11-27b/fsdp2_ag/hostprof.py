"""train.py with its --trace profiler swapped for cProfile: the host's Python time over the
traced steps, as text at the trace path. Run as train.py is run (one rank, no launcher):
    python results/2026-11-27b/fsdp2_ag/hostprof.py --fsdp --config configs/1b.yaml --compile ...
        --max-steps 14 --trace /tmp/prof.txt --trace-after 10"""
import cProfile
import os
import io
import pstats
import runpy
import sys

import torch.profiler


class _HostProfile:
    def __init__(self, *args, **kwargs):
        self.prof = cProfile.Profile()

    def start(self):
        self.prof.enable()

    def stop(self):
        self.prof.disable()

    def export_chrome_trace(self, path):
        out = io.StringIO()
        stats = pstats.Stats(self.prof, stream=out)
        stats.sort_stats("tottime").print_stats(35)
        stats.sort_stats("cumulative").print_stats(70)
        with open(path, "w") as f:
            f.write(out.getvalue())


sys.path.insert(0, os.getcwd())  # the repo root, as train.py finds coat_ds
torch.profiler.profile = _HostProfile
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
