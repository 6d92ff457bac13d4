"""Host time of CoatAdamW's step on CPU, with the Triton launch stubbed out: the Python
bookkeeping per tensor (state lookup, checks, address table) that a GPU step pays before its
one launch. 219 tensors shaped like a scaled-down Llama list (bench/optim_step.py's list case).

    python bench/optim_host.py                                    # this checkout
    PYTHONPATH=/path/to/other/checkout python bench/optim_host.py  # another version's code
    python bench/optim_host.py --profile                          # where the time goes (cProfile)
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton backend on CPU tensors; nothing launches

import torch  # noqa: E402

from coat_ds import CoatAdamW  # noqa: E402
from coat_ds.kernels import adamw  # noqa: E402


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", action="store_true", help="print the 15 functions of most own time over 200 steps")
    ap.add_argument("--min-quant-numel", type=int, default=0,
                    help="CoatAdamW's option (4096: the norms keep FP32 moments, a second launch, as on the GPU)")
    args = ap.parse_args()
    adamw._adamw_kernel = _NoLaunch()
    torch.manual_seed(0)
    layer = [(64,), (64, 64), (64, 64), (64, 64), (64, 64), (64,), (172, 64), (172, 64), (64, 172)]
    shapes = [(256, 64)] + layer * 24 + [(64,), (256, 64)]
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = CoatAdamW(params, lr=1e-4, weight_decay=0.01, backend="triton",
                    min_quant_numel=args.min_quant_numel)
    opt.step()
    # Wall time, and this thread's CPU time: on a shared machine the wall time also counts
    # the time the thread waited for a core.
    times, cpu = [], []
    for _ in range(200):
        t0, c0 = time.perf_counter(), time.thread_time()
        opt.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    times.sort()
    cpu.sort()
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(lambda: [opt.step() for _ in range(200)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    print(f"{len(params)} tensors: host ms/step min {times[0] * 1e3:.3f} median {times[len(times) // 2] * 1e3:.3f}; "
          f"thread CPU ms/step min {cpu[0] * 1e3:.3f} median {cpu[len(cpu) // 2] * 1e3:.3f}")


if __name__ == "__main__":
    main()
