"""What the clients people run get: Hugging Face Trainer with DeepSpeed (its defaults, eager or
torch_compile=True) and Accelerate with its FSDP2 plugin, BF16 against `coat_ds.prepare`, on
every GPU of the machine, each side in a launch of its own (`NGPU` ranks):

    bash bench/device_env.sh python bench/clients.py trainer --stage 2 --sides bf16 coat bf16_compiled coat_compiled
    bash bench/device_env.sh python bench/clients.py accelerate --sides bf16 coat
    bash bench/device_env.sh python bench/clients.py trainer --sides bf16 coat --trace   # + where the GPU waits
    DS_ACCELERATOR=cpu NGPU=2 python bench/clients.py trainer --shape tiny --seq 64 --micro 2 --steps 4   # CPU

bf16: the model as built, trained in BF16 (Trainer's bf16=True, DeepSpeed's bf16 section; FSDP2's
BF16 parameters) with torch's fused AdamW (the JSON's "AdamW" with torch_adam under DeepSpeed).
coat: coat_ds.prepare(model, --recipe) first, and CoatAdamW (named in the JSON under DeepSpeed).
`_compiled`: Trainer's torch_compile=True. Each run reports the mean step after --warmup steps,
tokens/s, the time from train() (or the first forward) to the end of the first step, and the
peak memory of the largest rank; the table, last, gives ratios against the bf16 side of the
same mode. `--trace`: rank 0 also records the TRACE_STEPS steps after the timed window with
torch.profiler, and the driver prints each side's kernel categories and idle gaps
(bench/trace_gaps.py)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import _common as C
import torch

LR = 3e-4


# -- workers (one per rank, started by torchrun) ----------------------------------------------

def _setup(spec: dict) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _tokens(spec: dict, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, C.SHAPES[spec["shape"]]["vocab_size"], (rows, spec["seq"]), generator=g)


def _model(spec: dict, dev: torch.device):
    import coat_ds

    model = C.hf_llama(spec["shape"], spec["seq"], dev=dev)
    report = coat_ds.prepare(model, spec["recipe"]) if spec["side"].startswith("coat") else None
    return model, (str(report) if report else "")


class Clock:
    """End-of-step times without a wait for the GPU, except at the window's two edges (the end
    of step `warmup` and of the last step): a wait every step would keep the host from queueing
    the next step while the GPU runs this one, which hides whatever host time a side costs."""

    def __init__(self, spec: dict):
        self.warmup, self.steps = spec["warmup"], spec["steps"]
        self.start = time.perf_counter()
        self.stamps: list[float] = []

    def step_end(self) -> None:
        if len(self.stamps) + 1 in (1, self.warmup, self.steps):
            C.sync()
        self.stamps.append(time.perf_counter())


TRACE_STEPS = 2


class Tracer:
    """Rank 0's profiler over the TRACE_STEPS steps after the timed window (`spec["trace"]`: the
    chrome trace's path), so that the timing stays untraced."""

    def __init__(self, spec: dict):
        rank0 = int(os.environ.get("RANK", 0)) == 0
        self.path, self.first, self.prof = spec.get("trace"), spec["steps"], None
        if not (self.path and rank0):
            self.first = None

    def step_begin(self, done: int) -> None:
        if done == self.first:
            from train import start_trace

            self.prof = start_trace(C.device())

    def step_end(self, done: int) -> None:
        if self.prof is not None and done == self.first + TRACE_STEPS:
            from train import write_trace

            write_trace(self.prof, self.path, TRACE_STEPS, print)
            self.prof = None


def steps_run(spec: dict) -> int:
    return spec["steps"] + (TRACE_STEPS if spec.get("trace") else 0)


