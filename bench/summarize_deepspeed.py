"""Table of a bench/train_deepspeed.sh run: one row per DeepSpeed config.

    python bench/summarize_deepspeed.py runs/bench > table.md

tokens/s is the median over logged windows after the first (which holds start-up and
compilation); peak memory is the largest over the run and over ranks; optimizer state is the
largest rank's moment bytes after the first step; loss is the last logged training loss.
"""
from __future__ import annotations

import glob
import json
import os
import statistics
import sys


def summarize(out: str) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "*.jsonl"))):
        recs = [json.loads(line) for line in open(path)]
        train = [r for r in recs if "loss" in r]
        state = [r["optimizer_state_gb"] for r in recs if "optimizer_state_gb" in r]
        if not train:
            continue
        speeds = [r["tokens_per_s"] for r in train[1:]] or [train[0]["tokens_per_s"]]
        rows.append({"config": os.path.basename(path)[:-len(".jsonl")], "steps": train[-1]["step"],
                     "loss": train[-1]["loss"], "tokens_per_s": statistics.median(speeds),
                     "peak_mem_gb": max(r["peak_mem_gb"] for r in train),
                     "optimizer_state_gb": state[0] if state else float("nan")})
    return rows


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "runs/bench"
    rows = summarize(out)
    device = open(os.path.join(out, "device.txt")).read().strip() if os.path.exists(os.path.join(out, "device.txt")) else "?"
    print(f"device: {device}\n")
    print("| config | steps | loss | tokens/s | peak mem / GPU (GB) | optimizer state / GPU (GB) | state vs bf16 | tokens/s vs bf16 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    by_name = {r["config"]: r for r in rows}
    for r in rows:
        base = by_name.get(r["config"].replace("coat_", "bf16_")) if r["config"].startswith("coat_") else None
        ratio_state = f"{r['optimizer_state_gb'] / base['optimizer_state_gb']:.3f}x" if base else ""
        ratio_speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}x" if base else ""
        print(f"| {r['config']} | {r['steps']} | {r['loss']:.4f} | {r['tokens_per_s']:,.0f} | {r['peak_mem_gb']:.2f} | "
              f"{r['optimizer_state_gb']:.4g} | {ratio_state} | {ratio_speed} |")


if __name__ == "__main__":
    main()
