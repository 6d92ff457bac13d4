"""Two builds of the host AdamW kernel side by side, in one process, on one thread.

    git show <rev>:coat_ds/kernels/host_adamw.cpp > /tmp/old/host_adamw.cpp   # (and host_fp8.h if it has one)
    python bench/host_kernel_ab.py /tmp/old/host_adamw.cpp [--numel 4194304] [--iters 9]

Builds the given source and this tree's (torch's JIT builder, the flags host_native.py
uses) and runs one step of each in turn on the same kind of partition: FP32 parameter and
gradient, E4M3/E4M3 moments with DRE and per-group skip counts. It reports CPU time of the
calling thread (min and median), which a loaded machine inflates much less than wall time:
each ratio is taken within one run.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from coat_ds.kernels import AdamWHyper, AdamWSlot, host_native  # noqa: E402
from coat_ds.kernels import reference as R  # noqa: E402
from coat_ds.kernels.fp8 import get_format  # noqa: E402


def build(source: Path) -> ctypes.CDLL:
    from torch.utils.cpp_extension import load

    cap = torch.backends.cpu.get_cpu_capability()
    files = [source, *source.parent.glob("*.h")]
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]
    path = load(name=f"coat_ds_host_ab_{cap.lower()}_{digest}", sources=[str(source)], is_python_module=False,
                extra_cflags=host_native._COMMON + host_native._SIMD.get(cap, ["-DCPU_CAPABILITY=DEFAULT"]))
    lib = ctypes.CDLL(path)
    lib.coat_host_adamw_step.argtypes, lib.coat_host_adamw_step.restype = host_native._ARGTYPES, ctypes.c_int64
    return lib


def partition(numel: int) -> AdamWSlot:
    g = torch.Generator().manual_seed(0)
    return AdamWSlot(torch.randn(numel, generator=g) * 0.02, torch.randn(numel, generator=g) * 1e-3,
                     R.quantize_groups(torch.randn(numel, generator=g) * 1e-3),
                     R.quantize_groups(torch.randn(numel, generator=g).square() * 1e-6),
                     torch.zeros(1, numel // 128, dtype=torch.int32))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("other", type=Path, help="host_adamw.cpp of the build to compare with")
    ap.add_argument("--numel", type=int, default=1 << 22)
    ap.add_argument("--iters", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    libs = {"other": build(args.other), "this tree": build(host_native._SOURCE)}
    fm = get_format("e4m3")
    consts = host_native.step_consts(AdamWHyper.at_step(10, 1e-4, 0.9, 0.999, 1e-8, 0.01), fm, fm)
    slots = {k: partition(args.numel) for k in libs}
    heads = {k: host_native.slot_args(s, fm, fm, args.numel) for k, s in slots.items()}
    groups = args.numel // 128
    times = {k: [] for k in libs}
    for _ in range(args.iters):
        for k, lib in libs.items():
            t0 = time.thread_time()
            host_native.step_range(lib, heads[k], 128, consts, True, 0, groups)
            times[k].append(time.thread_time() - t0)
    base = min(times["other"])
    print(f"{args.numel:,} elements, 1 thread, {torch.backends.cpu.get_cpu_capability()}, thread CPU time")
    for k, ts in times.items():
        print(f"{k}: min {min(ts) * 1e3:.1f} ms ({min(ts) / args.numel * 1e9:.2f} ns/element), "
              f"median {statistics.median(ts) * 1e3:.1f} ms, min / other's min {min(ts) / base:.2f}")


if __name__ == "__main__":
    main()