def _result(spec: dict, clock: Clock, losses: list[float], report: str) -> dict:
    """The rank-0 record of a run."""
    import torch.distributed as dist

    stamps = clock.stamps[:spec["steps"]]
    step = (stamps[-1] - stamps[spec["warmup"] - 1]) / (len(stamps) - spec["warmup"])
    peak = torch.tensor(float(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else 0.0,
                        device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    world = dist.get_world_size()
    return {"side": spec["side"], "step_s": step, "first_step_s": stamps[0] - clock.start,
            "tokens_per_s": spec["micro"] * spec["seq"] * world / step, "peak_gb": peak.item() / 1e9,
            "losses": losses, "world": world, "report": report}


def ds_config(spec: dict) -> dict:
    """The JSON a Trainer user writes: Trainer fills every "auto"."""
    auto = {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}
    optimizer = ({"type": "CoatAdamW", "params": auto} if spec["side"].startswith("coat") else
                 {"type": "AdamW", "params": {**auto, "torch_adam": True, "fused": torch.cuda.is_available()}})
    # Hugging Face's documented ZeRO-2/3 sections (gradients reduced in buckets while backward
    # runs), but DeepSpeed's own reduce_bucket_size (5e8): Trainer's "auto" (hidden_size^2) makes
    # a bucket per weight matrix, and DeepSpeed's host work per bucket then outlasts coat's backward
    # (docs/huggingface.md); --ds-set zero_optimization.reduce_bucket_size='"auto"' puts it back.
    zero = {"stage": spec["stage"], "overlap_comm": True, "contiguous_gradients": True,
            **({"stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}
               if spec["stage"] == 3 else {"allgather_bucket_size": 2e8})}
    # DeepSpeed's per-step overflow check off on both sides (CoatAdamW then skips a step whose
    # global norm is not finite on the device; torch AdamW does not skip): the check reads a
    # flag back from the GPU after several kernels per gradient tensor.
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "bf16": {"enabled": "auto", "check_grad_overflow": False},
              "zero_optimization": zero,
              "optimizer": optimizer, "steps_per_print": 10**9, "zero_allow_untested_optimizer": True}
    for setting in spec.get("ds_set") or []:
        key, _, value = setting.partition("=")
        *path, last = key.split(".")
        node = config
        for part in path:
            node = node.setdefault(part, {})
        node[last] = json.loads(value)
    return config


def trainer_worker(spec: dict) -> dict:
    import coat_ds
    from transformers import Trainer, TrainerCallback, TrainingArguments

    dev = _setup(spec)
    coat_ds.register_deepspeed()
    model, report = _model(spec, dev)
    world = int(os.environ.get("WORLD_SIZE", 1))
    ids = _tokens(spec, spec["micro"] * world * (steps_run(spec) + 1))
    rows = [{"input_ids": r, "labels": r} for r in ids]
    clock, tracer = Clock(spec), Tracer(spec)

    class StepEnd(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            tracer.step_begin(state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            clock.step_end()
            tracer.step_end(state.global_step)

    # Losses logged at the window's edges only: a logged loss waits for the GPU.
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=spec["micro"],
                             max_steps=steps_run(spec), learning_rate=LR, weight_decay=0.1, adam_beta2=0.95,
                             bf16=torch.cuda.is_available(), torch_compile=spec["side"].endswith("_compiled"),
                             deepspeed=ds_config(spec), logging_steps=spec["warmup"], save_strategy="no",
                             report_to=[], disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[StepEnd()])
    clock.start = time.perf_counter()
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if args.torch_compile and int(os.environ.get("RANK", 0)) == 0:
        from torch._dynamo.utils import compile_times

        print("compile times:\n" + compile_times(repr="str"), flush=True)
    return _result(spec, clock, losses, report)


def accelerate_worker(spec: dict) -> dict:
    import coat_ds
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    dev = _setup(spec)
    model, report = _model(spec, dev)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision="bf16")
    opt_cls = coat_ds.CoatAdamW if spec["side"].startswith("coat") else torch.optim.AdamW
    extra = {} if opt_cls is coat_ds.CoatAdamW else {"fused": True}
    optimizer = opt_cls(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1, **extra)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = _tokens(spec, spec["micro"] * accelerator.num_processes * steps_run(spec)).to(dev)
    clock, tracer, losses = Clock(spec), Tracer(spec), []
    for step in range(steps_run(spec)):
        tracer.step_begin(step)
        lo = (step * accelerator.num_processes + accelerator.process_index) * spec["micro"]
        batch = ids[lo:lo + spec["micro"]]
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        clock.step_end()
        tracer.step_end(step + 1)
    return _result(spec, clock, [v.item() for v in losses[:spec["steps"]:spec["warmup"]]], report)


def worker(kind: str, spec_json: str) -> None:
    import torch.distributed as dist

    spec = json.loads(spec_json)
    result = (trainer_worker if kind == "trainer" else accelerate_worker)(spec)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# -- driver -----------------------------------------------------------------------------------

def run_side(args, side: str, port: int) -> dict:
    spec = {"side": side, "shape": args.shape, "seq": args.seq, "micro": args.micro, "steps": args.steps,
            "warmup": args.warmup, "recipe": args.recipe, "stage": args.stage,
            "ds_set": args.ds_set, "trace": os.path.join(args.out, f"{args.cmd}_{side}.json.gz") if args.trace else None}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(C.ngpu()), "--master_port", str(port),
           __file__, "--worker", args.cmd, json.dumps(spec)]
    log = os.path.join(args.out, f"{args.cmd}_{side}.log")
    # Compiled sides log every recompilation: the reason a first step takes long.
    env = {**os.environ, "TORCH_LOGS": "recompiles"} if side.endswith("_compiled") else None
    t0 = time.time()
    code = C.launch(cmd, log, args.limit, env)
    found = [line for line in open(log) if line.startswith("RESULT ")]
    print(f"{side}: exit {code} in {time.time() - t0:.0f} s", flush=True)
    if code != 0 or not found:
        return {"side": side, "error": f"exit {code}; log {log}"}
    return json.loads(found[-1][len("RESULT "):])


def table(args, rows: list[dict]) -> list[str]:
    what = (f"Trainer + DeepSpeed ZeRO-{args.stage}{' (' + ', '.join(args.ds_set) + ')' if args.ds_set else ''}" if args.cmd == "trainer" else "Accelerate + FSDP2 plugin")
    lines = [f"{what}, HF Llama {args.shape}, micro-batch {args.micro} x seq {args.seq}, {C.ngpu()} ranks, "
             f"coat = prepare(recipe={args.recipe!r}); step: mean after {args.warmup} steps",
             "| side | step ms | tokens/s | vs bf16 | first step s | vs bf16 | peak GB / rank | vs bf16 | "
             "loss (logged) first -> last |", "|---|---|---|---|---|---|---|---|---|"]
    by_side = {r["side"]: r for r in rows}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['side']} | {r['error']} |||||||| ")
            continue
        base = by_side.get("bf16_compiled" if r["side"].endswith("_compiled") else "bf16", {})
        ok = "error" not in base and base

        def ratio(key, inverse=False):
            if not ok or not (base[key] and r[key]):  # no peak memory on the CPU
                return ""
            return f"{(base[key] / r[key]) if inverse else (r[key] / base[key]):.3f}x"

        lines.append(f"| {r['side']} | {1e3 * r['step_s']:.1f} | {r['tokens_per_s']:,.0f} | {ratio('step_s', True)} | "
                     f"{r['first_step_s']:.1f} | {ratio('first_step_s')} | {r['peak_gb']:.2f} | {ratio('peak_gb')} | "
                     f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} |")
    return lines


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cmd", choices=["trainer", "accelerate"])
    ap.add_argument("--sides", nargs="+", default=["bf16", "coat"],
                    choices=["bf16", "coat", "bf16_compiled", "coat_compiled"])
    ap.add_argument("--shape", default="1b", choices=sorted(C.SHAPES))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4, help="steps left out of the mean")
    ap.add_argument("--recipe", default="speed", choices=["speed", "memory", "max_memory"])
    ap.add_argument("--stage", type=int, default=2, choices=[1, 2, 3], help="trainer: the ZeRO stage")
    ap.add_argument("--limit", type=float, default=400, help="seconds per side")
    ap.add_argument("--ds-set", nargs="+", default=[], metavar="KEY=JSON",
                    help="trainer: settings of the DeepSpeed JSON on every side, e.g. zero_optimization.reduce_bucket_size=5e8")
    ap.add_argument("--trace", action="store_true", help="rank 0's profiler trace of the steps after the window, "
                    "and its kernel categories and idle gaps printed")
    ap.add_argument("--out", default=None, help="folder for the logs and the table (default runs/clients)")
    args = ap.parse_args(argv)
    if args.cmd == "accelerate" and any(s.endswith("_compiled") for s in args.sides):
        ap.error("accelerate: eager sides only")
    args.out = os.path.abspath(args.out or os.path.join("runs", "clients"))
    os.makedirs(args.out, exist_ok=True)
    print(C.header() + f", {C.ngpu()} ranks", flush=True)
    from coat_ds.integrations.deepspeed.engine import free_port

    rows = [run_side(args, side, free_port()) for side in args.sides]
    if args.trace:
        from trace_gaps import gaps

        for side in args.sides:
            path = os.path.join(args.out, f"{args.cmd}_{side}.json.gz")
            if os.path.exists(path):
                print(f"\n{side}: {TRACE_STEPS} steps traced\n" + "\n".join(gaps(path, 12)), flush=True)
    for r in rows:
        if r.get("report"):
            print(r["report"])
            break
    lines = table(args, rows)
    C.finish(args, f"clients_{args.cmd}", rows, lines)


if __name__ == "__main__":
    main()
