"""One profiler run: set up the process group, measure both sides, search, report."""
from __future__ import annotations

import gc
import os
import socket
import time

import torch
import torch.distributed as dist

from ..model import PRESETS, model_config
from .engines import build_trainee, load_side
from .measure import measure_side, train_step
from .options import ProfileOptions
from .report import markdown_table, write_chart, write_json
from .search import CudaTrial, budget_fits, search_max_batch

__all__ = ["profile", "resolve_model"]

VOCAB = 256  # byte-level tokens, as train.py's default data


def resolve_model(spec: str, seq_len: int | None):
    """(name, ModelConfig, seq_len) from a preset name or a train.py-style YAML."""
    name, yaml_seq = spec, None
    if spec not in PRESETS and os.path.isfile(spec):
        import yaml

        with open(spec) as f:
            doc = yaml.safe_load(f) or {}
        name, yaml_seq = doc.get("preset"), doc.get("seq_len")
        if name not in PRESETS:
            raise ValueError(f"{spec}: 'preset' must be one of {', '.join(PRESETS)}, got {name!r}")
    elif spec not in PRESETS:
        raise ValueError(f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a YAML file")
    seq = seq_len or yaml_seq or PRESETS[name]["max_seq_len"]
    return name, model_config(name, vocab_size=VOCAB, max_seq_len=max(seq, PRESETS[name]["max_seq_len"])), seq


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_distributed(engine: str) -> None:
    if engine == "none" or (dist.is_available() and dist.is_initialized()):
        return
    if "RANK" not in os.environ:  # started without a launcher: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if engine == "deepspeed":
        import deepspeed

        deepspeed.init_distributed()
    else:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def _device() -> torch.device:
    if torch.cuda.is_available():
        d = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(d)
        return d
    return torch.device("cpu")


def _gather(obj):
    if dist.is_available() and dist.is_initialized():
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def _tokens_per_s(trainee, batch: int, seq_len: int, steps: int, world: int, seed: int, say) -> float:
    train_step(trainee, batch, seq_len, VOCAB, seed)  # warm-up: kernels, allocator
    torch.cuda.synchronize(trainee.device)
    t0 = time.perf_counter()
    for i in range(steps):
        train_step(trainee, batch, seq_len, VOCAB, seed + i)
        say(f"[{trainee.side.name}] throughput step {i + 1}/{steps} at micro-batch {batch}")
    torch.cuda.synchronize(trainee.device)
    return batch * seq_len * steps * world / (time.perf_counter() - t0)


def profile(opts: ProfileOptions) -> dict:
    """Run the profiler; every rank returns the result, rank 0 prints and writes it."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is first imported
    _init_distributed(opts.engine)
    device = _device()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    name, mcfg, seq_len = resolve_model(opts.model, opts.seq_len)
    if opts.budget_gb is not None:
        budget = opts.budget_gb * 1e9
    elif device.type == "cuda":
        budget = float(torch.cuda.get_device_properties(device).total_memory)
    else:
        raise ValueError("on a CPU the search runs against a budget: give --budget-gb")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        # The allocator itself refuses beyond the budget, so a trial over it is a real OOM.
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    search = ("real training steps on the GPU, out-of-memory caught" if device.type == "cuda"
              else "measured fixed bytes + per-sample activation bytes against the budget (CPU)")
    say(f"model {name}: {mcfg.num_params() / 1e6:.1f}M params, seq {seq_len}, engine {opts.engine}, "
        f"{world} rank(s) on {device.type}; budget {budget / 1e9:.3f} GB per rank; search: {search}")

    sides = {"baseline": load_side("baseline", opts.baseline), "coat": load_side("coat", opts.config)}
    if sides["baseline"].is_coat or not sides["coat"].is_coat:
        raise ValueError("--config must name CoatAdamW and --baseline another optimizer (BF16 + torch AdamW)")

    out: dict = {"model": {"name": name, "params": mcfg.num_params(), "spec": opts.model}, "seq_len": seq_len,
                 "engine": opts.engine, "world_size": world, "device": str(device), "budget_bytes": budget,
                 "search": search, "measure_batches": list(opts.measure_batches), "sides": {}}
    measurements = {}
    for key, side in sides.items():
        holder = {}

        def rebuild(side=side, holder=holder):
            if "t" in holder:
                holder.pop("t").close()
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            holder["t"] = build_trainee(opts.engine, side, mcfg, device, opts.seed)

        resident_at_start = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        if resident_at_start and resident_at_start > 0.01 * budget:
            # Charged to this side: its engine buffers and its max micro-batch are then off.
            say(f"[{key}] WARNING: {resident_at_start / 1e9:.3f} GB from the previous side is still allocated; "
                "this side's engine buffers, peak and max micro-batch include it")
        say(f"[{key}] building ({opts.engine}, {side.config_path})")
        rebuild()
        m = measure_side(holder["t"], opts.measure_batches, seq_len, VOCAB, opts.seed, rank, say)
        measurements[key] = m
        if device.type == "cuda":
            fits = CudaTrial(lambda holder=holder: holder["t"], rebuild, seq_len, VOCAB, opts.seed,
                             budget if opts.budget_gb is not None else None, say,
                             predicted=m.predicted_step_total if world > 1 else None, limit_bytes=budget)
        else:
            fits = budget_fits(m, budget)
        say(f"[{key}] searching the largest micro-batch (doubling, then bisection)")
        best, trials = search_max_batch(fits, opts.max_batch, say, key)
        # Ranks can disagree under the budget test (the last ZeRO rank holds the padding).
        best = min(_gather(best))
        tps = None
        if device.type == "cuda" and best > 0 and opts.throughput_steps:
            tps = _tokens_per_s(holder["t"], best, seq_len, opts.throughput_steps, world, opts.seed, say)
        holder.pop("t").close()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out["sides"][key] = {"config": side.config_path, "ranks": _gather(m.to_dict()), "max_micro_batch": best,
                             "trials": [t.__dict__ for t in trials], "tokens_per_s": tps,
                             "resident_at_start_bytes": resident_at_start}
        say(f"[{key}] max micro-batch {best}")

    ref = max(1, out["sides"]["baseline"]["max_micro_batch"])
    for key, m in measurements.items():
        out["sides"][key]["activations_at_ref_bytes"] = m.activations_at(ref)
    b, c = measurements["baseline"], measurements["coat"]
    bb, cb = out["sides"]["baseline"]["max_micro_batch"], out["sides"]["coat"]["max_micro_batch"]
    out["ratios"] = {"optimizer_states": c.optimizer_state_bytes / b.optimizer_state_bytes,
                     "activations_per_sample": c.activation_slope / b.activation_slope,
                     "max_micro_batch": cb / bb if bb else None}  # None: the baseline fits no batch
    out["meter"] = b.meter
    if rank == 0:
        table = markdown_table(out)
        print("\n" + table, flush=True)
        out["markdown"] = table
        write_json(out, os.path.join(opts.out, "profile.json"))
        write_chart(out, os.path.join(opts.out, "profile.png"))
        print(f"wrote {os.path.join(opts.out, 'profile.json')} and {os.path.join(opts.out, 'profile.png')}", flush=True)
    return out
