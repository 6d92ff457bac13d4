"""What one profiler run is asked to do: a frozen, validated record of the command line."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch

from ..config.shipped import resolve_ds_config, shipped_dirs
from ..plan import CHOICES, MeasureConfig

__all__ = ["ProfileOptions", "build_parser", "parse_options", "child_argv", "ENGINES", "SIDES"]

ENGINES = ("none", "deepspeed", "fsdp")
SIDES = ("both", "baseline", "coat")


@dataclass(frozen=True)
class ProfileOptions:
    """One profiler run."""

    model: str  # preset name from coat_ds.models.llama.PRESETS, or a YAML file with `preset:` (and optional `seq_len:`)
    engine: str = "none"  # "none" (one process, plain PyTorch), "deepspeed" or "fsdp"
    config: str = "ds_configs/coat_zero2.json"  # COAT side's DeepSpeed JSON (its optimizer on every engine)
    baseline: str = "ds_configs/bf16_zero2.json"  # DeepSpeed JSON of the BF16 + torch AdamW side; found as `config` is
    budget_gb: float | None = None  # per-rank budget, GB (1e9 bytes); None: the GPU's memory (required on CPU)
    seq_len: int | None = None  # tokens per sequence; None: the YAML's seq_len, else the preset's max_seq_len
    out: str = "profile_out"  # directory for profile.json and profile.png
    measure_batches: tuple[int, int] = (1, 2)  # the two micro-batches whose activation bytes give the per-sample slope
    max_batch: int = 4096  # the search never tries a larger micro-batch
    throughput_steps: int = 3  # timed steps at each side's max micro-batch (CUDA only; 0: skip)
    seed: int = 0  # initial weights and token ids
    side: str = "both"  # "both", or measure only "baseline" / "coat" and write DIR/side.json (the parent run's part)
    isolate: bool = True  # both sides: each in processes of its own, started here (no launcher needed)
    nproc: int = 1  # isolated runs: ranks per side, started through torchrun (needs --engine deepspeed or fsdp)
    plan: bool = False  # plan per decoder layer within the budget instead (one process, --engine none): DIR/plan.json
    choices: tuple[str, ...] = ("keep", "fp8", "recompute")  # --plan: the choices measured and searched
    vocab_size: int | None = None  # --plan: tokens in the vocabulary; None: 32000 (Llama's)
    compile: bool = False  # --plan: torch.compile each decoder block before measuring
    compile_budgets: tuple[float, ...] = ()  # --plan --compile: torch.compile activation-memory budgets measured too
    fp8_linear: bool = False  # COAT side: FP8 linears (convert_to_fp8_linear) before the activation hooks
    step_in_backward: bool = False  # COAT side (and --plan): CoatAdamW(step_in_backward=True), gradients freed in backward

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        for name in ("config", "baseline"):
            path = resolve_ds_config(getattr(self, name))
            if not os.path.isfile(path):
                raise ValueError(f"--{name}: no such file {path!r} (relative paths start at {os.getcwd()!r}; "
                                 f"ds_configs/<name>.json is also looked up in {', '.join(shipped_dirs())})")
            object.__setattr__(self, name, path)
        if self.budget_gb is not None and not self.budget_gb > 0:
            raise ValueError(f"--budget-gb must be > 0, got {self.budget_gb!r}")
        if self.seq_len is not None and self.seq_len <= 0:
            raise ValueError(f"--seq-len must be > 0, got {self.seq_len!r}")
        b1, b2 = self.measure_batches
        if not 1 <= b1 < b2:
            raise ValueError(f"measure batches must satisfy 1 <= b1 < b2, got {self.measure_batches!r}")
        if self.side not in SIDES:
            raise ValueError(f"--side must be one of {SIDES}, got {self.side!r}")
        if self.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {self.nproc!r}")
        if self.nproc > 1 and self.engine == "none":
            raise ValueError(f"--nproc {self.nproc} needs --engine deepspeed or fsdp (engine 'none' is one process)")
        if self.max_batch < 1 or self.throughput_steps < 0:
            raise ValueError("--max-batch must be >= 1 and --throughput-steps >= 0")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"--vocab-size must be >= 1, got {self.vocab_size!r}")
        bad = [c for c in self.choices if c not in CHOICES]
        if bad or not self.choices:
            raise ValueError(f"--choices: got {list(self.choices)!r}; allowed: one or more of {', '.join(CHOICES)}")
        if self.plan and (self.engine != "none" or self.nproc != 1):
            raise ValueError("--plan runs in one process: give --engine none (the default) and no --nproc")
        if not self.plan and (self.compile or self.vocab_size is not None):
            raise ValueError("--compile and --vocab-size are for --plan runs")
        if self.compile_budgets and not (self.plan and self.compile):
            raise ValueError("--compile-budgets is for --plan --compile runs (torch reads the budget when it "
                             "compiles a graph)")
        object.__setattr__(self, "compile_budgets",
                           MeasureConfig(compile_budgets=self.compile_budgets).compile_budgets)
        if self.step_in_backward and self.engine == "deepspeed":
            raise ValueError("--step-in-backward needs --engine none or fsdp: DeepSpeed reduces gradients after "
                             "the hook that would step them")
        if self.plan and self.fp8_linear:
            raise ValueError("--fp8-linear is for the two-side comparison; with --plan, give the choice "
                             "fp8_linear in --choices")


def build_parser() -> argparse.ArgumentParser:
    """The profiler's command line; every option has its help text."""
    p = argparse.ArgumentParser(prog="python -m coat_ds.profile",
                                description="Where training memory goes under BF16 AdamW and under COAT, "
                                            "and the largest micro-batch each fits.")
    p.add_argument("--model", required=True, help="preset name (tiny, small, 1b, 7b, ...) or YAML config")
    p.add_argument("--engine", default="none", choices=ENGINES,
                   help="none: one process, plain PyTorch; deepspeed or fsdp: that engine (default: none)")
    p.add_argument("--config", default=ProfileOptions.config,
                   help="DeepSpeed JSON of the COAT side (ds_configs/<name>.json: the shipped one from any directory)")
    p.add_argument("--baseline", default=ProfileOptions.baseline,
                   help="DeepSpeed JSON of the baseline side (found as --config is)")
    p.add_argument("--budget-gb", type=float, default=None, help="memory budget per rank (GB); required on CPU")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (default: the YAML's seq_len, else the preset's max_seq_len)")
    p.add_argument("--out", default=ProfileOptions.out,
                   help="directory for profile.json and profile.png (default: %(default)s)")
    p.add_argument("--measure-batches", type=int, nargs=2, default=list(ProfileOptions.measure_batches),
                   metavar=("B1", "B2"),
                   help="the two micro-batches whose activation bytes give the per-sample slope (default: 1 2)")
    p.add_argument("--max-batch", type=int, default=ProfileOptions.max_batch,
                   help="largest micro-batch the search tries (default: %(default)s)")
    p.add_argument("--throughput-steps", type=int, default=ProfileOptions.throughput_steps,
                   help="timed steps at each side's largest micro-batch, CUDA only; 0 skips them "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and token ids (default: 0)")
    p.add_argument("--side", default="both", choices=SIDES,
                   help="measure one side only (what each isolated child process runs)")
    p.add_argument("--in-process", action="store_true",
                   help="measure both sides in this process, one after the other (the first side's leftovers "
                        "are then charged to the second)")
    p.add_argument("--nproc", type=int, default=1, help="ranks per side, started here through torchrun")
    p.add_argument("--plan", action="store_true",
                   help="measure keep / FP8 / recompute per decoder layer, search the plan with the most tokens/s "
                        "within --budget-gb, write DIR/plan.json and a report (one process)")
    p.add_argument("--choices", nargs="+", default=list(ProfileOptions.choices),
                   help="--plan: choices measured and searched (keep fp8 fp8_linear recompute)")
    p.add_argument("--vocab-size", type=int, default=None, help="--plan: vocabulary size (default 32000)")
    p.add_argument("--compile", action="store_true", help="--plan: torch.compile each decoder block")
    p.add_argument("--compile-budgets", type=float, nargs="+", default=[],
                   help="--plan --compile: also measure under these torch.compile activation-memory budgets "
                        "(0..1) and let the plan pick one")
    p.add_argument("--fp8-linear", action="store_true",
                   help="COAT side: FP8 linear layers (convert_to_fp8_linear) as well as FP8 activations")
    p.add_argument("--step-in-backward", action="store_true",
                   help="COAT side (and --plan): CoatAdamW(step_in_backward=True) steps each parameter in backward "
                        "and frees its gradient there (engines none and fsdp; docs/profiler.md)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return p


def parse_options(argv: list[str] | None = None) -> ProfileOptions:
    p = build_parser()
    a = p.parse_args(argv)
    if a.budget_gb is None and not torch.cuda.is_available():
        p.error("--budget-gb is required without a CUDA GPU: on a CPU the search runs against a budget "
                "(e.g. --budget-gb 0.1)")
    try:
        return ProfileOptions(model=a.model, engine=a.engine, config=a.config, baseline=a.baseline,
                              budget_gb=a.budget_gb, seq_len=a.seq_len, out=a.out,
                              measure_batches=tuple(a.measure_batches), max_batch=a.max_batch,
                              throughput_steps=a.throughput_steps, seed=a.seed, side=a.side,
                              isolate=not a.in_process, nproc=a.nproc, plan=a.plan, choices=tuple(a.choices),
                              vocab_size=a.vocab_size, compile=a.compile, fp8_linear=a.fp8_linear,
                              compile_budgets=tuple(a.compile_budgets), step_in_backward=a.step_in_backward)
    except ValueError as e:  # a bad value is a usage error: argparse's message and exit status 2
        p.error(str(e))


def child_argv(opts: ProfileOptions, side: str, out: str) -> list[str]:
    """The command-line arguments of a run that measures `side` of `opts` into `out`."""
    argv = ["--model", opts.model, "--engine", opts.engine, "--config", opts.config, "--baseline", opts.baseline,
            "--out", out, "--measure-batches", *map(str, opts.measure_batches), "--max-batch", str(opts.max_batch),
            "--throughput-steps", str(opts.throughput_steps), "--seed", str(opts.seed), "--side", side]
    if opts.budget_gb is not None:
        argv += ["--budget-gb", repr(opts.budget_gb)]
    if opts.seq_len is not None:
        argv += ["--seq-len", str(opts.seq_len)]
    if opts.fp8_linear:
        argv.append("--fp8-linear")
    if opts.step_in_backward:
        argv.append("--step-in-backward")
    return argv
