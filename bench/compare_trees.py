"""Table of bench/compare_trees.sh's logs: per round, the optimizer step (ms) and the activation
overhead (% over BF16 in the same process) of this checkout ("new") and the reference ("old").

    python bench/compare_trees.py DIR
"""
from __future__ import annotations

import glob
import json
import os
import re
import statistics
import sys

_ACT_ROW = re.compile(r"^(?P<model>Llama.*?)\s{2,}(?P<nums>[-\d.\s]+)$")


def optim_ms(path: str) -> dict[str, float]:
    with open(path) as f:
        rows = json.load(f)["rows"]
    return {r["case"]: r["ms"] for r in rows if r["optimizer"] == "coat"}


def act_overheads(path: str) -> dict[str, float]:
    """model -> step overhead %, the 'ovh %' column of act_memory.py's table."""
    out = {}
    with open(path) as f:
        lines = f.read().splitlines()
    header = next((ln for ln in lines if "ovh %" in ln), None)
    if header is None:
        return out
    for ln in lines[lines.index(header) + 1:]:
        m = _ACT_ROW.match(ln.strip())
        if m:
            nums = m["nums"].split()
            out[m["model"].strip()] = float(nums[8])  # act: bf16 fp8 x; peak: bf16 fp8 x; step: bf16 fp8 ovh
    return out


def main(folder: str) -> None:
    series: dict[tuple[str, str], dict[str, list[float]]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*_*_*.*"))):
        name = os.path.basename(path)
        m = re.match(r"(optim|act_compiled|act_eager)_(new|old)_\d+\.(json|log)$", name)
        if not m or (m[1] == "optim") != (m[3] == "json"):
            continue
        values = optim_ms(path) if m[1] == "optim" else act_overheads(path)
        for key, v in values.items():
            series.setdefault((m[1], key), {}).setdefault(m[2], []).append(v)
    print("| measure | case | old (per round) | new (per round) | new / old of the medians |")
    print("|---|---|---|---|---|")
    for (kind, key), sides in sorted(series.items()):
        old, new = sides.get("old", []), sides.get("new", [])
        unit = "ms" if kind == "optim" else "% ovh"
        ratio = ""
        if old and new:
            mo, mn = statistics.median(old), statistics.median(new)
            ratio = f"{mn / mo:.3f}" if kind == "optim" else f"{mn - mo:+.1f} pts"
        fmt = (lambda xs: " / ".join(f"{x:.2f}" for x in xs))
        print(f"| {kind} ({unit}) | {key} | {fmt(old)} | {fmt(new)} | {ratio} |")


if __name__ == "__main__":
    main(sys.argv[1])
