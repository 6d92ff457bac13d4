"""Optimizer step: CoatAdamW against torch AdamW and the 8-bit peers, on the GPU and on the host.

    python bench/optim_step.py [--numel 1.345e9] [--iters 30] [--portable] [--peers] [--sweep] [--list-7b]
    python bench/optim_step.py --tree .oldwt --iters 30          # same-call A/B with another checkout
    python bench/optim_step.py --host [--numel 8388608] [--iters 7] [--fallback] [--whole] [--no-ds]
    python bench/optim_step.py --stub-launch [--profile]          # CPU: host bookkeeping, launch stubbed
    python bench/optim_step.py --loop [--compile]                 # the step inside a training loop

GPU (default): one flat FP32 tensor (what ZeRO hands an optimizer) and a Llama-1.3B-shaped list
of 219 tensors; median of CUDA-event-timed steps, state bytes per parameter, bandwidth against a
device copy of the same run, ratios against torch AdamW(fused=True). --portable adds CoatAdamW
with the portable FP8 coding forced (GPUs before compute capability 8.9); --peers adds torchao
AdamWFp8 / AdamW8bit and bitsandbytes AdamW8bit (state: what their first step allocated).
--host: ZeRO-Offload's host step on one flat CPU partition, the cases timed in turns, against
torch AdamW(foreach=True) (and DeepSpeedCPUAdam where it builds). --stub-launch: the Python work
per tensor that a GPU step pays before its launch, on CPU, with the Triton launch removed, and
what autograd spends calling a do-nothing Python hook per tensor (step_in_backward's floor).
--loop: phases of the 350m preset's training step (12 x 1024 tokens, BF16 autocast, an LR that
changes every step, clipping, loss.item()), torch AdamW vs CoatAdamW vs CoatAdamW + FP8 activations.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import _common as C
import torch


def llama_shapes(hidden=2048, layers=24, ffn=5504, vocab=32000) -> list[tuple[int, ...]]:
    layer = [(hidden,), (hidden, hidden), (hidden, hidden), (hidden, hidden), (hidden, hidden), (hidden,),
             (ffn, hidden), (ffn, hidden), (hidden, ffn)]
    return [(vocab, hidden)] + layer * layers + [(hidden,), (vocab, hidden)]


def make_optimizer(name: str, params):
    from coat_ds import CoatAdamW

    kw = dict(lr=1e-4, weight_decay=0.01)
    if name == "torch_fused":
        return torch.optim.AdamW(params, fused=True, **kw)
    if name.startswith("torchao_"):
        from torchao import optim

        return getattr(optim, name[len("torchao_"):])(params, **kw)
    if name == "bnb_AdamW8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **kw)
    return CoatAdamW(params, **kw)


PEERS = ("torchao_AdamWFp8", "torchao_AdamW8bit", "bnb_AdamW8bit")


def gpu_case(case: str, shapes, name: str, iters: int) -> dict:
    torch.manual_seed(0)
    params = [torch.randn(s, device="cuda") * 0.02 for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    before = torch.cuda.memory_allocated()
    opt = make_optimizer(name, params)
    if name == "coat_portable":  # imported here only: older trees lack it (--tree)
        from coat_ds.kernels import set_fp8_conversions

        set_fp8_conversions("portable")
    try:
        opt.step()  # state allocated, kernels compiled
        torch.cuda.synchronize()
        first_step_bytes = torch.cuda.memory_allocated() - before
        if name.startswith("coat"):
            torch.cuda.set_sync_debug_mode("error")  # a host sync inside step() raises
        ms = C.median_ms(opt.step, iters)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        if name == "coat_portable":
            set_fp8_conversions(None)
    numel = sum(p.numel() for p in params)
    # The peers' states are tensor subclasses or packed buffers: count what the first step allocated.
    state = first_step_bytes if name in PEERS else sum(
        t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if torch.is_tensor(t) and k != "step")
    del opt, params
    gc.collect()
    torch.cuda.empty_cache()
    return {"case": case, "optimizer": name, "numel": numel, "ms": ms, "state_bytes_per_param": state / numel}


def cases(args) -> list[tuple[str, list[tuple[int, ...]]]]:
    out = [("flat", [(int(args.numel),)]), ("llama-1.3B list", llama_shapes())]
    if args.list_7b:  # bench/fp8_linear.py --shape 7b's parameters
        out.append(("llama-7B x 6 list", llama_shapes(hidden=4096, layers=6, ffn=11008)))
    return out


def run_gpu(args) -> dict:
    from coat_ds.kernels import adamw

    if args.sweep:  # launch shapes (groups per program, warps) on every case
        default = adamw.STEP_BLOCK_GROUPS, adamw.STEP_WARPS
        for case, shapes in cases(args):
            for shape in [(4, 2), (8, 2), (8, 4), (16, 4), (16, 8), (32, 4), (32, 8), (64, 8), (64, 16)]:
                adamw.STEP_BLOCK_GROUPS, adamw.STEP_WARPS = shape
                print(f"sweep {case}, groups/program, warps = {shape}: {gpu_case(case, shapes, 'coat', args.iters)['ms']:.2f} ms",
                      flush=True)
        adamw.STEP_BLOCK_GROUPS, adamw.STEP_WARPS = default
    names = ("torch_fused", "coat") + (("coat_portable",) if args.portable else ()) + (PEERS if args.peers else ())
    rows = [gpu_case(case, shapes, name, args.iters) for case, shapes in cases(args) for name in names]
    return {"device": torch.cuda.get_device_name(), "copy_tbs": C.copy_tbs(), "rows": rows}


def gpu_table(res: dict) -> list[str]:
    rows, bw = res["rows"], res["copy_tbs"]
    lines = [f"{res['device']}: copy bandwidth {bw:.2f} TB/s (read + write)",
             "| case | optimizer | ms/step | state B/param | achieved TB/s | % of copy | vs fused AdamW |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        # Bytes moved per parameter: p read+write 8, g 4, moments read+write (FP32: 16; FP8 + scales: 4).
        moved = 16.0 if r["optimizer"].startswith("coat") else 12.0 + 2 * r["state_bytes_per_param"]
        base = next(x["ms"] for x in rows if x["case"] == r["case"] and x["optimizer"] == "torch_fused")
        tbs = moved * r["numel"] / r["ms"] / 1e9
        lines.append(f"| {r['case']} | {r['optimizer']} | {r['ms']:.2f} | {r['state_bytes_per_param']:.3f} | "
                     f"{tbs:.2f} | {100 * tbs / bw:.0f}% | {base / r['ms']:.2f}x |")
    return lines


def run_host(args) -> dict:
    """ZeRO-Offload's host step against torch AdamW(foreach=True), cases timed in turns."""
    from coat_ds import CoatAdamW
    from coat_ds.kernels import AdamWHyper, AdamWSlot, host, host_native
    from coat_ds.kernels import reference as R

    numel = int(args.numel or 8_388_608)

    def param(seed=0):
        g = torch.Generator().manual_seed(seed)
        p = torch.nn.Parameter(torch.randn(numel, generator=g) * 0.02)
        p.grad = torch.randn(numel, generator=g) * 1e-3
        return p

    steps = {"torch AdamW foreach": torch.optim.AdamW([param()], lr=1e-4, weight_decay=0.01, foreach=True).step,
             "CoatAdamW host step": CoatAdamW([param()], lr=1e-4, weight_decay=0.01).step}
    if host_native.library() is None:
        raise SystemExit("the host kernel did not build (see the log line above)")
    hyper = AdamWHyper.at_step(10, 1e-4, 0.9, 0.999, 1e-8, 0.01)

    def slot():
        p, zeros = param(), torch.zeros(numel)
        return AdamWSlot(p.data, p.grad, R.quantize_groups(zeros), R.quantize_groups(zeros))

    if args.fallback:
        chunked = slot()
        steps["fallback: chunked reference"] = lambda: host.host_step([chunked], hyper, fused=False)
    if args.whole:
        whole = slot()
        steps["reference step, whole partition"] = lambda: R.adamw_step([whole], hyper)
    if not args.no_ds:
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            steps["DeepSpeedCPUAdam"] = DeepSpeedCPUAdam([param()], lr=1e-4, weight_decay=0.01, adamw_mode=True).step
        except Exception as e:  # its JIT build needs a compiler and DeepSpeed's op sources
            print(f"DeepSpeedCPUAdam did not build: {type(e).__name__}: {str(e)[:200]}", flush=True)
    for fn in steps.values():  # state allocation, first-use builds
        fn()
    # Wall time and the process's CPU time per step: on a shared machine wall time also counts
    # the wait for a core, CPU time much less so.
    times = {k: [] for k in steps}
    cpu = {k: [] for k in steps}
    for _ in range(args.iters):
        for name, fn in steps.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
            cpu[name].append((time.process_time() - c0) * 1e3)
    rows = [{"step": k, "ms": statistics.median(v), "min_ms": min(v), "cpu_ms": statistics.median(cpu[k])}
            for k, v in times.items()]
    return {"threads": torch.get_num_threads(), "simd": torch.backends.cpu.get_cpu_capability(), "numel": numel,
            "load_average": os.getloadavg()[0], "rows": rows}


