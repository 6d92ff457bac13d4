"""Where the GPU waits in one training step's chrome trace (`bench/fp8_linear.py --trace DIR`,
`train.py --trace FILE`): GPU time by kernel category, the top kernels by time, and the idle
gaps, each put on the CPU op that launched the kernel after it. Runs on CPU.

    python bench/trace_gaps.py DIR/7b_coat_fp8.json.gz --top 12
"""
from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import sys


def gaps(path: str, top: int, min_us: float = 5.0) -> list[str]:
    """A chrome trace's GPU time by kernel category, its `top` kernels by time, and its idle
    gaps, each put on the CPU op that launched the kernel after it."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e["ts"], e["ts"] + e["dur"], e["name"], e.get("args", {}).get("correlation"))
                 for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not gpu:
        return [f"{path}: no GPU kernels in the trace (a CPU run)"]
    launches = {e["args"]["correlation"]: e for e in events  # Triton launches through the driver API
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function"):
            ops[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    starts = {t: [o[0] for o in sorted(v)] for t, v in ops.items()}
    ops = {t: sorted(v) for t, v in ops.items()}

    def where(launch, at=None) -> str:
        """The ops enclosing `launch`, or what its thread was running at time `at`."""
        if launch is None:
            return "(launch not traced)"
        tid, ts = launch["tid"], launch["ts"] if at is None else at
        i = bisect.bisect_right(starts.get(tid, []), ts)
        stack = [n for s, e, n in ops.get(tid, [])[max(0, i - 400):i] if e >= ts]
        keep = [n for n in stack if not n.startswith(("aten::", "cuda", "<built-in"))] or stack
        return " > ".join(n[:70] for n in keep[-2:]) or "(no enclosing op)"

    by_cat, idle, end, holes = collections.Counter(), 0.0, gpu[0][0], collections.Counter()
    busy = collections.Counter()  # what the launching thread ran when the GPU went idle
    by_name, calls = collections.Counter(), collections.Counter()
    for start, stop, name, corr in gpu:
        by_cat[category(name)] += stop - start
        by_name[name] += stop - start
        calls[name] += 1
        if start > end:
            idle += start - end
            if start - end >= min_us:
                holes[where(launches.get(corr)), name[:60]] += start - end
                busy[where(launches.get(corr), at=end)] += start - end
        end = max(end, stop)
    lines = ["| category | ms |", "|---|---|"] + [f"| {c} | {us / 1e3:.1f} |" for c, us in by_cat.most_common()]
    lines += [f"| sum | {sum(by_cat.values()) / 1e3:.1f} |", "", "| kernel | category | calls | ms |", "|---|---|---|---|"]
    lines += [f"| {n[:90]} | {category(n)} | {calls[n]} | {us / 1e3:.2f} |" for n, us in by_name.most_common(top)]
    lines += ["",
              f"GPU span {(end - gpu[0][0]) / 1e3:.1f} ms, idle {idle / 1e3:.1f} ms; gaps >= {min_us:g} us by launching op:",
              "| idle ms | launched from | next kernel |", "|---|---|---|"]
    lines += [f"| {us / 1e3:.2f} | {w} | {n} |" for (w, n), us in holes.most_common(top)]
    lines += ["", "The same gaps by what the launching thread was running as the GPU went idle:",
              "| idle ms | host in |", "|---|---|"]
    return lines + [f"| {us / 1e3:.2f} | {w} |" for w, us in busy.most_common(top)]


def category(name: str) -> str:
    if name.startswith("nvjet") or "gemm" in name.lower() or "cutlass" in name:
        # cuBLASLt's nvjet names spell the operand types: q/r are FP8 (E4M3/E5M2).
        return "GEMM, FP8" if name.startswith("nvjet_sm90_q") else "GEMM, 16/32-bit"
    if "flash" in name or "fmha" in name or "sdpa" in name:
        return "attention"
    if "nccl" in name.lower():
        return "communication"
    if name.startswith("triton_"):
        return "Inductor kernels"
    return "optimizer" if "adam" in name.lower() or "FusedOpti" in name else "other"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a chrome trace, .json or .json.gz")
    ap.add_argument("--top", type=int, default=25, help="rows listed")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    print("\n".join(gaps(args.trace, args.top)))


if __name__ == "__main__":
    main()
