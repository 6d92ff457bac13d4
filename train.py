"""Train a Llama-style decoder with COAT's FP8-state optimizer under DeepSpeed or PyTorch FSDP.

    deepspeed train.py --deepspeed ds_configs/coat_zero2.json --config configs/1b.yaml
    torchrun --nproc_per_node 2 train.py --fsdp --config configs/1b.yaml --compress-activations

    # a CPU-only machine: DeepSpeed's CPU accelerator, 2 processes over gloo
    DS_ACCELERATOR=cpu deepspeed --num_accelerators 2 train.py \\
        --deepspeed ds_configs/coat_zero2.json --config configs/tiny.yaml
    torchrun --nproc_per_node 2 train.py --fsdp --config configs/tiny.yaml   # FSDP over gloo
    python train.py --config configs/tiny.yaml   # no launcher: one process, a world of one

`ds_configs/<name>.json` and `configs/<name>.yaml` are found from any directory (a file at
that path from the working directory wins).

Settings: the defaults in `TrainConfig` (coat_ds/train/config.py), then a YAML file
(`--config`), then flags (`--max-steps 100`); every value, and the DeepSpeed JSON, is checked
before anything is built, and the resolved result is printed at start. The DeepSpeed JSON owns the
optimizer (`"type": "CoatAdamW"` or a torch AdamW baseline), batch sizes, clipping and BF16
for both engines (the FSDP engine ignores its ZeRO section).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import resource
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import yaml

from coat_ds import Fp8LinearConfig, compress_activations, convert_to_fp8_linear, fuse_lm_head_loss, prepare
from coat_ds.io.checkpoint_folders import check_new_checkpoints, read_record
from coat_ds.io.safe_load import CheckpointError
from coat_ds.train.data import TokenData, batch_seed, load_data
from coat_ds.train.determinism import deterministic_kernels
from coat_ds.integrations.deepspeed.config import gradient_clipping, load_ds_config
from coat_ds.integrations.process_group import shutdown_distributed
from coat_ds.train.engine_setup import clipping_off_note, read_ds_settings
from coat_ds.integrations.deepspeed.engine import comm_op_build_note, single_process_world
from coat_ds.integrations.deepspeed.zero3 import compile_zero3_layers
from coat_ds.memory.training_state import TrainingStateBytes, gradient_bytes, per_rank_lines, training_state_bytes
from coat_ds.train.health_log import param_names, read_health
from coat_ds.train.metrics import MetricsLog
from coat_ds.train.mfu import mfu, mfu_note
from coat_ds.train.model_start import build_model, materialize, model_start
from coat_ds.models.llama import model_config
from coat_ds.train.config import (TrainConfig, checkpoint_plan, data_config, optimizer_overrides, parse_config,
                                  step_in_backward_refusal)
from coat_ds.optim import nonfinite_groups
from coat_ds.optim.health import stepped
from coat_ds.plan import apply_plan, compile_layer
from coat_ds.train.planning import plan_for_run, run_apply_config
from coat_ds.train.watchdog import resume_hint, start_watchdog


def will_save(cfg: TrainConfig, step: int) -> bool:
    """Whether a checkpoint is saved after `step` (1-based)."""
    return bool(cfg.save_interval and step % cfg.save_interval == 0) or step == cfg.max_steps


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """Share of the peak LR at `step`: linear warm-up, then cosine to `min_lr_ratio`."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# -- engines: each sets the model up and returns a Runner -------------------------------------

@dataclass
class Runner:
    """What the training loop needs from an engine."""

    train_micro_step: Callable  # (x, y, probe=None) -> loss; the engine decides when the optimizer steps (probe() runs after backward, before the step of a step's last micro-batch)
    eval_loss: Callable  # (x, y) -> loss without gradients
    save: Callable  # (save_dir, tag, client_state) -> None; the checkpoint appears only once complete
    load: Callable  # (checkpoint or save folder) -> (checkpoint folder loaded, client_state)
    lr: Callable  # () -> current learning rate
    optimizer_state_bytes: Callable  # () -> bytes of optimizer state (moments) on this rank
    nonfinite_groups: Callable  # () -> groups CoatAdamW skipped so far on this rank for non-finite values
    micro_batch: int  # sequences per rank per micro-step
    grad_accum: int  # micro-steps per optimizer step
    device: torch.device
    model: torch.nn.Module  # the module trained: its parameters are this rank's (shards, partitions)
    gradient_bytes: Callable  # () -> bytes of gradients this rank holds now (read after backward)
    state_bytes: Callable  # (gradient bytes) -> TrainingStateBytes of this rank (read after a step)
    optimizer: torch.optim.Optimizer  # the one stepping this rank's parameters (inside any engine's wrapper)
    stepped: list  # (tensor, param group) for every tensor it steps on this rank


