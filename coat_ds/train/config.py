"""train.py's settings: the `TrainConfig` dataclass, its command line and its YAML file.

Defaults, then a YAML file (`--config`), then flags. Every value is type- and range-checked,
and the DeepSpeed JSON that both engines read is checked too (`read_ds_settings`), before
any model, process group or engine exists; an error names where the value came from (the
YAML file or the flag), the key, the value and what is allowed.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import os
import tokenize
from dataclasses import dataclass

import yaml

from ..config import RECIPES
from ..config.checks import ConfigError, boolean, choice, integer, number, text
from ..kernels.master import MASTER_KINDS
from .corpus import is_corpus
from .data import DataConfig
from .engine_setup import read_ds_settings
from .tokenizer import BYTE_VOCAB
from ..models.llama import PRESETS
from ..config.shipped import find_ds_config, find_train_preset

__all__ = ["TrainConfig", "ENGINE_NAMES", "data_config", "parse_config", "build_parser", "checkpoint_plan",
           "field_docs", "step_in_backward_refusal", "master_weights_refusal", "optimizer_overrides"]

ENGINE_NAMES = ("deepspeed", "fsdp")
_FSDP_MODES = ("fsdp2", "fsdp1")
_BIN_DTYPES = ("uint8", "uint16", "uint32", "int16", "int32", "int64")
_TOKENIZERS = ("byte", "bpe")
_MASTER_FORMS = ("", *MASTER_KINDS)  # "": the JSON's optimizer.params decide


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a run, with its default."""

    # model and data
    preset: str = "small"  # model size, one of coat_ds.models.llama.PRESETS
    seq_len: int = 256  # tokens per sequence
    data: str = "stdlib"  # "stdlib" (Python's own sources), a text file, a pre-tokenised .bin, or a corpus: a directory or a glob ('dir/**/*.py')
    bin_dtype: str = "uint16"  # element type of a .bin data file
    val_fraction: float = 0.05  # share of the data held out for eval loss, in (0, 1) (a corpus: val_file_fraction)
    max_data_bytes: int = 32_000_000  # cap on stdlib text read at start-up
    val_file_fraction: float = 0.01  # a corpus: share of its files held out for eval loss (at least one)
    tokenizer: str = "byte"  # a corpus: "byte" (256 ids) or "bpe" (trained on a sample of its train split; the model's vocabulary follows)
    bpe_vocab_size: int = 32000  # tokenizer bpe: ids, <|endoftext|> and the 256 byte symbols included
    bpe_sample_bytes: int = 50_000_000  # tokenizer bpe: bytes of train-split text it learns from
    data_cache: str = ""  # a corpus: folder of its tokenised cache, reused while the files and tokenizer match ("": ~/.cache/coat_ds/corpus)
    # schedule (peak LR, betas and weight decay live in the DeepSpeed JSON)
    max_steps: int = 1000  # optimizer steps to train to
    warmup_steps: int = 100  # steps of linear LR warm-up
    min_lr_ratio: float = 0.1  # cosine decays the LR to this share of its peak, in [0, 1]
    seed: int = 1337  # model init and batch sampling
    deterministic: bool = False  # deterministic kernels (torch.use_deterministic_algorithms, cuBLAS's fixed workspace): two GPU runs of one seed, and a resume at the same world size, end bit for bit alike; slower
    meta_start: bool = True  # each rank allocates and initialises only its shard of the weights (FSDP2: built on the meta device; ZeRO-3: deepspeed.zero.Init); the weights are then drawn per shard, the same at any world size (off, or FSDP1 / ZeRO-1/2: the whole model on every rank, Llama's own init)
    # logging, eval, checkpoints
    log_interval: int = 10  # steps between log lines
    eval_interval: int = 200  # steps between eval losses (0: only at the end)
    eval_batches: int = 20  # micro-batches per rank in one eval
    save_dir: str = ""  # where checkpoints go ("": none are saved)
    save_interval: int = 0  # steps between checkpoints (0: only at the end; unused without save_dir)
    resume: str = ""  # checkpoint folder to resume from, any data-parallel size ("": start fresh)
    trust_checkpoint: bool = False  # resume may unpickle any type the checkpoint names (only for a source you trust)
    metrics_file: str = ""  # JSON lines of every logged metric, written by rank 0 ("": none)
    trace: str = ""  # a torch.profiler trace (Chrome JSON, .json.gz) of 3 steps after trace_after, rank 0's ("": none)
    trace_after: int = 10  # steps run before the trace starts (compilation and warm-up stay out of it)
    # engine
    gpu_memory_gb: float = 0.0  # cap each rank's GPU memory at this many GB (torch.cuda.set_per_process_memory_fraction): whether a run fits a smaller GPU, checked on a larger one (0: the whole GPU)
    dist_timeout_s: int = 300  # process-group timeout, seconds: a collective that waits longer fails the run (docs/train_faults.md)
    heartbeat_timeout_s: int = 60  # a rank silent this long is gone: the others end at once, naming it and the checkpoint to resume (0: off)
    engine: str = "deepspeed"  # what sets the model up: "deepspeed" or "fsdp" (same as --fsdp)
    deepspeed: str = "ds_configs/coat_zero2.json"  # DeepSpeed JSON: optimizer, batches, clipping, BF16 (both engines)
    fsdp_mode: str = "fsdp2"  # FSDP engine: "fsdp2" (fully_shard) or "fsdp1" (FullyShardedDataParallel)
    fsdp_shard_size: int = 0  # fsdp2: 0 shards over every rank; k is HSDP: sharded within groups of k ranks (a host's GPUs), replicated across them
    compress_activations: bool = False  # store saved activations in FP8 (coat_ds.compress_activations)
    compile: bool = False  # torch.compile each decoder block (FP8 activations then compiled into its graphs)
    cudnn_attention: bool = True  # SDPA may choose cuDNN's attention, as PyTorch does (off: flash / memory-efficient only, slower for coat at the 1b preset; cuDNN's gave one 7B forward a wrong loss, docs/benchmarks.md)
    fp8_linear: bool = False  # FP8 GEMMs in the blocks' linear layers (coat_ds.convert_to_fp8_linear; head kept)
    fp8_keep_weight_codes: bool = False  # with fp8_linear: backward reads forward's FP8 weight (+1 byte per weight element held; under fsdp or ZeRO-3 every gathered layer's)
    master_weights: str = ""  # CoatAdamW's master weights: "fp32", "bf16+16" (BF16 weight + 16-bit remainder, exact) or "bf16+8" (+ 8-bit, lossy) ("": the JSON's optimizer.params, else fp32)
    step_in_backward: bool = False  # CoatAdamW steps each parameter in backward and frees its gradient (FSDP2 only; the JSON's optimizer.params "step_in_backward": true turns it on too)
    fused_head_loss: bool = False  # the head's loss in chunks, never the full logits (coat_ds.fuse_lm_head_loss)
    recipe: str = ""  # coat_ds.prepare's recipe: "speed", "memory" or "max_memory" (it sets fp8_linear, compress_activations and fused_head_loss; "": none)
    plan: str = ""  # planner's JSON: per block keep / fp8 / fp8_linear / recompute (coat_ds.apply_plan; "": none)
    memory_budget_gb: float = 0.0  # search a plan at start that fits this many GB per rank (0: none)
    recompute_input_fp8: bool = False  # the plan's recomputed blocks keep their input as FP8 codes until backward (~3.8x smaller than FP32; lossy like compressed activations)

    def __post_init__(self):
        choice("preset", self.preset, tuple(PRESETS))
        integer("seq_len", self.seq_len, lo=1)
        text("data", self.data, nonempty=True)
        choice("bin_dtype", self.bin_dtype, _BIN_DTYPES)
        number("val_fraction", self.val_fraction, lo=0.0, hi=1.0, lo_open=True, hi_open=True)
        integer("max_data_bytes", self.max_data_bytes, lo=1)
        number("val_file_fraction", self.val_file_fraction, lo=0.0, hi=1.0, lo_open=True, hi_open=True)
        choice("tokenizer", self.tokenizer, _TOKENIZERS)
        if self.tokenizer == "bpe" and not is_corpus(self.data):
            raise ConfigError("tokenizer", self.tokenizer, f"'byte' unless data is a directory or a glob (got data "
                              f"{self.data!r})")
        integer("bpe_vocab_size", self.bpe_vocab_size, lo=BYTE_VOCAB + 1, hi=2**32)
        integer("bpe_sample_bytes", self.bpe_sample_bytes, lo=1)
        text("data_cache", self.data_cache)
        integer("max_steps", self.max_steps, lo=1)
        integer("warmup_steps", self.warmup_steps, lo=0)
        number("min_lr_ratio", self.min_lr_ratio, lo=0.0, hi=1.0)
        integer("seed", self.seed, lo=0, hi=2**63 - 1)
        boolean("deterministic", self.deterministic)
        boolean("meta_start", self.meta_start)
        integer("log_interval", self.log_interval, lo=1)
        integer("eval_interval", self.eval_interval, lo=0)
        integer("eval_batches", self.eval_batches, lo=1)
        for name in ("save_dir", "resume", "metrics_file", "trace"):
            text(name, getattr(self, name))
        integer("trace_after", self.trace_after, lo=0)
        number("gpu_memory_gb", self.gpu_memory_gb, lo=0.0)
        if self.trace and self.trace_after >= self.max_steps:
            raise ConfigError("trace_after", self.trace_after, f"under max_steps ({self.max_steps}): the trace "
                              "would never start")
        integer("save_interval", self.save_interval, lo=0)
        integer("dist_timeout_s", self.dist_timeout_s, lo=1)
        integer("heartbeat_timeout_s", self.heartbeat_timeout_s, lo=0)
        boolean("trust_checkpoint", self.trust_checkpoint)
        choice("engine", self.engine, ENGINE_NAMES)
        text("deepspeed", self.deepspeed, nonempty=True)
        choice("fsdp_mode", self.fsdp_mode, _FSDP_MODES)
        integer("fsdp_shard_size", self.fsdp_shard_size, lo=0)
        if self.fsdp_shard_size and (self.engine != "fsdp" or self.fsdp_mode != "fsdp2"):
            raise ConfigError("fsdp_shard_size", self.fsdp_shard_size, "0 unless engine is fsdp with fsdp_mode fsdp2 "
                              "(HSDP is FSDP2's; under DeepSpeed see its zero_hpz_partition_size)")
        boolean("compress_activations", self.compress_activations)
        boolean("compile", self.compile)
        boolean("cudnn_attention", self.cudnn_attention)
        boolean("fp8_linear", self.fp8_linear)
        boolean("fp8_keep_weight_codes", self.fp8_keep_weight_codes)
        choice("master_weights", self.master_weights, _MASTER_FORMS)
        boolean("step_in_backward", self.step_in_backward)
        boolean("fused_head_loss", self.fused_head_loss)
        choice("recipe", self.recipe, ("", *RECIPES))
        if self.recipe:
            for key in ("fp8_linear", "compress_activations", "fused_head_loss"):
                if getattr(self, key):
                    raise ConfigError(key, True, f"off with recipe {self.recipe!r}, which sets it")
        if self.fp8_keep_weight_codes and not (self.fp8_linear or self.recipe):
            raise ConfigError("fp8_keep_weight_codes", True, "off unless fp8_linear or a recipe is on (it is an option "
                              "of the FP8 linear layers)")
        text("plan", self.plan)
        number("memory_budget_gb", self.memory_budget_gb, lo=0.0)
        boolean("recompute_input_fp8", self.recompute_input_fp8)
        if self.recompute_input_fp8 and not (self.plan or self.memory_budget_gb):
            raise ConfigError("recompute_input_fp8", True, "off without a plan (plan / memory_budget_gb): "
                              "it applies to the blocks a plan recomputes")
        if self.plan and self.memory_budget_gb:
            raise ConfigError("memory_budget_gb", self.memory_budget_gb, f"0 when a plan file is given ({self.plan})")
        if (self.plan or self.memory_budget_gb) and (self.compress_activations or self.fp8_linear or self.recipe):
            key = "compress_activations" if self.compress_activations else "fp8_linear" if self.fp8_linear else "recipe"
            raise ConfigError(key, getattr(self, key), "off with a plan (plan / memory_budget_gb): the plan chooses it "
                              "per block")


