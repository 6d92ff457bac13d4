"""One profiler run: set up the process group, measure both sides, search, report."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from ..integrations.deepspeed.engine import free_port
from ..models.llama import PRESETS, model_config
from .trainee import build_trainee, load_side
from .measure import SideMeasurement, measure_side, train_step, unless_oom
from .options import ProfileOptions, child_argv
from .planned import profile_plan
from .report import markdown_table, write_chart, write_json, write_markdown
from .search import CudaTrial, Trial, budget_fits, search_max_batch

__all__ = ["profile", "resolve_model", "combine"]

VOCAB = 256  # byte-level tokens, as train.py's default data


def resolve_model(spec: str, seq_len: int | None, vocab_size: int = 256):
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
    return name, model_config(name, vocab_size=vocab_size, max_seq_len=max(seq, PRESETS[name]["max_seq_len"])), seq


def _init_distributed(engine: str) -> None:
    if engine == "none" or (dist.is_available() and dist.is_initialized()):
        return
    if "RANK" not in os.environ:  # started without a launcher: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
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


def _load_sides(opts: ProfileOptions) -> dict:
    sides = {"baseline": load_side("baseline", opts.baseline),
             "coat": load_side("coat", opts.config, fp8_linear=opts.fp8_linear,
                               step_in_backward=opts.step_in_backward)}
    if sides["baseline"].is_coat or not sides["coat"].is_coat:
        raise ValueError("--config must name CoatAdamW and --baseline another optimizer (BF16 + torch AdamW)")
    return sides


def _launched() -> bool:
    """Started by a launcher (torchrun, deepspeed): this process is one rank of a group."""
    return "RANK" in os.environ or "LOCAL_RANK" in os.environ


def profile(opts: ProfileOptions) -> dict:
    """Run the profiler; every rank returns the result, rank 0 prints and writes it.

    Both sides, not under a launcher: each side runs in processes of its own (see
    `_profile_isolated`). Otherwise the sides asked for run here, one after the other."""
    # Bad options fail here, before any process or engine starts.
    sides = _load_sides(opts)
    vocab = opts.vocab_size or (32000 if opts.plan else VOCAB)
    name, mcfg, seq_len = resolve_model(opts.model, opts.seq_len, vocab)
    if opts.budget_gb is None and not torch.cuda.is_available():
        raise ValueError("on a CPU the search runs against a budget: give --budget-gb")
    if opts.plan:
        return _profile_plan(opts, name, mcfg, seq_len)
    if opts.side == "both" and opts.isolate and not _launched():
        return _profile_isolated(opts)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is first imported
    _init_distributed(opts.engine)
    device = _device()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    if opts.budget_gb is not None:
        budget = opts.budget_gb * 1e9
    else:
        budget = float(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        # The allocator itself refuses beyond the budget, so a trial over it is a real OOM.
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    search = ("real training steps on the GPU, out-of-memory caught" if device.type == "cuda"
              else "measured fixed bytes + per-sample activation bytes against the budget (CPU)")
    say(f"model {name}: {mcfg.num_params() / 1e6:.1f}M params, seq {seq_len}, engine {opts.engine}, "
        f"{world} rank(s) on {device.type}; budget {budget / 1e9:.3f} GB per rank; search: {search}")

    if opts.side == "both":
        say("both sides run in this process, one after the other: what the first leaves allocated is "
            "charged to the second (start without a launcher, with --nproc N, to run each in its own processes)")

    meta = {"model": {"name": name, "params": mcfg.num_params(), "spec": opts.model}, "seq_len": seq_len,
            "engine": opts.engine, "world_size": world, "device": str(device), "budget_bytes": budget,
            "search": search, "measure_batches": list(opts.measure_batches)}
    keys = ("baseline", "coat") if opts.side == "both" else (opts.side,)
    results = {key: _measure_and_search(opts, sides[key], mcfg, seq_len, device, budget, world, say)
               for key in keys}
    if opts.side != "both":
        if rank == 0:
            write_json({"meta": meta, "side": results[opts.side]}, os.path.join(opts.out, "side.json"))
            say(f"wrote {os.path.join(opts.out, 'side.json')}")
        return {**meta, "sides": results}
    out = combine(meta, results)
    if rank == 0:
        _report(out, opts.out)
    return out


def _measure_and_search(opts: ProfileOptions, side, mcfg, seq_len: int, device: torch.device, budget: float,
                        world: int, say) -> dict:
    """One side: its components measured, its largest micro-batch searched, its tokens/s there."""
    key, holder = side.name, {}
    rank = dist.get_rank() if dist.is_initialized() else 0

    def close():
        if "t" in holder:
            holder.pop("t").close()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    def rebuild():
        close()
        holder["t"] = build_trainee(opts.engine, side, mcfg, device, opts.seed)

    resident_at_start = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    if resident_at_start and resident_at_start > 0.01 * budget:
        # Charged to this side: its engine buffers and its max micro-batch are then off.
        say(f"[{key}] WARNING: {resident_at_start / 1e9:.3f} GB from the previous side is still allocated; "
            "this side's engine buffers, peak and max micro-batch include it")
    extras = (", FP8 linears" if side.fp8_linear else "") + (", steps in backward" if side.step_in_backward else "")
    say(f"[{key}] building ({opts.engine}, {side.config_path}{extras})")
    rebuild()
    m = measure_side(holder["t"], opts.measure_batches, seq_len, VOCAB, opts.seed, rank, say)
    if device.type == "cuda":
        fits = CudaTrial(lambda: holder["t"], rebuild, seq_len, VOCAB, opts.seed,
                         budget if opts.budget_gb is not None else None, say,
                         predicted=m.predicted_step_total if world > 1 else None, limit_bytes=budget)
    else:
        fits = budget_fits(m, budget)
    say(f"[{key}] searching the largest micro-batch (doubling, then bisection)")
    best, trials = search_max_batch(fits, opts.max_batch, say, key)
    # Ranks can disagree under the budget test (the last ZeRO rank holds the padding).
    best = min(_gather(best))
    tps = None
    while device.type == "cuda" and best > 0 and opts.throughput_steps:
        trainee = holder["t"]
        tps = unless_oom(trainee, lambda: _tokens_per_s(trainee, best, seq_len, opts.throughput_steps, world,
                                                        opts.seed, say), say)
        if tps is not None:
            break
        # A batch that fitted once, near the limit, and not on repeat (allocator fragmentation) does not fit.
        say(f"[{key}] micro-batch {best} ran out of memory in the throughput steps; taking {best - 1} as the max")
        trials.append(Trial(best, False, None))
        best -= 1
        rebuild()  # an engine interrupted mid-backward may be unusable
    close()
    say(f"[{key}] max micro-batch {best}")
    return {"config": side.config_path, "fp8_linear": side.fp8_linear, "step_in_backward": side.step_in_backward,
            "ranks": _gather(m.to_dict()),
            "max_micro_batch": best,
            "trials": [t.__dict__ for t in trials], "tokens_per_s": tps, "resident_at_start_bytes": resident_at_start}


def _profile_plan(opts: ProfileOptions, name: str, mcfg, seq_len: int) -> dict:
    device = _device()
    budget = opts.budget_gb * 1e9 if opts.budget_gb is not None else \
        float(torch.cuda.get_device_properties(device).total_memory)
    print(f"model {name}: {mcfg.num_params() / 1e6:.1f}M params, vocab {mcfg.vocab_size}, seq {seq_len}, on "
          f"{device.type}; budget {budget / 1e9:.3f} GB; planning per decoder layer", flush=True)
    return profile_plan(opts, mcfg, seq_len, device, budget, lambda s: print(s, flush=True))


def combine(meta: dict, sides: dict) -> dict:
    """The whole result from both sides' results: ratios of rank 0's figures, and each side's
    activations at the baseline's max micro-batch and at its own (what the chart draws)."""
    out = {**meta, "sides": sides}
    m = {key: SideMeasurement.from_dict(side["ranks"][0]) for key, side in sides.items()}
    ref = max(1, sides["baseline"]["max_micro_batch"])
    for key, side in sides.items():
        side["activations_at_ref_bytes"] = m[key].activations_at(ref)
        side["activations_at_max_bytes"] = m[key].activations_at(max(1, side["max_micro_batch"]))
    b, c = m["baseline"], m["coat"]
    bb, cb = sides["baseline"]["max_micro_batch"], sides["coat"]["max_micro_batch"]
    out["ratios"] = {"optimizer_states": c.optimizer_state_bytes / b.optimizer_state_bytes,
                     "activations_per_sample": c.activation_slope / b.activation_slope,
                     "max_micro_batch": cb / bb if bb else None}  # None: the baseline fits no batch
    out["meter"] = b.meter
    return out