def eval_loss_of(module: torch.nn.Module) -> Callable:
    """(x, y) -> loss in eval mode, without gradients, leaving `module` in train mode."""
    @torch.no_grad()
    def eval_loss(x, y):
        module.eval()
        loss = module(x, y)
        module.train()
        return loss
    return eval_loss


def setup_deepspeed(cfg: TrainConfig, model: torch.nn.Module) -> Runner:
    from coat_ds.train.engine_setup import optimizer_state_bytes
    from coat_ds.integrations.deepspeed.engine import engine_gradients, initialize, local_partitions
    from coat_ds.integrations.deepspeed.checkpoint import load_checkpoint, save_checkpoint

    config, overrides = cfg.deepspeed, optimizer_overrides(cfg)
    if overrides:  # the run's settings over the JSON's optimizer.params
        config = load_ds_config(cfg.deepspeed)
        config["optimizer"]["params"] = {**config["optimizer"].get("params", {}), **overrides}
    engine, _, _, _ = initialize(
        model=model, config=config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s)))

    def train_micro_step(x, y, probe=None):
        loss = engine(x, y)
        engine.backward(loss)
        if probe:
            probe()
        engine.step()
        return loss


    def load(load_dir):
        return load_checkpoint(engine, load_dir, trust_checkpoint=cfg.trust_checkpoint)

    base_optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # inside ZeRO's wrapper
    return Runner(train_micro_step, eval_loss_of(engine),
                  save=lambda d, tag, client: save_checkpoint(engine, d, tag, client, step=client["step"]),
                  load=load, lr=lambda: engine.get_lr()[0],
                  optimizer_state_bytes=lambda: optimizer_state_bytes(base_optimizer),
                  nonfinite_groups=lambda: nonfinite_groups(base_optimizer),
                  micro_batch=engine.train_micro_batch_size_per_gpu(),
                  grad_accum=engine.gradient_accumulation_steps(), device=engine.device, model=engine.module,
                  gradient_bytes=lambda: gradient_bytes(engine.module, base_optimizer, engine_gradients(engine)),
                  state_bytes=lambda grads: training_state_bytes(engine.module, base_optimizer, grads,
                                                                 [t for t, _ in local_partitions(engine)]),
                  optimizer=base_optimizer, stepped=local_partitions(engine))