_CHOICES = {"preset": tuple(PRESETS), "bin_dtype": _BIN_DTYPES, "tokenizer": _TOKENIZERS, "engine": ENGINE_NAMES,
            "fsdp_mode": _FSDP_MODES, "recipe": RECIPES, "master_weights": _MASTER_FORMS[1:]}


def field_docs(cls) -> dict[str, str]:
    """{field: its trailing `# comment`} from the class source: the one place fields are documented."""
    source = inspect.getsource(cls)
    comments = {tok.start[0]: tok.string.lstrip("# ").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    body = ast.parse(source).body[0].body
    return {node.target.id: comments.get(node.end_lineno, "") for node in body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return '""' if value == "" else str(value)


def _flag_type(kind: type):
    def parse(s: str):
        try:
            return kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {s!r}; allowed: {'an integer' if kind is int else 'a number'}")
    parse.__name__ = kind.__name__
    return parse


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """One flag per `TrainConfig` field (`--max-steps`; `--max_steps` is accepted, unlisted)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", metavar="YAML", help="YAML file of TrainConfig fields (the flag names with _); "
                    "flags override it")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--fsdp", dest="engine", action="store_const", const="fsdp", help="same as --engine fsdp")
    docs = field_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = f"--{f.name.replace('_', '-')}"
        # argparse %-formats help text: a literal % (the comments hold some) is written %%.
        helptext = f"{docs.get(f.name, f.name)} (default: {_shown(f.default)})".replace("%", "%%")
        names = [flag] + ([f"--{f.name}"] if "_" in f.name else [])
        for i, name in enumerate(names):
            shown = helptext if i == 0 else argparse.SUPPRESS
            if f.type == "bool":
                ap.add_argument(name, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=shown)
                continue
            kind = {"int": int, "float": float}.get(f.type, str)
            metavar = "{" + ",".join(_CHOICES[f.name]) + "}" if f.name in _CHOICES else kind.__name__.upper()
            ap.add_argument(name, dest=f.name, default=None, type=_flag_type(kind) if kind is not str else str,
                            metavar=metavar, help=shown)
    return ap


def _read_yaml(path: str) -> dict:
    try:
        path = find_train_preset(path)
    except FileNotFoundError as e:
        raise SystemExit(f"--config: {e}") from None
    try:
        with open(path) as fh:
            values = yaml.safe_load(fh)
    except OSError as e:
        raise SystemExit(f"--config {path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise SystemExit(f"--config {path}: not valid YAML: {e}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise SystemExit(f"--config {path}: expected a mapping of settings, got {type(values).__name__}")
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    unknown = [k for k in values if k not in names]
    if unknown:
        raise SystemExit(f"{path}: unknown setting(s) {sorted(map(str, unknown))}; valid: {', '.join(names)}")
    return values


def _world_size() -> int:
    """The launcher's world size (torchrun and deepspeed set WORLD_SIZE; alone: 1)."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return integer("WORLD_SIZE", int(raw), lo=1)
    except ValueError:
        raise SystemExit(f"environment WORLD_SIZE: got {raw!r}; allowed: an integer >= 1") from None


def parse_config(argv: list[str], description: str | None = None) -> TrainConfig:
    """Defaults <- YAML (`--config`) <- flags, then every value and the DeepSpeed JSON checked.
    Exits (SystemExit with the message) on the first bad value."""
    args = build_parser(description).parse_args(argv)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = _read_yaml(args.config) if args.config else {}
    origin = {k: args.config for k in values}
    for k, v in vars(args).items():
        if k in names and v is not None:
            values[k], origin[k] = v, f"--{k.replace('_', '-')}"
    try:
        cfg = TrainConfig(**values)
    except ConfigError as e:
        raise SystemExit(f"{origin.get(e.key, 'settings')}: {e}") from None
    try:
        # The shipped JSON when `ds_configs/<name>.json` is not there from here: the default works
        # from any directory, and every later reader (engines, planner, log) sees the file used.
        cfg = dataclasses.replace(cfg, deepspeed=find_ds_config(cfg.deepspeed))
        ds = read_ds_settings(cfg.deepspeed, _world_size(), engine=cfg.engine)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--deepspeed: {e}") from None
    why = master_weights_refusal(cfg, ds)
    if why:
        raise SystemExit(f"{origin.get('master_weights', 'settings')}: {why}")
    return _resolve_step_in_backward(cfg, ds, origin.get("step_in_backward", "settings"))


def _resolve_step_in_backward(cfg: TrainConfig, ds, origin: str) -> TrainConfig:
    """`step_in_backward` on when the YAML/flag or the JSON's `optimizer.params` says so (the
    resolved config then shows it), refused where CoatAdamW cannot step in backward; recipe
    max_memory turns it on where it can."""
    in_json = ds.optimizer_params.get("step_in_backward") is True
    why = step_in_backward_refusal(cfg, ds)
    if not (cfg.step_in_backward or in_json):
        return dataclasses.replace(cfg, step_in_backward=True) if cfg.recipe == "max_memory" and not why else cfg
    if why:
        where = f"{cfg.deepspeed} (optimizer.params.step_in_backward)" if in_json else origin
        raise SystemExit(f"{where}: {why}")
    return dataclasses.replace(cfg, step_in_backward=True)


def master_weights_refusal(cfg: TrainConfig, ds) -> str | None:
    """Why `master_weights` cannot be set in this run (`ds`: its read_ds_settings), or None."""
    if not cfg.master_weights:
        return None
    if ds.optimizer_type != "CoatAdamW":
        return _needs_coat("master_weights", cfg, ds)
    if cfg.engine == "fsdp" and cfg.fsdp_mode == "fsdp1" and cfg.master_weights != "fp32":
        return (f"master_weights {cfg.master_weights!r} is for FSDP2 and DeepSpeed ZeRO: FSDP1's flat parameters "
                "are not converted to BF16; use --fsdp-mode fsdp2")
    return None


def _needs_coat(option: str, cfg: TrainConfig, ds) -> str:
    return f"{option} needs CoatAdamW; {cfg.deepspeed} names optimizer.type {ds.optimizer_type!r}"


def optimizer_overrides(cfg: TrainConfig) -> dict:
    """CoatAdamW keyword arguments that the run's settings put over the JSON's optimizer.params."""
    return {"master_weights": cfg.master_weights} if cfg.master_weights else {}


def step_in_backward_refusal(cfg: TrainConfig, ds) -> str | None:
    """Why CoatAdamW cannot step in backward in this run (`ds`: its read_ds_settings), or None."""
    if ds.optimizer_type != "CoatAdamW":
        return _needs_coat("step_in_backward", cfg, ds)
    if cfg.engine == "deepspeed":
        return ("step_in_backward is not supported by the DeepSpeed engine: ZeRO copies each gradient into its own "
                "buckets and reduces it after the parameter's hook, the one point where CoatAdamW could step; use "
                "--fsdp (FSDP2)")
    if cfg.fsdp_mode == "fsdp1":
        return ("step_in_backward is not supported with --fsdp-mode fsdp1: FSDP1 reduces gradients after the "
                "parameter's hook fires, so each rank would step its own gradient; use --fsdp-mode fsdp2 (its hook "
                "fires after reduce-scatter)")
    if "max_grad_norm" in ds.optimizer_params:
        return (f"optimizer.params.max_grad_norm in {cfg.deepspeed}: not read by train.py; its gradient_clipping "
                "sets the clipping of both engines")
    return None


def data_config(cfg: TrainConfig) -> DataConfig:
    """Where the run's tokens come from."""
    return DataConfig(cfg.data, cfg.bin_dtype, cfg.val_fraction, cfg.max_data_bytes,
                      val_file_fraction=cfg.val_file_fraction, tokenizer=cfg.tokenizer,
                      bpe_vocab_size=cfg.bpe_vocab_size, bpe_sample_bytes=cfg.bpe_sample_bytes,
                      cache_dir=cfg.data_cache)


def checkpoint_plan(cfg: TrainConfig) -> str:
    """The log line saying where checkpoints go, or that none will be saved."""
    if not cfg.save_dir:
        unused = f", so save_interval {cfg.save_interval} is unused" if cfg.save_interval else ""
        return f"checkpoints: NONE will be saved (save_dir is empty{unused}; pass --save-dir DIR to keep them)"
    every = f"every {cfg.save_interval} steps and " if cfg.save_interval else ""
    return f"checkpoints: saved under {cfg.save_dir} {every}at the end (step {cfg.max_steps})"