def host_table(res: dict) -> list[str]:
    base, cpu_base = res["rows"][0]["ms"], res["rows"][0]["cpu_ms"]
    return [f"{res['numel']:,} FP32 elements, {res['threads']} torch threads, {res['simd']}, "
            f"load average {res['load_average']:.1f}",
            "| step | median ms | min ms | vs torch foreach | median CPU ms | CPU vs torch foreach |",
            "|---|---|---|---|---|---|"] + [
        f"| {r['step']} | {r['ms']:.1f} | {r['min_ms']:.1f} | {r['ms'] / base:.2f}x | {r['cpu_ms']:.1f} | "
        f"{r['cpu_ms'] / cpu_base:.2f}x |" for r in res["rows"]]


def run_stub_launch(args) -> dict:
    """CoatAdamW's step on CPU tensors through the Triton backend with the launch removed: 219
    tensors shaped like a scaled-down Llama list; wall and thread CPU time per step, for
    step() and for step_in_backward (each gradient's hook as backward would call it, last
    tensor first, then step()). Both loops assign the gradients anew, as backward does."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from coat_ds import CoatAdamW
    from coat_ds.kernels import adamw

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *a, **k: None

    adamw._adamw_kernel = NoLaunch()
    rows = []
    for in_backward in (False, True):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in llama_shapes(64, 24, 172, 256)]
        grads = [torch.randn_like(p) * 1e-3 for p in params]
        opt = CoatAdamW(params, lr=1e-4, weight_decay=0.01, backend="triton", min_quant_numel=args.min_quant_numel,
                        step_in_backward=in_backward)
        ib = opt._in_backward

        def step():
            for p, g in zip(reversed(params), reversed(grads)):
                p.grad = g
                if ib is not None:
                    ib.in_backward = True  # outside autograd: no end-of-backward callback to queue
                    ib.hooks[id(p)](p)
            if ib is not None:
                ib.end_of_backward()
            opt.step()

        step()
        wall, cpu = [], []  # thread CPU time: on a shared machine wall time also counts waits for a core
        for _ in range(args.iters):
            t0, c0 = time.perf_counter(), time.thread_time()
            step()
            wall.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.thread_time() - c0) * 1e3)
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.runcall(lambda: [step() for _ in range(args.iters)])
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)
        rows.append({"mode": "step_in_backward" if in_backward else "step()", "tensors": len(params),
                     "host_ms_min": min(wall), "host_ms": statistics.median(wall), "cpu_ms_min": min(cpu),
                     "cpu_ms": statistics.median(cpu)})
    rows.append(hook_floor(params, args.iters))
    return {"rows": rows}


def hook_floor(params: list[torch.Tensor], iters: int) -> dict:
    """What autograd itself spends calling one Python post-accumulate-grad hook per tensor
    (hooks that do nothing): the same backward timed with and without them, in turns, the
    difference of the medians. step_in_backward cannot cost less than this over step()."""
    def backward_times(hooked: bool) -> tuple[float, float]:
        handles = [p.register_post_accumulate_grad_hook(lambda p: None) for p in params] if hooked else []
        loss = sum((p * p).sum() for p in params)
        t0, c0 = time.perf_counter(), time.thread_time()
        loss.backward()
        times = (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3
        for h in handles:
            h.remove()
        for p in params:
            p.grad = None
        return times

    runs = {False: [], True: []}
    for i in range(2 * iters):
        runs[bool(i % 2)].append(backward_times(bool(i % 2)))
    med = {k: [statistics.median(t[j] for t in v) for j in (0, 1)] for k, v in runs.items()}
    mins = {k: [min(t[j] for t in v) for j in (0, 1)] for k, v in runs.items()}
    return {"mode": "no-op hooks' own cost in backward", "tensors": len(params),
            "host_ms_min": mins[True][0] - mins[False][0], "host_ms": med[True][0] - med[False][0],
            "cpu_ms_min": mins[True][1] - mins[False][1], "cpu_ms": med[True][1] - med[False][1]}


def stub_table(res: dict) -> list[str]:
    base = res["rows"][0]["cpu_ms"]
    return ["| mode | tensors | host ms/step min | median | thread CPU ms min | median | CPU vs step() |",
            "|---|---|---|---|---|---|---|"] + [
        f"| {r['mode']} | {r['tensors']} | {r['host_ms_min']:.3f} | {r['host_ms']:.3f} | {r['cpu_ms_min']:.3f} | "
        f"{r['cpu_ms']:.3f} | {r['cpu_ms'] / base:.2f}x |" for r in res["rows"]]


def run_loop(args) -> dict:
    """Phases of the training step, medians: the whole step unsynchronized (even steps), then
    forward, backward, clipping and opt.step() each closed by a synchronize (odd steps)."""
    from coat_ds import ActivationConfig, CoatAdamW, compress_activations
    from coat_ds.train.data import DataConfig, batch_seed, load_data
    from coat_ds.models.llama import Llama, model_config

    dev, tiny = C.device(), args.tiny
    preset, bs, seq, steps, warmup = ("tiny", 2, 64, 6, 2) if tiny else ("350m", 12, 1024, 28, 8)
    data = load_data(DataConfig(max_bytes=2_000_000 if tiny else 32_000_000))
    rows = []
    for variant in ("adamw", "coat", "coat_act"):
        torch.manual_seed(1337)
        model = Llama(model_config(preset, max_seq_len=seq)).to(dev)
        opt = (torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                 fused=dev.type == "cuda") if variant == "adamw" else
               CoatAdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1))
        act = ActivationConfig(eager_min_region_numel=0)  # the method, also where the default keeps tensors exact
        handle = compress_activations(model, config=act) if variant == "coat_act" else None
        for block in model.blocks if args.compile else ():
            block.compile()
        phases = {k: [] for k in ("step", "forward", "backward", "clip", "opt.step", "opt.step host")}
        for i in range(steps):
            for g in opt.param_groups:
                g["lr"] = C.lr_at(i, 600, 60, 3e-4)
            x, y = (t.to(dev) for t in data.batch("train", bs, seq, batch_seed(1337, i, 0, 0, "train")))
            synced = i % 2 == 1
            C.sync()
            t = [time.perf_counter()]

            def mark():
                if synced:
                    C.sync()
                    t.append(time.perf_counter())

            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                loss = model(x, y)
            mark()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            mark()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            mark()
            h0 = time.perf_counter()
            opt.step()
            h1 = time.perf_counter()
            mark()
            loss.item()
            t.append(time.perf_counter())
            if i >= warmup and synced:
                for k, a in (("forward", 0), ("backward", 1), ("clip", 2), ("opt.step", 3)):
                    phases[k].append((t[a + 1] - t[a]) * 1e3)
                phases["opt.step host"].append((h1 - h0) * 1e3)
            elif i >= warmup:
                phases["step"].append((t[-1] - t[0]) * 1e3)
        if handle is not None:
            handle.remove()
        rows.append({"variant": variant, **{k: statistics.median(v) for k, v in phases.items()}})
    return {"mode": "compiled" if args.compile else "eager", "rows": rows}


def loop_table(res: dict) -> list[str]:
    cols = [k for k in res["rows"][0] if k != "variant"]
    base = res["rows"][0]["step"]
    return [f"training step by phase, ms, {res['mode']}", "| variant | " + " | ".join(cols) + " | step vs AdamW |",
            "|---" * (len(cols) + 2) + "|"] + [
        f"| {r['variant']} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + f" | {r['step'] / base:.2f}x |"
        for r in res["rows"]]


MODES = {"gpu": (run_gpu, gpu_table, lambda r: f"{r['case']}, {r['optimizer']}", "ms"),
         "host": (run_host, host_table, lambda r: r["step"], "ms"),
         "stub_launch": (run_stub_launch, stub_table, lambda r: f"{r['tensors']} tensors, {r.get('mode', 'step()')}",
                        "host_ms"),
         "loop": (run_loop, loop_table, lambda r: r["variant"], "step")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--host", action="store_true", help="ZeRO-Offload's host step on a CPU partition")
    mode.add_argument("--stub-launch", action="store_true", help="CPU: the step's host work, launch removed")
    mode.add_argument("--loop", action="store_true", help="the step inside the 350m preset's training loop")
    ap.add_argument("--numel", type=float, default=None, help="flat case's elements (GPU 1.345e9, --host 8388608)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps (GPU 20, --host 7, --stub-launch 200)")
    ap.add_argument("--sweep", action="store_true", help="GPU: time launch shapes on every case first")
    ap.add_argument("--list-7b", action="store_true", help="GPU: also a list of 6 Llama-7B layers, embedding and head")
    ap.add_argument("--portable", action="store_true", help="GPU: also CoatAdamW with the portable FP8 coding")
    ap.add_argument("--peers", action="store_true", help=f"GPU: also {', '.join(PEERS)}")
    ap.add_argument("--fallback", action="store_true", help="--host: also the chunked reference (no C++ kernel)")
    ap.add_argument("--whole", action="store_true", help="--host: also the reference step on the whole partition")
    ap.add_argument("--no-ds", action="store_true", help="--host: skip DeepSpeedCPUAdam")
    ap.add_argument("--min-quant-numel", type=int, default=0, help="--stub-launch: CoatAdamW's option")
    ap.add_argument("--profile", action="store_true", help="--stub-launch: cProfile's top functions")
    ap.add_argument("--compile", action="store_true", help="--loop: every block compiled")
    ap.add_argument("--tiny", action="store_true", help="--loop: the tiny preset, a few steps (CPU check)")
    C.add_common(ap)
    args = ap.parse_args(argv)
    name = "host" if args.host else "stub_launch" if args.stub_launch else "loop" if args.loop else "gpu"
    args.iters = args.iters or {"gpu": 20, "host": 7, "stub_launch": 200, "loop": 0}[name]
    args.numel = args.numel or (None if args.host else 1.345e9)
    run, table, key, value = MODES[name]
    if name == "gpu" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --host, --stub-launch, --loop)")
    if args.child:
        return C.emit(run(args))
    print(C.header(), flush=True)
    if args.tree:
        rows = C.run_trees(args, sys.argv[1:] if argv is None else argv)
        return C.finish(args, f"optim_{name}_ab", rows, C.ab_table(rows, key, value))
    res = run(args)
    C.finish(args, f"optim_{name}", res, table(res))


if __name__ == "__main__":
    main()