def setup_fsdp_engine(cfg: TrainConfig, model: torch.nn.Module) -> Runner:
    """FSDP2 or FSDP1 with the optimizer, batch sizes, clipping and BF16 of the DeepSpeed JSON."""
    from coat_ds.train.engine_setup import build_optimizer, optimizer_state_bytes, read_ds_settings
    from coat_ds.integrations.fsdp import (clip_grad_norm_, load_checkpoint_folder, resolve_checkpoint,
                                           save_checkpoint, setup_fsdp)

    ds = read_ds_settings(cfg.deepspeed, dist.get_world_size())
    # As under DeepSpeed's bf16: FP32 master weights and optimizer, BF16 compute, FP32 reduction.
    if cfg.fsdp_shard_size and dist.get_world_size() % cfg.fsdp_shard_size:
        raise SystemExit(f"fsdp_shard_size {cfg.fsdp_shard_size} does not divide the {dist.get_world_size()} ranks")
    model = setup_fsdp(model, mode=cfg.fsdp_mode, param_dtype=torch.bfloat16 if ds.bf16 else None,
                       shard_size=cfg.fsdp_shard_size or None)
    if next(model.parameters()).is_meta:  # meta_start: this rank's shards get storage and values now
        materialize(model, train_device(), cfg.seed)
    # Stepping in backward, CoatAdamW clips itself (the gradients are gone once backward ends).
    in_backward = dict(step_in_backward=True, max_grad_norm=ds.clip or None) if cfg.step_in_backward else {}
    optim = build_optimizer(ds, model.parameters(), **optimizer_overrides(cfg), **in_backward)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: lr_factor(cfg, s))
    micro_steps = 0

    def train_micro_step(x, y, probe=None):
        nonlocal micro_steps
        micro_steps += 1
        last = micro_steps % ds.grad_accum == 0
        loss = model(x, y)
        # Before the last micro-batch, backward only accumulates: the step runs in the last one's.
        with optim.accumulating() if in_backward and not last else contextlib.nullcontext():
            (loss / ds.grad_accum).backward()  # the mean over the accumulated micro-batches, as DeepSpeed does
        if last:
            if probe:
                probe()
            if ds.clip and not in_backward:
                clip_grad_norm_(model, ds.clip, sync=False)  # the norm is not read: no wait for the GPU
            optim.step()
            optim.zero_grad(set_to_none=True)
            sched.step()
        return loss.detach()


    def load(load_dir):
        folder = resolve_checkpoint(load_dir, cfg.trust_checkpoint)
        step = load_checkpoint_folder(folder, model, optim, cfg.trust_checkpoint)  # resolved and verified once, above
        # The scheduler is not in the checkpoint: put it, and the LR it sets, at `step`.
        sched.last_epoch = step
        for group, base in zip(optim.param_groups, sched.base_lrs):
            group["lr"] = base * lr_factor(cfg, step)
        saved = (read_record(folder, verify=False) or {}).get("client_state", {})  # a record's, if it has one
        return folder, {**saved, "step": step}

    return Runner(train_micro_step, eval_loss_of(model),
                  save=lambda d, tag, client: save_checkpoint(os.path.join(d, tag), model, optim, client["step"],
                                                              client_state=client),
                  load=load, lr=lambda: optim.param_groups[0]["lr"],
                  optimizer_state_bytes=lambda: optimizer_state_bytes(optim),
                  nonfinite_groups=lambda: nonfinite_groups(optim),
                  micro_batch=ds.micro_batch, grad_accum=ds.grad_accum, device=train_device(), model=model,
                  gradient_bytes=lambda: gradient_bytes(model, optim),
                  state_bytes=lambda grads: training_state_bytes(model, optim, grads), optimizer=optim,
                  stepped=stepped(optim))


def train_device() -> torch.device:
    """The GPU this rank trains on (set at start by either engine's set-up), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def cap_gpu_memory(gb: float) -> None:
    """Allocations past `gb` on this rank's GPU fail as they would on a GPU of that size."""
    if not torch.cuda.is_available():
        say_before_group(f"gpu_memory_gb {gb:g}: no GPU, nothing to cap")
        return
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if gb * 1e9 > total:
        raise SystemExit(f"gpu_memory_gb: got {gb:g}; allowed: at most this GPU's {total / 1e9:.1f} GB")
    torch.cuda.set_per_process_memory_fraction(gb * 1e9 / total)
    say_before_group(f"GPU memory capped at {gb:g} GB of {total / 1e9:.1f} GB")


def init_fsdp_distributed(timeout: timedelta) -> None:
    """One process per GPU (NCCL) or CPU process (gloo), launched by torchrun; a plain
    `python train.py --fsdp` runs as a group of one (see `launch_env`)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timeout)


def init_deepspeed_distributed(timeout: timedelta) -> None:
    import deepspeed

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if os.environ.get("LOCAL_RANK", "0") == "0":  # one line per machine: the ranks there share the build
        say_before_group(comm_op_build_note())
    deepspeed.init_distributed(timeout=timeout)


def say_before_group(line: str | None) -> None:
    """Print `line` on rank 0 before any process group exists (the launcher's RANK says which)."""
    if line and os.environ.get("RANK", "0") == "0":
        print(line, flush=True)


def launch_env(engine: str) -> None:
    """The launcher's variables, or without one (plain `python train.py`) those of a world of
    one, as torchrun --nproc_per_node 1 would set them."""
    try:
        say_before_group(single_process_world(mpi=engine == "deepspeed"))  # DeepSpeed reads an MPI launch
    except RuntimeError as e:
        raise SystemExit(str(e)) from None


def quiet_known_warnings() -> None:
    """DeepSpeed's ZeRO calls `torch.distributed.all_gather_into_tensor` (and, under ZeRO-3,
    `reduce_scatter_tensor`), deprecated in torch 2.13: every rank would print torch's
    FutureWarning at the first step, about code that is neither the user's nor ours. Only those
    two messages are silenced."""
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning, module=r"torch\.distributed\.c10d_logger")


