"""Where a GPU waits: idle gaps between kernels in a torch.profiler chrome trace, each put on
the CPU op that launched the kernel after it, and the host syncs that made the GPU wait.

A step whose CUDA-event time exceeds the sum of its kernels spends the difference idle; this
says which host work the GPU was waiting for.

    python bench/gpu_gaps.py trace.json.gz [--min-us 5] [--top 25] [--kernels 20]
"""
from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json

_GPU = ("kernel", "gpu_memcpy", "gpu_memset")
_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
          "cudaMemcpyAsync", "cudaStreamWaitEvent")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


class _Stacks:
    """The CPU ops enclosing a time on a thread (ops nest by their intervals)."""

    def __init__(self, events: list[dict]):
        self.by_tid = collections.defaultdict(list)
        for e in events:
            if e.get("cat") in ("cpu_op", "user_annotation", "python_function"):
                self.by_tid[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        for ops in self.by_tid.values():
            ops.sort()
        self.starts = {t: [o[0] for o in ops] for t, ops in self.by_tid.items()}

    def at(self, tid, ts: float) -> list[str]:
        ops = self.by_tid.get(tid, [])
        i = bisect.bisect_right(self.starts.get(tid, []), ts)
        return [name for s, end, name in ops[max(0, i - 400):i] if end >= ts]


def _label(stack: list[str], depth: int) -> str:
    keep = [n for n in stack if not n.startswith(("aten::", "cuda", "<built-in"))] or stack
    return " > ".join(n[:70] for n in keep[-depth:]) or "(no enclosing op)"


def analyse(events: list[dict], min_us: float, depth: int) -> dict:
    gpu = sorted((e["ts"], e["ts"] + e["dur"], e["name"], e.get("args", {}).get("correlation"))
                 for e in events if e.get("cat") in _GPU)
    # Triton's kernels are launched through the driver API, the rest through the runtime.
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    stacks = _Stacks(events)
    busy = idle = 0.0
    end = gpu[0][0]
    gaps = collections.defaultdict(lambda: [0.0, 0])
    for start, stop, name, corr in gpu:
        if start > end:
            gap = start - end
            idle += gap
            if gap >= min_us:
                launch = runtime.get(corr)
                where = _label(stacks.at(launch["tid"], launch["ts"]), depth) if launch else "(launch not traced)"
                gaps[where, name[:60]][0] += gap
                gaps[where, name[:60]][1] += 1
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    syncs = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") == "cuda_runtime" and e["name"] in _SYNCS and e["dur"] >= min_us:
            key = f"{e['name']} in {_label(stacks.at(e['tid'], e['ts']), depth)}"
            syncs[key][0] += e["dur"]
            syncs[key][1] += 1
    return dict(span_ms=(end - gpu[0][0]) / 1e3, busy_ms=busy / 1e3, idle_ms=idle / 1e3, gaps=gaps, syncs=syncs)


def category(name: str) -> str:
    if name.startswith("nvjet") or "gemm" in name.lower() or "cutlass" in name:
        # cuBLASLt's nvjet names spell the operand types: q/r are FP8 (E4M3/E5M2).
        return "GEMM, FP8" if name.startswith("nvjet_sm90_q") else "GEMM, 16/32-bit"
    if "flash" in name or "fmha" in name or "sdpa" in name:
        return "attention"
    if name.startswith("triton_"):
        return "Inductor kernels"
    if "adam" in name.lower() or "FusedOpti" in name:
        return "optimizer"
    return "other"


def kernel_table(events: list[dict], top: int) -> list[str]:
    """CUDA time by category, then the `top` kernels by total time."""
    by_cat, by_name, calls = collections.Counter(), collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") in _GPU:
            by_cat[category(e["name"])] += e["dur"]
            by_name[e["name"][:100]] += e["dur"]
            calls[e["name"][:100]] += 1
    rows = ["| category | ms |", "|---|---|"] + [f"| {c} | {us / 1e3:.1f} |" for c, us in by_cat.most_common()]
    rows += [f"| sum | {sum(by_cat.values()) / 1e3:.1f} |", "", "| ms | calls | kernel |", "|---|---|---|"]
    rows += [f"| {us / 1e3:.2f} | {calls[n]} | {n} |" for n, us in by_name.most_common(top)]
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--min-us", type=float, default=5.0, help="gaps shorter than this are counted, not listed")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--depth", type=int, default=2, help="enclosing ops named per gap")
    ap.add_argument("--kernels", type=int, default=0, help="also list CUDA time by category and the top N kernels")
    args = ap.parse_args()
    events = load(args.trace)
    if args.kernels:
        print("\n".join(kernel_table(events, args.kernels)) + "\n")
    r = analyse(events, args.min_us, args.depth)
    print(f"GPU span {r['span_ms']:.1f} ms, kernels busy {r['busy_ms']:.1f} ms, idle {r['idle_ms']:.1f} ms")
    listed = sum(v[0] for v in r["gaps"].values()) / 1e3
    print(f"idle in gaps >= {args.min_us:g} us: {listed:.1f} ms; by the host op that launched the next kernel:")
    print("| idle ms | gaps | launched from | next kernel |\n|---|---|---|---|")
    for (where, nxt), (us, n) in sorted(r["gaps"].items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"| {us / 1e3:.2f} | {n} | {where} | {nxt} |")
    print("\nhost waits on the GPU (sync calls):\n| ms | calls | call |\n|---|---|---|")
    for key, (us, n) in sorted(r["syncs"].items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"| {us / 1e3:.2f} | {n} | {key} |")


if __name__ == "__main__":
    main()
