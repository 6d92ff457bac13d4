"""Combine loss_parity.py runs made with different seeds: per variant, the mean and spread
of the validation loss and of its paired difference to torch AdamW (same seed, same batches).

    python bench/parity_summary.py results/parity/compiled_seed*.json [--bound 0.01]

A claim of parity rests on the paired differences of 3+ seeds: the mean must be within
the bound, and the table shows the spread beside it so that one lucky seed cannot carry it.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys

_FINAL = re.compile(r"\[(?P<variant>\w+)\] final train (?P<train>\S+) val (?P<val>\S+) tokens/s (?P<tps>\S+)")


def read_run(path: str) -> dict:
    """A loss_parity.py record: its --out JSON, or its log (the first line is the run's meta
    as JSON, and each finished variant prints `[variant] final train T val V tokens/s S`)."""
    if path.endswith(".json"):
        with open(path) as f:
            return json.load(f)
    with open(path) as f:
        lines = f.read().splitlines()
    summary = {}
    for line in lines:
        m = _FINAL.match(line)
        if m:
            summary[m["variant"]] = dict(final_train_loss=float(m["train"]), val_loss=float(m["val"]),
                                         tokens_per_s=float(m["tps"]))
    return dict(meta=json.loads(lines[0]), summary=summary)


def merge_by_seed(runs: list[dict]) -> list[dict]:
    """One record per seed: the variants of several runs made with the same seed and setup."""
    merged: dict = {}
    for run in runs:
        entry = merged.setdefault(run["meta"].get("seed"), dict(meta=run["meta"], summary={}))
        for variant, s in run["summary"].items():
            if variant in entry["summary"]:
                raise ValueError(f"seed {run['meta'].get('seed')}: variant {variant!r} appears twice")
            entry["summary"][variant] = s
    return list(merged.values())


def summarize(runs: list[dict], bound: float) -> tuple[list[str], bool]:
    by_variant: dict[str, list[float]] = {}
    diffs: dict[str, list[float]] = {}
    tokens: dict[str, list[float]] = {}
    for run in runs:
        base = run["summary"].get("adamw")
        for variant, s in run["summary"].items():
            by_variant.setdefault(variant, []).append(s["val_loss"])
            tokens.setdefault(variant, []).append(s["tokens_per_s"])
            if base is not None and variant != "adamw":
                diffs.setdefault(variant, []).append(s["val_loss"] / base["val_loss"] - 1)
    seeds = [r["meta"].get("seed") for r in runs]
    lines = [f"seeds: {seeds}",
             "| variant | val loss mean ± sd | paired diff vs AdamW mean ± sd | per seed | within bound |",
             "|---|---|---|---|---|"]
    ok = True
    for variant, vals in by_variant.items():
        sd = statistics.stdev(vals) if len(vals) > 1 else float("nan")
        d = diffs.get(variant)
        if d:
            dm = statistics.mean(d)
            dsd = statistics.stdev(d) if len(d) > 1 else float("nan")
            within = abs(dm) <= bound
            ok &= within
            cells = (f"{dm * 100:+.2f}% ± {dsd * 100:.2f}%", " / ".join(f"{x * 100:+.2f}%" for x in d),
                     "yes" if within else "**no**")
        else:
            cells = ("(baseline)", "", "")
        lines.append(f"| {variant} | {statistics.mean(vals):.4f} ± {sd:.4f} | " + " | ".join(cells) + " |")
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="loss_parity.py --out JSON files or logs; runs of one seed are merged")
    ap.add_argument("--bound", type=float, default=0.01, help="allowed |mean paired difference| (0.01 = 1%%)")
    args = ap.parse_args(argv)
    runs = merge_by_seed([read_run(p) for p in args.files])
    if len(runs) < 3:
        print(f"warning: {len(runs)} run(s); a parity claim needs 3+ seeds", file=sys.stderr)
    lines, ok = summarize(runs, args.bound)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