ENGINES = {"deepspeed": setup_deepspeed, "fsdp": setup_fsdp_engine}


# -- the loop -------------------------------------------------------------------------------

def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB; whole process


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; to a GPU from pinned memory without blocking, so that the host does not
    wait there for the last step's kernels and queues the next step's while they run."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def max_over_ranks(value: float) -> float:
    t = torch.tensor(float(value), dtype=torch.float64)
    if dist.is_initialized():
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def gather_over_ranks(values: list[float]) -> list[list[float]]:
    """`values` of every rank, in rank order."""
    t = torch.tensor(values, dtype=torch.float64)
    if not dist.is_initialized():
        return [t.tolist()]
    if dist.get_backend() == "nccl":
        t = t.cuda()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def mean_over_ranks(values: list[torch.Tensor]) -> float:
    t = torch.stack([v.detach().float() for v in values]).mean()
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item()


def evaluate(cfg: TrainConfig, runner: Runner, data: TokenData, rank: int) -> float:
    losses = []
    for i in range(cfg.eval_batches):
        x, y = data.batch("val", runner.micro_batch, cfg.seq_len, batch_seed(cfg.seed, i, rank, 0, "val"))
        losses.append(runner.eval_loss(to_device(x, runner.device), to_device(y, runner.device)))
    return mean_over_ranks(losses)


def first_step_note(cfg: TrainConfig, runner: Runner) -> str:
    """Why the first step is slow, where it is: CoatAdamW stepping host tensors loads its C++
    kernel there, built on a machine's first use."""
    optimizer = load_ds_config(cfg.deepspeed).get("optimizer") or {}
    if runner.device.type != "cpu" or str(optimizer.get("type", "")).lower() != "coatadamw":
        return ""
    return " (the first step also loads CoatAdamW's C++ host step, built with g++ once per machine: 5-16 s)"


def step_in_backward_note(cfg: TrainConfig) -> str | None:
    """The log line saying that CoatAdamW steps in backward and how it clips, or why recipe
    max_memory's step in backward does not apply, else None."""
    if not cfg.step_in_backward:
        if cfg.recipe != "max_memory":
            return None
        why = step_in_backward_refusal(cfg, read_ds_settings(cfg.deepspeed, 1, engine=cfg.engine))
        return f"step in backward: OFF although recipe max_memory asks for it: {why}"
    clip = gradient_clipping(load_ds_config(cfg.deepspeed))
    if clip:
        return (f"step in backward: ON with gradient_clipping {clip:g}: each FP32 gradient is freed as soon as FSDP2 "
                "has reduce-scattered it and a BF16 copy waits for step(), which clips with the exact global norm "
                "(2 of 4 bytes per parameter saved; gradient_clipping 0 steps inside backward and saves all 4)")
    return ("step in backward: ON: CoatAdamW steps each parameter as soon as FSDP2 has reduce-scattered its "
            "gradient and frees that gradient; no clipping")


def in_backward_gradients(cfg: TrainConfig) -> str:
    """What the training-state line's gradients are when CoatAdamW steps in backward."""
    if not cfg.step_in_backward:
        return ""
    if gradient_clipping(load_ds_config(cfg.deepspeed)):
        return "; stepping in backward: the BF16 copies held for the clipped step"
    return "; stepping in backward: each freed once stepped"


# Settings that change what each step computes: a resume may change them, and the log says so.
RESUME_COMPARED = ("recipe", "fp8_linear", "compress_activations", "fused_head_loss", "master_weights")


def resume_note(cfg: TrainConfig, saved: dict | None) -> str | None:
    """The log line naming the RESUME_COMPARED settings in which this run differs from the
    checkpoint's (`saved`: the train_config of its client state), else None."""
    def shown(v):
        return ("on" if v else "off") if isinstance(v, bool) else repr(v)

    differ = [f"{k} {shown(getattr(cfg, k))} (the checkpoint's run: {shown(saved[k])})"
              for k in RESUME_COMPARED if saved and k in saved and saved[k] != getattr(cfg, k)]
    if not differ:
        return None
    return f"settings unlike the checkpoint's: {', '.join(differ)}; training goes on with this run's"