def _report(out: dict, directory: str) -> None:
    table = markdown_table(out)
    print("\n" + table, flush=True)
    out["markdown"] = table
    write_json(out, os.path.join(directory, "profile.json"))
    write_markdown(table, os.path.join(directory, "profile.md"))
    kinds = ("json", "md", "png") if write_chart(out, os.path.join(directory, "profile.png")) else ("json", "md")
    print(f"wrote {', '.join(os.path.join(directory, f'profile.{x}') for x in kinds)}", flush=True)


def _side_command(opts: ProfileOptions, side: str, out: str) -> list[str]:
    args = ["-m", "coat_ds.profile", *child_argv(opts, side, out)]
    if opts.engine == "none":
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(opts.nproc),
            "--master_port", str(free_port()), *args]


def _profile_isolated(opts: ProfileOptions) -> dict:
    """Each side in processes of its own (ranks through torchrun), one side after the other,
    so neither is charged for what the other leaves allocated (a ZeRO-3 engine that hit an
    out-of-memory error inside its forward is not freed); this process combines their
    `DIR/<side>/side.json` into the report. A side that fails stops the run, naming it;
    the sides already measured stay on disk."""
    results, meta = {}, None
    for side in ("baseline", "coat"):
        directory = os.path.join(opts.out, side)
        cmd = _side_command(opts, side, directory)
        print(f"[{side}] in its own processes: {' '.join(cmd)}", flush=True)
        code = subprocess.run(cmd).returncode
        if code != 0:
            raise RuntimeError(f"the {side} side failed (exit status {code}); command: {' '.join(cmd)}")
        path = os.path.join(directory, "side.json")
        try:
            with open(path) as f:
                part = json.load(f)
        except (OSError, ValueError) as e:
            raise RuntimeError(f"the {side} side's result {path} is unreadable: {e}") from e
        meta = meta or part["meta"]
        results[side] = part["side"]
    out = combine(meta, results)
    _report(out, opts.out)
    return out
