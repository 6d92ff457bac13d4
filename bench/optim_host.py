"""Host time of CoatAdamW's step on CPU, with the Triton launch stubbed out: the Python
bookkeeping per tensor (state lookup, checks, address table) that a GPU step pays before its
one launch. 219 tensors shaped like a scaled-down Llama list (bench/optim_step.py's list case).

    python bench/optim_host.py                                    # this checkout
    PYTHONPATH=/path/to/other/checkout python bench/optim_host.py  # another version's code
"""
from __future__ import annotations

import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton backend on CPU tensors; nothing launches

import torch  # noqa: E402

from coat_ds import CoatAdamW  # noqa: E402
from coat_ds.kernels import adamw  # noqa: E402


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main() -> None:
    adamw._adamw_kernel = _NoLaunch()
    torch.manual_seed(0)
    layer = [(64,), (64, 64), (64, 64), (64, 64), (64, 64), (64,), (172, 64), (172, 64), (64, 172)]
    shapes = [(256, 64)] + layer * 24 + [(64,), (256, 64)]
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = CoatAdamW(params, lr=1e-4, weight_decay=0.01, backend="triton", min_quant_numel=0)
    opt.step()
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    times.sort()
    print(f"{len(params)} tensors: host ms/step min {times[0] * 1e3:.3f} median {times[len(times) // 2] * 1e3:.3f}")


if __name__ == "__main__":
    main()
