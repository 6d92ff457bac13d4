"""Optimizer-step benchmark: CoatAdamW vs torch.optim.AdamW(fused=True), side by side.

    python bench/optim_step.py [--numel 1.345e9] [--iters 20] [--out results.json] [--portable] [--peers]

Times (CUDA events, median) one step on (a) one flat FP32 tensor, what ZeRO hands an
optimizer, and (b) a Llama-1.3B-shaped list of 219 tensors; prints ms/step, state bytes per
parameter and achieved bandwidth against a device-to-device copy measured in the same run.
--portable adds CoatAdamW with the portable FP8 coding forced (what GPUs before compute
capability 8.9 run) and prints its time against the hardware conversions' (target <= 1.3x).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from coat_ds import CoatAdamW  # noqa: E402
from coat_ds.kernels import set_fp8_conversions  # noqa: E402


def llama_shapes(hidden=2048, layers=24, ffn=5504, vocab=32000) -> list[tuple[int, ...]]:
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden,), (hidden, hidden), (hidden, hidden), (hidden, hidden), (hidden, hidden),
                   (hidden,), (ffn, hidden), (ffn, hidden), (hidden, ffn)]
    return shapes + [(hidden,), (vocab, hidden)]


def time_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), 10)
    del src, dst
    return 2 * nbytes / ms / 1e9  # TB/s: read + write


def _torchao(name):
    def make(params):
        from torchao import optim

        return getattr(optim, name)(params, lr=1e-4, weight_decay=0.01)
    return make


def _bnb_adamw8bit(params):
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=1e-4, weight_decay=0.01)


# What users pick instead of CoatAdamW (--peers; their wheels travel with bench/prepare_wheels.sh).
PEERS = {"torchao_AdamWFp8": _torchao("AdamWFp8"), "torchao_AdamW8bit": _torchao("AdamW8bit"),
         "bnb_AdamW8bit": _bnb_adamw8bit}


def run_case(name: str, shapes, opt_name: str, iters: int) -> dict:
    torch.manual_seed(0)
    params = [torch.randn(s, device="cuda") * 0.02 for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    before = torch.cuda.memory_allocated()
    if opt_name == "torch_fused":
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    elif opt_name in PEERS:
        opt = PEERS[opt_name](params)
    else:
        opt = CoatAdamW(params, lr=1e-4, weight_decay=0.01)
    set_fp8_conversions("portable" if opt_name == "coat_portable" else "auto")
    try:
        opt.step()  # allocate state, compile
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated() - before
        if opt_name.startswith("coat"):
            torch.cuda.set_sync_debug_mode("error")  # a host sync inside step() raises
        ms = time_ms(opt.step, iters)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        set_fp8_conversions(None)
    numel = sum(p.numel() for p in params)
    if opt_name in PEERS:
        # Their states are tensor subclasses or packed buffers: count what the first step allocated.
        state = allocated
    else:
        state = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items()
                    if torch.is_tensor(t) and k != "step")
    out = {"case": name, "optimizer": opt_name, "tensors": len(params), "numel": numel, "ms": ms,
           "state_bytes_per_param": state / numel}
    del opt, params
    gc.collect()
    torch.cuda.empty_cache()
    return out


def sweep(shapes, iters: int) -> None:
    """Time CoatAdamW's step for each (groups per program, warps) launch shape."""
    from coat_ds.kernels import adamw

    default = adamw.STEP_BLOCK_GROUPS, adamw.STEP_WARPS
    for bg, nw in [(8, 4), (16, 4), (16, 8), (32, 8)]:
        adamw.STEP_BLOCK_GROUPS, adamw.STEP_WARPS = bg, nw
        r = run_case("flat", shapes, "coat", iters)
        print(f"sweep BG={bg} warps={nw}: {r['ms']:.2f} ms", flush=True)
    adamw.STEP_BLOCK_GROUPS, adamw.STEP_WARPS = default


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=float, default=1.345e9)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true", help="time launch shapes on the flat case first")
    ap.add_argument("--portable", action="store_true",
                    help="also time CoatAdamW with the portable (software) FP8 coding forced")
    ap.add_argument("--peers", action="store_true", help=f"also time {', '.join(PEERS)} (state = bytes their first step allocated)")
    args = ap.parse_args()
    if args.sweep:
        sweep([(int(args.numel),)], args.iters)
    bw = copy_bandwidth()
    rows = []
    cases = [("flat", [(int(args.numel),)]), ("llama-1.3B list", llama_shapes())]
    for name, shapes in cases:
        for opt_name in (("torch_fused", "coat") + (("coat_portable",) if args.portable else ())
                         + (tuple(PEERS) if args.peers else ())):
            rows.append(run_case(name, shapes, opt_name, args.iters))
            print(rows[-1], flush=True)
    flat_coat = next(r["ms"] for r in rows if r["case"] == "flat" and r["optimizer"] == "coat")
    print(f"\ndevice: {torch.cuda.get_device_name()}  copy bandwidth: {bw:.2f} TB/s (read+write)")
    print("| case | optimizer | tensors | ms/step | state B/param | bytes moved/param | achieved TB/s | % of copy | vs fused AdamW |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        moved = 16.0 if r["optimizer"].startswith("coat") else 28.0  # p r/w 8 + g 4 + moments r/w
        if r["optimizer"] in PEERS:
            moved = 12.0 + 2 * r["state_bytes_per_param"]
        tbs = moved * r["numel"] / r["ms"] / 1e9
        base = next(x["ms"] for x in rows if x["case"] == r["case"] and x["optimizer"] == "torch_fused")
        r.update(bytes_moved_per_param=moved, achieved_tbs=tbs, copy_tbs=bw, speedup_vs_fused=base / r["ms"])
        print(f"| {r['case']} | {r['optimizer']} | {r['tensors']} | {r['ms']:.2f} | {r['state_bytes_per_param']:.3f} | "
              f"{moved:.0f} | {tbs:.2f} | {100 * tbs / bw:.0f}% | {base / r['ms']:.2f}x |")
    floor_ms = 16.0 * rows[0]["numel"] / bw / 1e9
    list_coat = next(r["ms"] for r in rows if r["case"] != "flat" and r["optimizer"] == "coat")
    print(f"\nbandwidth floor (16 B/param at copy speed): {floor_ms:.2f} ms; flat CoatAdamW at "
          f"{flat_coat / floor_ms:.2f}x the floor; list/flat = {list_coat / flat_coat:.2f}")
    if args.portable:
        print(f"\ncompute capability {'.'.join(map(str, torch.cuda.get_device_capability()))}; "
              "portable FP8 coding vs hardware conversions (target <= 1.30x):")
        print("| case | hardware ms | portable ms | portable / hardware |")
        print("|---|---|---|---|")
        for case, _ in cases:
            hw = next(r["ms"] for r in rows if r["case"] == case and r["optimizer"] == "coat")
            sw = next(r["ms"] for r in rows if r["case"] == case and r["optimizer"] == "coat_portable")
            print(f"| {case} | {hw:.2f} | {sw:.2f} | {sw / hw:.2f}x |")
    if args.out:
        Path(args.out).write_text(json.dumps({"copy_tbs": bw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
