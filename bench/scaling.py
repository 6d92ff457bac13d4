"""Whole training runs on every GPU of a machine: train.py under DeepSpeed and FSDP2, and the
memory profiler at 7B and 13B. Run through bench/device_env.sh (wheels, path, NCCL settings):

    bash bench/device_env.sh python bench/scaling.py deepspeed coat_zero2 bf16_zero2 --steps 40
    bash bench/device_env.sh python bench/scaling.py deepspeed coat_zero2 bf16_zero2 --flags=--compile --coat-flags="--fp8-linear --compress-activations --fused-head-loss"
    bash bench/device_env.sh python bench/scaling.py deepspeed coat_zero3 bf16_zero3 --micro 6 --tokens 8000000 --flags="--preset 7b --compile" --coat-flags="--recipe speed"
    python bench/scaling.py summary DIR                 # one table from the .jsonl of several calls
    bash bench/device_env.sh python bench/scaling.py table --preset 1b --gpus 1 2 4 --flags=--compile
    bash bench/device_env.sh python bench/scaling.py profile p7b_zero3 p13b_fsdp2 train7b_fsdp2 --limit 420
    torchrun --nproc_per_node 2 bench/scaling.py fsdp-memory --preset 1b --micro-batch 4
    bash bench/device_env.sh python bench/scaling.py fit --preset 7b --sides coat:2,4 coat_sib:4,8 --steps 20
    bash bench/device_env.sh python bench/scaling.py fit --preset 7b --recompute --head-loss --sides coat:16,20 coat_sib:32,48
    bash bench/device_env.sh python bench/scaling.py fit --preset 7b --recompute --recompute-input-fp8 --head-loss --sides coat:24,28 coat_sib:40,48

deepspeed: train.py with each ds_configs/<name>.json (micro-batch --micro per GPU), then the
table (tokens/s: median over logged windows after the first; peak memory and optimizer state:
the largest rank; ratios against the bf16_ config of the same name). table: scaling, each
engine (zero2, zero3: DeepSpeed; fsdp2: train.py --fsdp) x side (bf16: the bf16 JSON; speed,
memory, max_memory: the coat JSON and --recipe) at each GPU count (--gpus, fewest first):
tokens/s per GPU, its efficiency against the fewest GPUs, the ratio against bf16 at that
count, peak memory. profile: `python -m
coat_ds.profile` (ZeRO-3 or FSDP2, coat_zero3 against bf16_zero3; each side in its own
processes) or a few train.py steps. fsdp-memory: torch AdamW vs CoatAdamW vs CoatAdamW + FP8
activations under FSDP2 in the same processes (also on CPU with gloo, tiny presets). fit: on one
GPU, each side (SIDE:MB,MB,...) at growing micro-batches until one fails, train.py on random
tokens of a 32000 vocabulary: bf16 (torch AdamW, FSDP2 at world size 1, eager), coat (FP8
linears + activations + CoatAdamW, compiled), coat_sib (coat with --step-in-backward), coat_m8
(coat_sib with bf16+8 master weights and no clipping), coat_max (coat_m8's optimizer under
--recipe max_memory: every layer recomputed, FP8 GEMMs), offload (DeepSpeed ZeRO-2, BF16,
DeepSpeed's CPU Adam); the largest micro-batch that ran and its tokens/s. --gpu-memory-gb holds
every side to a smaller GPU's memory.
Each run's log and metrics go to --out; the table is printed last.
"""
from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import statistics
import sys
import tempfile
import time

import _common as C
import torch


def with_micro_batch(name: str, micro: int, tag: str = "", edit=None) -> str:
    """The shipped JSON (CPU-sized) with the benchmark's micro-batch (and `edit` applied to it,
    named by `tag`), in the temporary directory: --out keeps only logs, metrics and the table."""
    cfg = json.load(open(C.ROOT / "ds_configs" / f"{name}.json"))
    cfg["train_micro_batch_size_per_gpu"] = micro
    if edit is not None:
        edit(cfg)
    path = os.path.join(tempfile.gettempdir(), f"coat_bench_{name}{tag}_mb{micro}.json")
    json.dump(cfg, open(path, "w"), indent=2)
    return path


