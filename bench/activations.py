"""FP8 saved activations (coat_ds.compress_activations): memory held for backward, step time.

    python bench/activations.py --quick --steps 12 --layer-bs 8 --bs 4 --compile
    python bench/activations.py --quick --steps 8 --layer-bs 8 --bs 4           # eager
    python bench/activations.py --quick --steps 12 --layer-bs 8 --bs 4 --compile --tree .oldwt --rounds 2
    python bench/activations.py --sides --bs 4            # compiled 1.1B: four partitioner sides
    python bench/activations.py --host                    # CPU: hook time per kind of saved tensor
    python bench/activations.py --tiny                    # CPU, tiny sizes (a check of the script)

Default: one Llama-2-7B decoder layer (HF, hidden 4096, seq 2048) and the ~1.1B HF Llama (hidden
2048, 22 layers, GQA 32/4), BF16, each at the given batch sizes, compiled per layer with
--compile. One handle is switched on and off: memory from one step of each side (held = bytes
still allocated when forward returns, what autograd keeps for backward; forward peak), times
from `--steps` rounds of one BF16 and one FP8 step, the order swapped every round (medians);
overhead = FP8 step over BF16 in the same process. Then the activation kernels' device time
against a device copy (64M BF16 elements). --profile adds a torch.profiler table of one
compressed step of the last model.
--sides: the 1.1B model compiled four ways in sequence: torch's defaults, BF16 with the
partitioner option FP8 regions set (ban_recompute_materialized_backward off), FP8 with
compiled_recompute=False, FP8 (defaults); held excludes the logits.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import _common as C
import torch


def measure(model, inputs, loss_fn, steps: int) -> dict:
    """BF16 and FP8 sides of one model through one handle switched on and off."""
    import coat_ds

    handle = coat_ds.compress_activations(model, config=coat_ds.ActivationConfig(eager_min_region_numel=0))

    def step(on: bool):
        handle.enabled = on  # compiled layers hold a graph for each (Dynamo guards on the hooks)
        model.zero_grad(set_to_none=True)
        C.sync()
        handle.reset_stats()
        before = C.allocated()
        C.reset_peak()
        t0 = time.perf_counter()
        out = model(*inputs)
        # Read after forward, before any sync: the allocator's counters are host-side and exact.
        held, peak = C.allocated() - before, max(0, C.peak_bytes() - before)
        loss_fn(out).backward()
        t1 = time.perf_counter()
        C.sync()
        return held, peak, (time.perf_counter() - t0) * 1e3, (t1 - t0) * 1e3

    for _ in range(2):  # compile and warm up both sides
        step(False)
        step(True)
    mem = {on: step(on)[:2] for on in (False, True)}
    stats = handle.stats()
    times = {False: [], True: []}
    for i in range(steps):
        for on in ((False, True) if i % 2 == 0 else (True, False)):
            times[on].append(step(on)[2:])
    handle.remove()
    model.zero_grad(set_to_none=True)
    side = {on: dict(held_mib=mem[on][0] / 2**20, peak_mib=mem[on][1] / 2**20,
                     ms=statistics.median(t for t, _ in times[on]), host_ms=statistics.median(h for _, h in times[on]))
            for on in (False, True)}
    return {"bf16": side[False], "fp8": side[True], "overhead_pct": (side[True]["ms"] / side[False]["ms"] - 1) * 100,
            "ledger_bf16_mib": stats.uncompressed_bytes / 2**20, "ledger_fp8_mib": stats.compressed_bytes / 2**20,
            "tensors": stats.compressed_tensors}


def run_models(args) -> dict:
    dev, dt = C.device(), torch.bfloat16
    layer_shape, model_shape, seq = ("tiny", "tiny", 64) if args.tiny else ("7b", "1.1b", 2048)
    mode = " (compiled)" if args.compile else ""
    rows = []
    layer = C.DecoderLayer(layer_shape).to(dev, dt)
    if args.compile:
        C.compile_layers(layer)
    width = C.SHAPES[layer_shape]["hidden_size"]
    for bs in args.layer_bs:
        x = torch.randn(bs, seq, width, device=dev, dtype=dt, requires_grad=True)
        r = measure(layer, (x,), lambda o: o.float().pow(2).mean(), args.steps)
        rows.append({"model": f"{layer_shape} layer, seq {seq}, bs {bs}{mode}", **r})
    del layer
    model = C.hf_llama(model_shape, seq, dev, dt)
    if args.compile:
        C.compile_layers(model)
    for bs in args.bs:
        ids = torch.randint(0, model.config.vocab_size, (bs, seq), device=dev)
        r = measure(model, (ids,), lambda out, ids=ids: C.lm_loss(out.logits, ids), args.steps)
        rows.append({"model": f"Llama {model_shape}, seq {seq}, bs {bs}{mode}", **r})
    res = {"rows": rows, "kernels": kernel_rows(args.reps) if dev.type == "cuda" else []}
    if args.profile:
        import coat_ds

        handle = coat_ds.compress_activations(model, config=coat_ds.ActivationConfig(eager_min_region_numel=0))
        print("\n".join(C.kernel_table(lambda: C.lm_loss(model(ids).logits, ids).backward())))
        handle.remove()
    return res


def kernel_rows(reps: int) -> list[dict]:
    """Activation kernels, device time with the queue full, against a device copy of the same tensor."""
    from coat_ds.kernels import get

    ops = get("act_codec", torch.device("cuda"), "triton")
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    n, y = x.numel(), torch.empty_like(x)
    codes, exps = ops.quantize_rows(x, 16)
    tcodes, texp = ops.quantize_tensor(x)
    cases = [("d2d copy (bf16)", lambda: y.copy_(x), 4 * n),
             ("quantize 1x16", lambda: ops.quantize_rows(x, 16), 3 * n + n // 16),
             ("dequantize 1x16", lambda: ops.dequantize_rows(codes, exps, 16, "e4m3", torch.bfloat16), 3 * n + n // 16),
             ("quantize tensor", lambda: ops.quantize_tensor(x), 5 * n),  # reads x twice: max, then codes
             ("dequantize tensor", lambda: ops.dequantize_tensor(tcodes, texp, "e4m3", torch.bfloat16), 3 * n)]
    rows = [{"kernel": name, "ms": C.device_ms(fn, reps), "bytes": b} for name, fn, b in cases]
    copy = rows[0]["bytes"] / rows[0]["ms"]
    return [{**r, "gbs": r["bytes"] / r["ms"] / 1e6, "pct_copy": 100 * r["bytes"] / r["ms"] / copy} for r in rows]


def models_table(res: dict) -> list[str]:
    lines = []
    if res["kernels"]:
        lines += ["| kernel (64M BF16 elements) | ms | GB/s | % of copy |", "|---|---|---|---|"]
        lines += [f"| {k['kernel']} | {k['ms']:.3f} | {k['gbs']:.0f} | {k['pct_copy']:.1f} |" for k in res["kernels"]]
    lines += ["| model | held bf16 MiB | fp8 | x less | peak bf16 | fp8 | step bf16 ms | fp8 | overhead | "
              "host bf16 / fp8 ms | ledger bf16 / fp8 MiB | tensors |", "|---" * 12 + "|"]
    for r in res["rows"]:
        b, f = r["bf16"], r["fp8"]
        less = f"{b['held_mib'] / f['held_mib']:.2f}x" if f["held_mib"] else "-"
        lines.append(f"| {r['model']} | {b['held_mib']:.0f} | {f['held_mib']:.0f} | {less} | {b['peak_mib']:.0f} | "
                     f"{f['peak_mib']:.0f} | {b['ms']:.1f} | {f['ms']:.1f} | {r['overhead_pct']:+.1f}% | "
                     f"{b['host_ms']:.1f} / {f['host_ms']:.1f} | {r['ledger_bf16_mib']:.0f} / {r['ledger_fp8_mib']:.0f} | "
                     f"{r['tensors']} |")
    return lines


SIDES = {"bf16": (None, {}), "bf16+recompute": (None, {"ban_recompute_materialized_backward": False}),
         "fp8 (saved)": (dict(compiled_recompute=False), {}), "fp8": ({}, {})}


def run_sides(args) -> dict:
    """The compiled 1.1B model four ways, in sequence, each compiling its own graphs."""
    import torch._functorch.config as functorch_config

    import coat_ds

    shape, seq = ("tiny", 64) if args.tiny else ("1.1b", 2048)
    model = C.hf_llama(shape, seq, C.device(), torch.bfloat16)
    C.compile_layers(model)
    ids = torch.randint(0, model.config.vocab_size, (args.bs[-1], seq), device=C.device())
    rows = []
    for name, (config, patch) in SIDES.items():
        torch._dynamo.reset()
        handle = coat_ds.compress_activations(model, config=coat_ds.ActivationConfig(**config)) if config is not None else None
        held = []

        def step():
            model.zero_grad(set_to_none=True)
            before = C.allocated()
            logits = model(ids).logits
            held.append(C.allocated() - before - logits.numel() * logits.element_size())
            C.lm_loss(logits, ids).backward()

        with functorch_config.patch(patch):
            ms = C.median_ms(step, args.steps)
            if args.profile:
                print(f"\n## {name}\n" + "\n".join(C.kernel_table(step)))
        if handle is not None:
            handle.remove()
        rows.append({"side": name, "ms": ms, "held_mib": held[-1] / 2**20})
    return {"model": f"Llama {shape}, seq {seq}, bs {args.bs[-1]}, every layer compiled", "rows": rows}


def sides_table(res: dict) -> list[str]:
    base = res["rows"][0]
    return [res["model"], "| side | step ms | vs bf16 | held MiB (no logits) | x less |", "|---|---|---|---|---|"] + [
        f"| {r['side']} | {r['ms']:.1f} | {(r['ms'] / base['ms'] - 1) * 100:+.1f}% | {r['held_mib']:.0f} | "
        f"{base['held_mib'] / r['held_mib']:.2f}x |" if r["held_mib"] > 0 else f"| {r['side']} | {r['ms']:.1f} | | | |"
        for r in res["rows"]]


def run_host(args) -> dict:
    """The eager hooks' pack and unpack on CPU, one kind of saved tensor at a time, the kernel
    launch removed (shapes, allocations and checks stay): best per-call time of many batches."""
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from coat_ds import ActivationConfig
    from coat_ds.activation.hooks import SavedTensorCompressor
    from coat_ds.kernels import act_codec

    act_codec.launch = lambda *a, **k: None
    torch.set_num_threads(1)
    comp = SavedTensorCompressor(ActivationConfig(backend="triton"))
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16))
    comp.note_alive_anyway(torch.randn(4))  # a region always has some

    def linear_input():
        h = x * 2
        comp.note_linear_input(h)
        return h.view(64, 64)  # what F.linear saves: a 2-D view of its input

    kinds = {"per group": lambda: x * 2, "per tensor (linear)": linear_input,
             "transposed": lambda: (x * 2).transpose(1, 2), "weight view": lambda: w.t(), "tiny (kept)": lambda: x[0, :4] * 2}
    rows = []
    for name, make in kinds.items():
        best_p = best_u = float("inf")
        for _ in range(args.steps * 10):
            ts = [make() for _ in range(40)]
            t0 = time.perf_counter_ns()
            saved = [comp.pack(t) for t in ts]
            t1 = time.perf_counter_ns()
            for s in saved:
                comp.unpack(s)
            t2 = time.perf_counter_ns()
            best_p, best_u = min(best_p, (t1 - t0) / 40e3), min(best_u, (t2 - t1) / 40e3)
        rows.append({"kind": name, "pack_us": best_p, "unpack_us": best_u})
    return {"rows": rows}


def host_table(res: dict) -> list[str]:
    return ["| saved tensor | pack us | unpack us |", "|---|---|---|"] + [
        f"| {r['kind']} | {r['pack_us']:.2f} | {r['unpack_us']:.2f} |" for r in res["rows"]]


MODES = {"models": (run_models, models_table, lambda r: r["model"], "overhead_pct"),
         "sides": (run_sides, sides_table, lambda r: r["side"], "ms"),
         "host": (run_host, host_table, lambda r: r["kind"], "pack_us")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--sides", action="store_true", help="compiled 1.1B model, four partitioner sides")
    mode.add_argument("--host", action="store_true", help="CPU: the hooks' time per kind of saved tensor")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--steps", type=int, default=None, help="timed rounds of one BF16 and one FP8 step (6; --quick 3)")
    ap.add_argument("--bs", type=int, nargs="+", default=[2], help="batch sizes of the 1.1B model")
    ap.add_argument("--layer-bs", type=int, nargs="+", default=[1], help="batch sizes of the 7B layer")
    ap.add_argument("--compile", action="store_true", help="every decoder layer compiled, both sides")
    ap.add_argument("--profile", action="store_true", help="also a torch.profiler table of one compressed step")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized shapes, a check of the script")
    C.add_common(ap)
    args = ap.parse_args(argv)
    args.steps = args.steps or (3 if args.quick else 6)
    args.reps = 20 if args.quick else 50
    if args.tiny:
        args.bs, args.layer_bs, args.steps = [2], [2], 2
    name = "sides" if args.sides else "host" if args.host else "models"
    if name != "host" and not args.tiny and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --tiny, --host)")
    run, table, key, value = MODES[name]
    if args.child:
        return C.emit(run(args))
    print(C.header(), flush=True)
    if args.tree:
        rows = C.run_trees(args, sys.argv[1:] if argv is None else argv)
        unit = "% overhead" if value == "overhead_pct" else value
        return C.finish(args, f"act_{name}_ab", rows, C.ab_table(rows, key, value, unit, delta=value == "overhead_pct"))
    res = run(args)
    C.finish(args, f"act_{name}", res, table(res))


if __name__ == "__main__":
    main()