def settings_lines(cfg: TrainConfig) -> list[str]:
    """What the run will do, printed first (before the process group and its op build)."""
    lines = ["resolved config:\n" + yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False), checkpoint_plan(cfg)]
    return lines + [line for line in [clipping_off_note(cfg.deepspeed), step_in_backward_note(cfg)] if line]


TRACE_STEPS = 3


def start_trace(device: torch.device) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)
    prof.start()
    return prof


def write_trace(prof: torch.profiler.profile, path: str, steps: int, say: Callable) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the steps' kernels end inside the trace
    prof.stop()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # Written beside, then renamed: a run killed mid-export leaves no truncated trace at `path`.
    # The partial name keeps the suffix, from which the profiler decides to gzip.
    partial = os.path.join(os.path.dirname(os.path.abspath(path)), ".partial." + os.path.basename(path))
    prof.export_chrome_trace(partial)
    os.replace(partial, path)
    say(f"trace of {steps} step(s) written to {path} (a category table: python bench/trace_gaps.py {path})",
        flush=True)


def train(cfg: TrainConfig) -> None:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    say = print if rank == 0 else (lambda *a, **k: None)
    # cuDNN's SDPA has given a wrong forward loss at one micro-batch of the 7B preset, and
    # turning it off slowed the 1b preset's coat run (docs/benchmarks.md). PyTorch's default
    # stays, and the log says it.
    torch.backends.cuda.enable_cudnn_sdp(cfg.cudnn_attention)
    say(f"attention: SDPA {'may use' if cfg.cudnn_attention else 'without'} cuDNN's kernels (cudnn_attention)",
        flush=True)
    data_cfg = data_config(cfg)
    say(f"loading data: {data_cfg.describe()}", flush=True)
    data = load_data(data_cfg, log=lambda line: print(line, flush=True))  # a corpus's build: the rank doing it
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    mcfg = model_config(cfg.preset, vocab_size=max(256, data.vocab_size), max_seq_len=max(cfg.seq_len, 1))
    ds = read_ds_settings(cfg.deepspeed, world, engine=cfg.engine)
    start = model_start(cfg, ds)
    say(start.note, flush=True)
    model = build_model(start, mcfg, cfg.seed, train_device(), cfg.deepspeed)
    say(f"data: {data.description}\nmodel: {cfg.preset}, {mcfg.num_params() / 1e6:.2f}M params", flush=True)
    fp8_config = Fp8LinearConfig(keep_weight_codes=cfg.fp8_keep_weight_codes)
    # Model edits on the unsharded modules, before either engine wraps them; the handle counts bytes.
    if cfg.recipe:
        report = prepare(model, cfg.recipe, fp8_linear=fp8_config)
        say(str(report), flush=True)
        activations = report.activations
    else:
        if cfg.fused_head_loss:
            fuse_lm_head_loss(model)  # the loss from chunks of the head's logits
        if cfg.fp8_linear:
            # Before the hooks and the engine: they see the converted modules.
            convert_to_fp8_linear(model, config=fp8_config)
        activations = compress_activations(model) if cfg.compress_activations else None
    if cfg.plan or cfg.memory_budget_gb:
        # Per block: keep, FP8-compress, FP8 linears or recompute; a budget is planned here, on rank 0.
        plan = plan_for_run(cfg, model, ds, say=lambda s: say(s, flush=True))
        say(plan.summary() + "\n" + "\n".join(f"  {fqn}: {c}" for fqn, c in plan.layers), flush=True)
        activations = apply_plan(model, plan, config=run_apply_config(cfg)).activations
        if plan.compile_memory_budget is not None and not cfg.compile:
            say(f"WARNING: the plan's torch.compile activation-memory budget ({plan.compile_memory_budget:g}) "
                "does nothing without compile: true; its layers save what eager autograd saves", flush=True)
    if cfg.compile:
        # Block by block, in place and before the engine wraps them (as torchtitan does):
        # the engines' hooks stay outside the graphs, and one graph serves every block.
        # ZeRO-3 hooks every submodule: its blocks become leaves, their forwards compiled.
        if cfg.engine == "deepspeed" and ds.zero_stage == 3:
            compile_zero3_layers(model)
        else:
            for block in model.blocks:
                compile_layer(block)

    say(f"setting up the {cfg.engine} engine with {cfg.deepspeed}" + (
        f"; HSDP: each parameter sharded over {cfg.fsdp_shard_size} ranks, replicated "
        f"{world // cfg.fsdp_shard_size} times" if cfg.fsdp_shard_size else ""), flush=True)
    runner = ENGINES[cfg.engine](cfg, model)
    start = 0
    if cfg.resume:
        loaded, client_state = runner.load(cfg.resume)
        start = int(client_state["step"])
        if dist.is_initialized():
            dist.barrier()  # said once every rank has loaded (one that failed has ended the group)
        say(f"resumed from {loaded} at step {start}", flush=True)
        note = resume_note(cfg, client_state.get("train_config"))
        if note:
            say(note, flush=True)
    if cfg.save_dir:  # before training, not at the first save that would hit them
        check_new_checkpoints(cfg.save_dir, [f"step{s}" for s in range(start + 1, cfg.max_steps + 1)
                                             if will_save(cfg, s)])
    tokens_per_step = runner.micro_batch * runner.grad_accum * cfg.seq_len * world
    say(f"{world} rank(s), micro-batch {runner.micro_batch} x grad-accum {runner.grad_accum} x seq {cfg.seq_len}: "
        f"{tokens_per_step:,} tokens/step", flush=True)
    peak, note = mfu_note(mcfg, cfg.seq_len, runner.device)
    say(note, flush=True)
    metrics = MetricsLog(cfg.metrics_file) if cfg.metrics_file and rank == 0 else None
    if metrics and metrics.last_step:
        say(f"{cfg.metrics_file} already holds steps up to {metrics.last_step}: only later steps are appended",
            flush=True)

    def record(**m):
        if metrics:
            metrics.write(**m)

    def save(step: int) -> None:
        try:
            runner.save(cfg.save_dir, f"step{step}", {"step": step, "train_config": dataclasses.asdict(cfg)})
        except CheckpointError as e:  # every rank gets it: rank 0 says it
            raise SystemExit(f"{e}\n{resume_hint(cfg.save_dir, cfg.resume)}" if rank == 0 else 1) from None
        say(f"saved checkpoint {cfg.save_dir}/step{step}", flush=True)

    say(f"training steps {start + 1} to {cfg.max_steps}, a log line every {cfg.log_interval} steps"
        f"{first_step_note(cfg, runner)}", flush=True)
    trace_first = start + cfg.trace_after if cfg.trace and rank == 0 else None
    tracer = None
    if trace_first is not None and trace_first >= cfg.max_steps:  # resumed past it
        say(f"WARNING: no trace: the run resumes at step {start + 1}, and trace_after ({cfg.trace_after}) steps "
            f"from there is past max_steps ({cfg.max_steps})", flush=True)
        trace_first = None
    if trace_first is not None:
        say(f"tracing steps {trace_first + 1} to {min(trace_first + TRACE_STEPS, cfg.max_steps)} into {cfg.trace} "
            "(their tok/s includes the profiler's cost)", flush=True)
    t0, t_start, window = time.perf_counter(), time.perf_counter(), []
    grads_read: list[int] = []  # gradient bytes after the first step's backward
    names = param_names(runner.stepped, runner.model)
    for step in range(start, cfg.max_steps):
        if step == trace_first:
            tracer = start_trace(runner.device)
        for micro in range(runner.grad_accum):
            x, y = data.batch("train", runner.micro_batch, cfg.seq_len, batch_seed(cfg.seed, step, rank, micro))
            last = step == start and micro == runner.grad_accum - 1
            probe = (lambda: grads_read.append(runner.gradient_bytes())) if last else None
            window.append(runner.train_micro_step(to_device(x, runner.device), to_device(y, runner.device), probe))
        done = step + 1
        if tracer is not None and (done == trace_first + TRACE_STEPS or done == cfg.max_steps):
            write_trace(tracer, cfg.trace, done - trace_first, say)
            tracer = None
        if step == start:  # optimizer state exists once the first step ran
            state_gb = max_over_ranks(runner.optimizer_state_bytes()) / 1e9
            say(f"optimizer state: {state_gb:.4g} GB on the largest rank", flush=True)
            record(step=done, optimizer_state_gb=state_gb)
            mine = runner.state_bytes(grads_read[-1])
            per_rank = [TrainingStateBytes(*map(int, v)) for v in gather_over_ranks(list(mine.as_dict().values()))]
            numel = mcfg.num_params()  # FSDP1's parameters are flat pieces: their shapes do not say it
            say(f"training state, bytes per parameter, read from the live tensors (weights and optimizer state after "
                f"step {done}, gradients after its backward{in_backward_gradients(cfg)}):", flush=True)
            say("\n".join(per_rank_lines(per_rank, numel)), flush=True)
            record(step=done, training_state_bytes_per_param=TrainingStateBytes.sum(per_rank).per_param(numel))
            if activations and cfg.compile:
                say("saved activations: quantized inside the compiled blocks (the hooks count only "
                    "what runs eagerly)", flush=True)
            elif activations:
                a = activations.stats()  # rank 0's micro-batches of this first step
                say(f"saved activations, step {done} on rank 0: {a.compressed_bytes / 1e6:.4g} MB with FP8 vs "
                    f"{a.uncompressed_bytes / 1e6:.4g} MB without (ratio {a.ratio:.2f})", flush=True)
                record(step=done, activation_compression_ratio=a.ratio)
        if done % cfg.log_interval == 0 or done == cfg.max_steps:
            loss = mean_over_ranks(window)
            steps_in_window = len(window) // runner.grad_accum
            dt = time.perf_counter() - t0
            tok_s = tokens_per_step * steps_in_window / dt
            eta = (time.perf_counter() - t_start) / (done - start) * (cfg.max_steps - done)
            mem = max_over_ranks(peak_memory_gb(runner.device))
            skipped = round(mean_over_ranks([torch.tensor(float(runner.nonfinite_groups()), device=runner.device)])
                            * world)
            util = mfu(tok_s / world, mcfg, cfg.seq_len, peak) if peak else None
            say(f"step {done}/{cfg.max_steps} ({100 * done / cfg.max_steps:3.0f}%) | loss {loss:.4f} | "
                f"lr {runner.lr():.2e} | {tok_s:,.0f} tok/s{f' | MFU {100 * util:.1f}%' if util else ''} | "
                f"peak mem {mem:.2f} GB (max rank) | eta {eta:.0f}s | non-finite groups skipped {skipped}", flush=True)
            record(step=done, loss=loss, lr=runner.lr(), tokens_per_s=tok_s, peak_mem_gb=mem,
                   nonfinite_groups_skipped=skipped, **({"mfu": util} if util else {}))
            health = read_health(runner.optimizer, runner.stepped, names)
            say(health.line(), flush=True)
            if health.problem():
                say(f"WARNING: step {done}: {health.problem()}", flush=True)
            record(step=done, **health.metrics())
            t0, window = time.perf_counter(), []
        if (cfg.eval_interval and done % cfg.eval_interval == 0) or done == cfg.max_steps:
            val = evaluate(cfg, runner, data, rank)
            say(f"step {done}: eval loss {val:.4f}", flush=True)
            record(step=done, eval_loss=val)
            t0 = time.perf_counter()  # eval time is not training throughput
        if cfg.save_dir and will_save(cfg, done):
            save(done)
            t0 = time.perf_counter()
    if metrics:
        metrics.close()


def main(argv=None) -> None:
    cfg = parse_config(sys.argv[1:] if argv is None else argv, description=__doc__)
    quiet_known_warnings()
    launch_env(cfg.engine)
    for line in settings_lines(cfg):
        say_before_group(line)
    if cfg.deterministic:  # before the process group and the first CUDA call
        deterministic_kernels()
        say_before_group("deterministic kernels: on (a GPU run repeats bit for bit, more slowly)")
    (init_deepspeed_distributed if cfg.engine == "deepspeed" else init_fsdp_distributed)(
        timedelta(seconds=cfg.dist_timeout_s))
    if cfg.gpu_memory_gb:
        cap_gpu_memory(cfg.gpu_memory_gb)
    watchdog = start_watchdog(cfg.heartbeat_timeout_s, lambda: resume_hint(cfg.save_dir, cfg.resume))
    try:
        train(cfg)
    except BaseException as e:
        if watchdog:
            watchdog.failed(e)  # ends here, naming the rank, if a dead one caused `e`
        raise
    if watchdog:
        watchdog.finish()
    shutdown_distributed()
    if watchdog:
        watchdog.stop()


if __name__ == "__main__":
    main()