def run_deepspeed(args) -> list[str]:
    data = ["--data", token_file(32000, args.tokens), "--bin-dtype", "uint16"] if args.tokens else []
    for name in args.configs:
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(C.ngpu()), "--master_port", "29512",
               "train.py", "--deepspeed", with_micro_batch(name, args.micro), "--config", args.model_config,
               "--max-steps", str(args.steps), "--seq-len", str(args.seq), *data,
               "--metrics-file", os.path.join(args.out, f"{name}.jsonl"), *args.flags.split(),
               *(args.coat_flags.split() if name.startswith("coat_") else [])]
        print(f"{name}: exit {C.launch(cmd, os.path.join(args.out, name + '.log'), args.limit)}", flush=True)
    return summary(args.out)


def _speed_and_peak(logs: list[dict]) -> tuple[float, float]:
    """(median tokens/s of the logged windows after the first, peak GB) of a run's train records."""
    return (statistics.median([m["tokens_per_s"] for m in logs[1:]] or [logs[0]["tokens_per_s"]]),
            max(m["peak_mem_gb"] for m in logs))


def summary(out: str) -> list[str]:
    rows = {}
    for path in sorted(glob.glob(os.path.join(out, "*.jsonl"))):
        recs = [json.loads(line) for line in open(path)]
        train = [r for r in recs if "loss" in r and "tokens_per_s" in r]
        state = [r["optimizer_state_gb"] for r in recs if "optimizer_state_gb" in r]
        if train:
            tps, peak = _speed_and_peak(train)
            rows[os.path.basename(path)[:-6]] = dict(steps=train[-1]["step"], loss=train[-1]["loss"], peak=peak,
                                                     tps=tps, state=state[0] if state else float("nan"))
    lines = ["| run | steps | loss | tokens/s | peak mem / GPU (GB) | optimizer state / GPU (GB) | state vs bf16 | "
             "tokens/s vs bf16 |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        b = rows.get(name.replace("coat_", "bf16_")) if name.startswith("coat_") else None
        ratios = f"{r['state'] / b['state']:.3f}x | {r['tps'] / b['tps']:.3f}x" if b else " | "
        lines.append(f"| {name} | {r['steps']} | {r['loss']:.4f} | {r['tps']:,.0f} | {r['peak']:.2f} | {r['state']:.4g} | {ratios} |")
    return lines


# table and convergence.py: each side's JSON family and train.py flags; each engine's ZeRO stage and flags.
RECIPE_SIDES = {"bf16": ("bf16", []), "speed": ("coat", ["--recipe", "speed"]),
                "memory": ("coat", ["--recipe", "memory"]), "max_memory": ("coat", ["--recipe", "max_memory"])}
TABLE_ENGINES = {"zero2": ("zero2", []), "zero3": ("zero3", []), "fsdp2": ("zero3", ["--fsdp"])}


def run_table(args) -> list[str]:
    """Every engine x side at each GPU count: train.py under torchrun on random tokens."""
    data, res = token_file(32000, args.tokens), {}
    for n in args.gpus:
        for engine in args.engines:
            stage, engine_flags = TABLE_ENGINES[engine]
            for side in args.sides:
                kind, side_flags = RECIPE_SIDES[side]
                name, t0 = f"{engine}_{side}_g{n}", time.time()
                metrics = os.path.join(args.out, name + ".jsonl")
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port",
                       "29514", "train.py", *engine_flags, "--deepspeed", with_micro_batch(f"{kind}_{stage}", args.micro),
                       "--preset", args.preset, "--seq-len", str(args.seq), "--data", data, "--bin-dtype", "uint16",
                       "--max-steps", str(args.steps), "--warmup-steps", "2", "--log-interval", str(args.log_interval),
                       "--eval-interval", "0", "--eval-batches", "1", "--metrics-file", metrics, *side_flags,
                       *args.flags.split()]
                code = C.launch(cmd, os.path.join(args.out, name + ".log"), args.limit)
                ok = code == 0 and os.path.isfile(metrics)
                logs = [m for m in map(json.loads, open(metrics)) if "tokens_per_s" in m] if ok else []
                res[engine, side, n] = _speed_and_peak(logs) if logs else None
                print(f"{name}: exit {code} ({time.time() - t0:.0f} s)", flush=True)
    lines = [f"{args.preset}, seq {args.seq}, micro-batch {args.micro} per GPU, {args.steps} steps, random tokens of a "
             f"32000 vocabulary{', train.py ' + args.flags if args.flags else ''}; tokens/s: the median of the logged "
             "windows after the first; efficiency: tokens/s per GPU over the same run's at the fewest GPUs",
             "| engine | side | GPUs | tokens/s per GPU | scaling efficiency | vs bf16 | peak GB / GPU |",
             "|---|---|---|---|---|---|---|"]
    for (engine, side, n), r in res.items():
        if r is None:
            lines.append(f"| {engine} | {side} | {n} | failed | | | |")
            continue
        one, base = res.get((engine, side, args.gpus[0])), res.get((engine, "bf16", n))
        eff = f"{r[0] / n / (one[0] / args.gpus[0]):.3f}" if one else ""
        vs = f"{r[0] / base[0]:.3f}x" if base and side != "bf16" else ""
        lines.append(f"| {engine} | {side} | {n} | {r[0] / n:,.0f} | {eff} | {vs} | {r[1]:.2f} |")
    return lines


