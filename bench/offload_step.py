"""ZeRO-Offload's host step: CoatAdamW on a CPU partition against torch's AdamW, side by side.

    python bench/offload_step.py [--numel 8388608] [--iters 7] [--fallback] [--whole] [--no-ds] [--out r.json]

One flat FP32 partition with an FP32 gradient, what DeepSpeed hands the optimizer under
`offload_optimizer: cpu`. Cases, timed in turns (one step of each per round, so that load
from other processes falls on all of them alike), median and min wall time per step, and the
median CPU time of the process per step (all its threads; on a shared machine wall time also
counts the time spent waiting for a core, CPU time much less so):
- torch AdamW(foreach=True), the baseline every ratio is taken against;
- CoatAdamW's host step (kernels/host.py: the fused C++ kernel, built on first use);
- with --fallback, the host step's fallback where the kernel does not build (the reference
  step over group-aligned chunks on the threads);
- with --whole, the reference step on the whole partition at once (the path before host.py);
- DeepSpeedCPUAdam (FP32 states, DeepSpeed's AVX C++ op), where it builds (JIT, first use).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from coat_ds import CoatAdamW  # noqa: E402
from coat_ds.kernels import AdamWHyper, AdamWSlot, host, host_native  # noqa: E402
from coat_ds.kernels import reference as R  # noqa: E402


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def make(numel: int, seed: int = 0) -> torch.nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(numel, generator=g) * 0.02)
    p.grad = torch.randn(numel, generator=g) * 1e-3
    return p


def deepspeed_cpu_adam(params):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, lr=1e-4, weight_decay=0.01, adamw_mode=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=8_388_608)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--fallback", action="store_true", help="also time the chunked reference (no C++ kernel)")
    ap.add_argument("--whole", action="store_true", help="also time the reference step on the whole partition")
    ap.add_argument("--no-ds", action="store_true", help="skip DeepSpeedCPUAdam")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    steps = {}
    p = make(args.numel)
    steps["torch AdamW foreach"] = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, foreach=True).step
    p = make(args.numel)
    steps["CoatAdamW host step (fused C++ kernel)"] = CoatAdamW([p], lr=1e-4, weight_decay=0.01).step
    if host_native.library() is None:
        raise SystemExit("the host kernel did not build (see the log line above)")
    hyper = AdamWHyper.at_step(10, 1e-4, 0.9, 0.999, 1e-8, 0.01)

    def slot() -> AdamWSlot:
        p = make(args.numel)
        zeros = torch.zeros(args.numel)
        return AdamWSlot(p.data, p.grad, R.quantize_groups(zeros), R.quantize_groups(zeros))

    if args.fallback:
        chunked = slot()
        steps["host step fallback: chunked reference"] = lambda: host.adamw_step([chunked], hyper, fused=False)
    if args.whole:
        whole = slot()
        steps["reference step, whole partition"] = lambda: R.adamw_step([whole], hyper)
    ds_note = "skipped (--no-ds)"
    if not args.no_ds:
        try:
            p = make(args.numel)
            steps["DeepSpeedCPUAdam (FP32 states)"] = deepspeed_cpu_adam([p]).step
            ds_note = "built"
        except Exception as e:  # the JIT build needs a compiler and DeepSpeed's op sources
            ds_note = f"did not build: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    print(f"DeepSpeedCPUAdam: {ds_note}", flush=True)

    for fn in steps.values():  # state allocation, first-use builds
        fn()
    times = {k: [] for k in steps}
    cpu = {k: [] for k in steps}
    for _ in range(args.iters):
        for name, fn in steps.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
            cpu[name].append((time.process_time() - c0) * 1e3)
    base = statistics.median(times["torch AdamW foreach"])
    cpu_base = statistics.median(cpu["torch AdamW foreach"])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n{cpu_name()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, {date}, "
          f"load average {os.getloadavg()[0]:.1f}; "
          f"{args.numel:,} FP32 elements, {args.iters} rounds; jobs of {host.HOST_CHUNK_ELEMS} elements; "
          f"kernel built for {torch.backends.cpu.get_cpu_capability()}")
    print("| step | median ms | min ms | median / torch foreach | median CPU ms | CPU / torch foreach |")
    print("|---|---|---|---|---|---|")
    rows = []
    for name, ts in times.items():
        med, cmed = statistics.median(ts), statistics.median(cpu[name])
        rows.append({"step": name, "median_ms": med, "min_ms": min(ts), "ratio": med / base,
                     "cpu_median_ms": cmed, "cpu_ratio": cmed / cpu_base, "wall_ms": ts, "cpu_ms": cpu[name]})
        print(f"| {name} | {med:.1f} | {min(ts):.1f} | {med / base:.2f}x | {cmed:.1f} | {cmed / cpu_base:.2f}x |")
    if args.out:
        Path(args.out).write_text(json.dumps({"cpu": cpu_name(), "threads": torch.get_num_threads(), "date": date,
                                              "numel": args.numel, "simd": torch.backends.cpu.get_cpu_capability(),
                                              "deepspeed_cpu_adam": ds_note, "rows": rows,
                                              "loadavg": os.getloadavg()},
                                             indent=1))


if __name__ == "__main__":
    main()