def run_profile(args) -> list[str]:
    for run in args.runs:
        out, model, engine = os.path.join(args.out, run), run[1:].split("_")[0], run.split("_")[1]
        if run.startswith("train"):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(C.ngpu()), "train.py", "--fsdp",
                   "--deepspeed", "ds_configs/coat_zero3.json", "--preset", run[5:].split("_")[0], "--seq-len",
                   str(args.seq), "--max-steps", str(args.steps), "--warmup-steps", "2", "--log-interval", "2",
                   "--eval-interval", "0", "--eval-batches", "1", "--compress-activations"]
        else:
            cmd = [sys.executable, "-m", "coat_ds.profile", "--model", model, "--seq-len", str(args.seq), "--engine",
                   "fsdp" if engine == "fsdp2" else "deepspeed", "--nproc", str(C.ngpu()), "--config",
                   "ds_configs/coat_zero3.json", "--baseline", "ds_configs/bf16_zero3.json", "--max-batch", "64",
                   "--throughput-steps", "2", "--out", out]
        t0 = time.time()
        print(f"{run}: exit {C.launch(cmd, out + '.log', args.limit)} ({time.time() - t0:.0f} s)", flush=True)
    lines = ["| run | side | measured total @ b=2 (GB/rank) | opt states | act/sample | max micro-batch | tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for path in sorted(glob.glob(os.path.join(args.out, "*", "profile.json"))):
        r = json.load(open(path))
        for side in ("baseline", "coat"):
            s, m = r["sides"][side], r["sides"][side]["ranks"][0]
            lines.append(f"| {os.path.basename(os.path.dirname(path))} | {side} | {m['measured_total_bytes'] / 1e9:.2f} | "
                         f"{m['optimizer_state_bytes'] / 1e9:.2f} | {m['activation_bytes_per_sample'] / 1e9:.3f} | "
                         f"{s['max_micro_batch']} | {s['tokens_per_s'] and round(s['tokens_per_s'])} |")
    return lines


def fsdp_memory(args) -> list[str]:
    """Under torchrun: each variant on the same preset, sharded with FSDP2 (BF16 compute, FP32
    masters), the same random tokens; the maximum over ranks of each figure."""
    import torch.distributed as dist

    from coat_ds import ActivationConfig, CoatAdamW
    from coat_ds.integrations.fsdp import setup_fsdp
    from coat_ds.models.llama import Llama, model_config

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def top(x: float) -> float:
        t = torch.tensor(float(x), dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    rows = []
    for variant in args.variants:
        torch.manual_seed(0)
        with dev:
            model = Llama(model_config(args.preset, max_seq_len=args.seq_len))
        model = setup_fsdp(model, mode="fsdp2", param_dtype=torch.bfloat16 if cuda else None,
                           activation=ActivationConfig(eager_min_region_numel=0) if variant == "coat_act" else None)
        kw = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
        opt = torch.optim.AdamW(model.parameters(), **kw) if variant == "adamw" else CoatAdamW(model.parameters(), **kw)
        gen, vocab = torch.Generator().manual_seed(rank), model.cfg.vocab_size
        C.sync()
        C.reset_peak()
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                C.sync()
                t0 = time.perf_counter()
            tokens = torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1), generator=gen).to(dev)
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        C.sync()
        dt = top(time.perf_counter() - t0)
        state = sum(getattr(t, "_local_tensor", t).numel() * getattr(t, "_local_tensor", t).element_size()
                    for s in opt.state.values() for k, t in s.items() if torch.is_tensor(t) and k != "step")
        rows.append({"variant": variant, "tokens_per_s": args.micro_batch * args.seq_len * world * args.steps / dt,
                     "optimizer_state_gb": top(state) / 1e9, "peak_gb": top(C.peak_bytes()) / 1e9, "loss": loss.item()})
        del model, opt, loss
        gc.collect()
    dist.destroy_process_group()
    if rank:
        sys.exit(0)
    base = rows[0]
    return [f"{args.preset}, FSDP2, {world} ranks, micro-batch {args.micro_batch} x {args.seq_len}",
            "| variant | tokens/s | vs first | optimizer state / rank GB | peak allocated / rank GB | loss |",
            "|---|---|---|---|---|---|"] + [
        f"| {r['variant']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
        f"{r['optimizer_state_gb']:.3f} | {r['peak_gb']:.2f} | {r['loss']:.4f} |" for r in rows]


FIT_SIDES = {
    "bf16": ["--fsdp"],  # eager: at 7B its 16 bytes/parameter do not fit one GPU at any micro-batch
    "coat": ["--fsdp", "--compile", "--compress-activations", "--fp8-linear"],
    "coat_sib": ["--fsdp", "--compile", "--compress-activations", "--fp8-linear", "--step-in-backward"],
    # 5.13 bytes/param of training state: 24-bit masters, the gradient freed in backward, no clipping.
    "coat_m8": ["--fsdp", "--compile", "--compress-activations", "--fp8-linear", "--step-in-backward",
                "--master-weights", "bf16+8"],
    # The max_memory recipe: coat_m8's state, every layer recomputed from FP8 inputs with FP8 GEMMs.
    "coat_max": ["--fsdp", "--compile", "--recipe", "max_memory", "--master-weights", "bf16+8"],
    "offload": [],
}


def _cpu_adamw_offload(cfg: dict) -> None:
    """ZeRO-Offload as a user sets it up: the optimizer on the CPU, DeepSpeed's own CPU Adam."""
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    cfg["optimizer"]["params"] = {k: v for k, v in cfg["optimizer"]["params"].items() if k not in ("torch_adam", "fused")}


def fit_json(side: str, micro: int) -> str:
    if side == "offload":
        return with_micro_batch("bf16_zero2", micro, "_offload", _cpu_adamw_offload)
    if side in ("coat_m8", "coat_max"):
        return with_micro_batch("coat_zero3", micro, "_noclip", lambda c: c.update(gradient_clipping=0.0))
    return with_micro_batch("bf16_zero3" if side == "bf16" else "coat_zero3", micro)


def token_file(vocab: int, n: int) -> str:
    path = os.path.join(tempfile.gettempdir(), f"coat_bench_tokens_{vocab}.bin")
    if not os.path.exists(path):
        torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0), dtype=torch.int32).to(
            torch.uint16).numpy().tofile(path)
    return path


def recompute_plan(preset: str, micro: int, seq: int) -> str:
    """A plan checkpointing every decoder layer (train.py --plan), for the preset's layer names."""
    from coat_ds.models.llama import Llama, model_config
    from coat_ds.plan import Plan
    from coat_ds.plan.layers import decoder_layers

    with torch.device("meta"):
        model = Llama(model_config(preset, vocab_size=32000))
    path = os.path.join(tempfile.gettempdir(), f"coat_bench_recompute_{preset}_mb{micro}.json")
    Plan.uniform([f for f, _ in decoder_layers(model)], "recompute", micro, seq).save(path)
    return path


def run_fit(args) -> list[str]:
    data = token_file(32000, 8_000_000)
    # At the edge of the GPU's memory, fragmentation decides: a 7B coat_sib run near its largest
    # micro-batch failed with much memory reserved but unallocated. Every side gets the same allocator.
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": args.alloc_conf} if args.alloc_conf else None
    rows = []
    for spec in args.sides:
        side, mbs = spec.split(":")
        ran = None
        for mb in map(int, mbs.split(",")):
            name = f"fit_{side}_mb{mb}"
            metrics = os.path.join(args.out, name + ".jsonl")
            common = ["train.py", "--deepspeed", fit_json(side, mb), "--preset", args.preset, "--data", data,
                      "--seq-len", str(args.seq), "--max-steps", str(args.steps), "--warmup-steps", "2",
                      "--log-interval", "1", "--eval-interval", "0", "--eval-batches", "1", "--metrics-file", metrics]
            launcher = ([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", "29513"]
                        if side == "offload" else [sys.executable])
            recipe = "--recipe" in FIT_SIDES[side]  # it recomputes and fuses the head's loss itself
            if args.recompute and not recipe:
                common += ["--plan", recompute_plan(args.preset, mb, args.seq)]
                if args.recompute_input_fp8:
                    common += ["--recompute-input-fp8"]
            if args.head_loss and side != "offload" and not recipe:
                common += ["--fused-head-loss"]
            if args.gpu_memory_gb:
                common += ["--gpu-memory-gb", str(args.gpu_memory_gb)]
            t0 = time.time()
            # A plan chooses each layer's treatment itself (a recomputed layer runs BF16 GEMMs).
            flags = [f for f in FIT_SIDES[side]
                     if not (args.recompute and f in ("--compress-activations", "--fp8-linear"))]
            code = C.launch([*launcher, *common, *flags], os.path.join(args.out, name + ".log"), args.limit, env)
            logs = [m for m in map(json.loads, open(metrics)) if "tokens_per_s" in m] if os.path.isfile(metrics) else []
            print(f"{name}: exit {code}, {len(logs)} logged steps ({time.time() - t0:.0f} s)", flush=True)
            if code != 0 or not logs:
                rows.append((side, ran, f"mb {mb}: exit {code}"))
                break
            ran = (mb, statistics.median([m["tokens_per_s"] for m in logs[2:]] or [logs[-1]["tokens_per_s"]]),
                   max(m["peak_mem_gb"] for m in logs), logs[0]["loss"], logs[-1]["loss"], logs[-1]["step"])
        else:
            rows.append((side, ran, ""))
    lines = [f"{args.preset}, seq {args.seq}, vocab 32000, one GPU, {args.steps} steps per try"
             + (", every layer recomputed in backward" if args.recompute else "")
             + (" from FP8 layer inputs" if args.recompute and args.recompute_input_fp8 else "")
             + (", the head's loss in chunks" if args.head_loss else "")
             + (f", GPU memory capped at {args.gpu_memory_gb:g} GB" if args.gpu_memory_gb else "")
             + (f", PYTORCH_CUDA_ALLOC_CONF={args.alloc_conf}" if args.alloc_conf else ""),
             "| side | largest micro-batch run | tokens/s (median after 2 steps) | peak GB | loss first -> last (steps) "
             "| stopped at |", "|---|---|---|---|---|---|"]
    for side, ran, stop in rows:
        lines.append(f"| {side} | none | | | | {stop} |" if ran is None else
                     f"| {side} | {ran[0]} | {ran[1]:,.0f} | {ran[2]:.1f} | {ran[3]:.3f} -> {ran[4]:.3f} ({ran[5]}) | {stop} |")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("deepspeed", help="train.py with each DeepSpeed config")
    d.add_argument("configs", nargs="*", default=["coat_zero1", "bf16_zero1", "coat_zero2", "bf16_zero2", "coat_zero3",
                                                  "bf16_zero3"])
    d.add_argument("--steps", type=int, default=60)
    d.add_argument("--micro", type=int, default=8, help="micro-batch per GPU")
    d.add_argument("--model-config", default="configs/1b.yaml")
    d.add_argument("--flags", default="", help="train.py flags for every config (one string: \"--compile\")")
    d.add_argument("--coat-flags", default="", help="train.py flags for the coat_ configs only "
                   "(\"--fp8-linear --compress-activations --fused-head-loss\", \"--recipe speed\")")
    d.add_argument("--tokens", type=int, default=0, help="train on this many random tokens of a 32000 vocabulary "
                   "(0: the model config's data)")
    s = sub.add_parser("summary", help="the deepspeed table of a folder of .jsonl")
    s.add_argument("folder")
    c = sub.add_parser("table", help="scaling: each engine x side at each GPU count, train.py under torchrun")
    c.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4], help="GPU counts, fewest first")
    c.add_argument("--engines", nargs="+", default=list(TABLE_ENGINES), choices=list(TABLE_ENGINES))
    c.add_argument("--sides", nargs="+", default=["bf16", "speed", "memory"], choices=list(RECIPE_SIDES))
    c.add_argument("--preset", default="1b")
    c.add_argument("--micro", type=int, default=8, help="micro-batch per GPU")
    c.add_argument("--steps", type=int, default=12)
    c.add_argument("--log-interval", type=int, default=3)
    c.add_argument("--tokens", type=int, default=8_000_000, help="random tokens of a 32000 vocabulary")
    c.add_argument("--flags", default="", help="train.py flags for every run (one string: \"--compile\")")
    p = sub.add_parser("profile", help="the memory profiler (or a few train.py steps) on every GPU")
    p.add_argument("runs", nargs="+", choices=["p7b_zero3", "p13b_zero3", "p7b_fsdp2", "p13b_fsdp2", "train7b_fsdp2"])
    p.add_argument("--steps", type=int, default=6, help="train runs: steps")
    f = sub.add_parser("fsdp-memory", help="(under torchrun) FSDP2 memory and throughput per optimizer")
    f.add_argument("--preset", default="1b")
    f.add_argument("--seq-len", type=int, default=2048)
    f.add_argument("--micro-batch", type=int, default=4)
    f.add_argument("--steps", type=int, default=10)
    f.add_argument("--warmup", type=int, default=3)
    f.add_argument("--variants", nargs="+", default=["adamw", "coat", "coat_act"], choices=["adamw", "coat", "coat_act"])
    t = sub.add_parser("fit", help="one GPU: the largest micro-batch of each side, train.py on 32000-token data")
    t.add_argument("--preset", default="7b")
    t.add_argument("--sides", nargs="+", default=["bf16:1", "coat:2,4", "coat_sib:4,8", "offload:4"],
                   help="SIDE:MB,MB,... with SIDE one of " + ", ".join(FIT_SIDES))
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--recompute", action="store_true", help="every side checkpoints every decoder layer (a plan)")
    t.add_argument("--recompute-input-fp8", action="store_true",
                   help="with --recompute: the layers keep their input as FP8 codes (train.py --recompute-input-fp8)")
    t.add_argument("--alloc-conf", default="",
                   help="PYTORCH_CUDA_ALLOC_CONF for every side's run, e.g. expandable_segments:True (default: as set)")
    t.add_argument("--gpu-memory-gb", type=float, default=0.0,
                   help="cap every side's GPU memory (train.py --gpu-memory-gb): what fits a smaller GPU")
    t.add_argument("--head-loss", action="store_true", help="every side but offload: --fused-head-loss (no full logits)")
    for q in (d, c, p, t):
        q.add_argument("--seq", type=int, default=2048)
        q.add_argument("--limit", type=float, default=170, help="seconds per run")
    for q in (d, c, p, f, t):
        q.add_argument("--out", default=None, help="folder for logs, metrics and the table (default runs/<command>)")
    args = ap.parse_args(argv)
    if args.cmd == "summary":
        return print("\n".join(summary(args.folder)))
    args.out = os.path.abspath(args.out or os.path.join("runs", args.cmd))
    os.makedirs(args.out, exist_ok=True)
    print(C.header() + f", {C.ngpu()} GPUs", flush=True)
    run = {"deepspeed": run_deepspeed, "table": run_table, "profile": run_profile, "fsdp-memory": fsdp_memory,
           "fit": run_fit}
    lines = run[args.cmd](args)
    C.finish(args, args.cmd, lines, lines)


if __name__ == "__main__":
    main()
