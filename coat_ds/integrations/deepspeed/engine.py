"""CoatAdamW under DeepSpeed: named in the JSON config, handed to ZeRO 1/2/3, memory reported.

DeepSpeed's `optimizer.type` only resolves its own optimizers or `torch.optim.<Name>`, so
`initialize` reads the config itself: for `"type": "CoatAdamW"` it builds the optimizer from
`optimizer.params`, removes the section from what DeepSpeed sees and passes the instance as a
client optimizer. Nothing in DeepSpeed or torch.optim is patched; the one addition is
CoatAdamW's entry in DeepSpeed's list of ZeRO-tested optimizers (`mark_zero_tested`), which
its ZeRO check reads. A config path `ds_configs/<name>.json` that does not exist from the
working directory is the shipped file; a process that no launcher started runs as a world of
one (`single_process_world`).

What ZeRO hands a client optimizer (DeepSpeed 0.19.8, checked by tests/test_deepspeed*.py):
ZeRO-1/2 replace each param group's params by ONE flat FP32 tensor, this rank's partition
(crossing parameter boundaries, padded to a multiple of 2 x world size on the last rank);
ZeRO-3 keeps the param groups empty and calls `step()` once per sub-group with that
sub-group's flat FP32 partition swapped in. The partitions are long-lived tensors, so
CoatAdamW's per-tensor state (FP8 codes, scales, `step`) stays keyed to the right one.
"""
from __future__ import annotations

import copy
import importlib.util
import os
import socket
from dataclasses import dataclass

import torch

from ..._compat.deepspeed import comm_op_build, fp32_partitions
from ...optim import CoatAdamW
from ...optim import state as st
from ...optim.state import group_state_config
from ...config.shipped import find_ds_config
from .config import (OPTIMIZER_ARGUMENTS, batch_keys, bf16_key, gradient_clipping, load_ds_config, optimizer_section,
                     precision, zero_stage)
from .registry import mark_zero_tested, skip_steps_on_device

__all__ = [
    "bf16_masters",
    "OPTIMIZER_TYPE",
    "OPTIMIZER_PARAMS",
    "prepare_config",
    "optimizer_settings",
    "initialize",
    "LAUNCH_VARS",
    "LAUNCH_HINT",
    "single_process_world",
    "free_port",
    "comm_op_build_note",
    "coat_optimizer",
    "local_partitions",
    "engine_gradients",
    "group_state_config",
    "StateMemoryReport",
    "state_memory_report",
]

OPTIMIZER_TYPE = "CoatAdamW"
# The keys `optimizer.params` may hold: CoatAdamW's keyword arguments.
OPTIMIZER_PARAMS = OPTIMIZER_ARGUMENTS[OPTIMIZER_TYPE]


def prepare_config(config) -> tuple[dict, dict | None]:
    """Split a DeepSpeed config (dict or JSON path) into what DeepSpeed should see and the
    CoatAdamW keyword arguments (None when the config names another optimizer or none).

    Raises ValueError, naming the key, for a value that DeepSpeed would misread or fail on
    without naming it (batch sizes, clipping, precision, ZeRO stage: checked as for the FSDP
    engine, by `coat_ds.integrations.deepspeed.config`), for an unknown optimizer parameter and for settings
    whose checkpoint code would corrupt FP8 state (`elastic_checkpoint`, universal load) or
    that cannot host it (NVMe optimizer offload). Warns about top-level keys DeepSpeed does
    not know."""
    ds = load_ds_config(config)
    where = os.fspath(config) if isinstance(config, (str, os.PathLike)) else "DeepSpeed config"
    batch_keys(ds, where)
    gradient_clipping(ds, where)
    bf16_enabled = precision(ds, where)[0]
    zero_stage(ds, where)
    # Only CoatAdamW is ours to build; DeepSpeed builds and checks any other optimizer.
    found = optimizer_section(ds, where, checked=(OPTIMIZER_TYPE,), pass_others=True)
    if found is None or found[0] != OPTIMIZER_TYPE:
        return ds, None
    kwargs = found[1]
    zero = ds.get("zero_optimization") or {}
    if zero.get("elastic_checkpoint"):
        # DeepSpeed's elastic path trims `padding` elements off every 1-D state tensor and
        # treats tensors not shaped like the partition (our scales) as replicated.
        raise ValueError("DeepSpeed config: zero_optimization.elastic_checkpoint=true is not supported with "
                         f"{OPTIMIZER_TYPE}: it would corrupt the per-group FP8 scales. Leave it false; to resume at "
                         "another data-parallel size use coat_ds.integrations.deepspeed.checkpoint.load_checkpoint")
    if (ds.get("checkpoint") or {}).get("load_universal"):
        raise ValueError("DeepSpeed config: checkpoint.load_universal=true is not supported with "
                         f"{OPTIMIZER_TYPE} (universal checkpoints assume FP32 exp_avg/exp_avg_sq); use "
                         "coat_ds.integrations.deepspeed.checkpoint to change the data-parallel size")
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    if offload == "nvme":
        raise ValueError(f"DeepSpeed config: offload_optimizer.device='nvme' is not supported with {OPTIMIZER_TYPE} "
                         "(DeepSpeed's swapper assumes partition-shaped state tensors); use 'cpu'")
    if offload == "cpu":
        if kwargs.get("backend", "auto") == "triton":
            raise ValueError(f"DeepSpeed config: offload_optimizer.device='cpu' steps {OPTIMIZER_TYPE} on host tensors; "
                             "optimizer.params.backend must be 'auto' or 'torch', not 'triton'")
        # Otherwise DeepSpeed insists on its own DeepSpeedCPUAdam for offloaded states.
        ds["zero_force_ds_cpu_optimizer"] = False
    bf16 = bf16_key(ds)
    _master_weights(ds, bf16, bf16_enabled, zero.get("stage", 0), offload, kwargs.get("master_weights", "fp32"))
    if (bf16_enabled and zero.get("stage", 0) in (1, 2) and offload == "none"
            and zero.get("compute_grad_norm", True) and "check_grad_overflow" not in ds[bf16]):
        # CoatAdamW skips a step with a non-finite global norm itself (_skip_overflowed_steps),
        # without the host sync and per-tensor kernels of DeepSpeed's check.
        ds[bf16] = {**ds[bf16], "check_grad_overflow": False}
    ds["zero_allow_untested_optimizer"] = True
    del ds["optimizer"]
    return ds, kwargs


# DeepSpeed's switches that make ZeRO's flat master partitions (and gradients) BF16; the second
# only lifts its demand for ZeRO-Offload with DeepSpeedCPUAdam (runtime/base_optimizer.py,
# _configure_master_weights): a client optimizer keeps whatever state it keeps.
_BF16_MASTER_KEYS = ("bf16_master_weights_and_grads", "bf16_optimizer_states")


def bf16_masters(ds: dict) -> bool:
    """Whether a DeepSpeed config makes ZeRO's master partitions BF16 (`master_weights` "bf16+*")."""
    return bool((ds.get(bf16_key(ds)) or {}).get(_BF16_MASTER_KEYS[0]))


def _master_weights(ds: dict, bf16: str, bf16_enabled: bool, stage: int, offload: str, master_weights: str) -> None:
    """CoatAdamW's master_weights under ZeRO: "bf16+16" / "bf16+8" need DeepSpeed to hand it
    BF16 partitions, whose remainders it keeps; set DeepSpeed's switches for that."""
    section = ds.get(bf16) or {}
    if master_weights == "fp32":
        if bf16_masters(ds):
            raise ValueError(f"DeepSpeed config: {bf16}.{_BF16_MASTER_KEYS[0]}=true hands {OPTIMIZER_TYPE} BF16 "
                             "partitions, which it steps only with optimizer.params.master_weights 'bf16+16' (the "
                             "exact FP32 master as BF16 + a 16-bit remainder) or 'bf16+8'")
        return
    if not bf16_enabled or stage not in (1, 2, 3):
        raise ValueError(f"DeepSpeed config: optimizer.params.master_weights={master_weights!r} needs BF16 "
                         f"parameters and ZeRO stage 1, 2 or 3 (DeepSpeed's BF16 master partitions): set "
                         f"{bf16}.enabled true and zero_optimization.stage")
    if offload != "none":
        # DeepSpeed 0.19.8 asserts `type(self.optimizer) in [DeepSpeedCPUAdam]` for BF16 master
        # partitions with optimizer offload (stage_1_and_2.py _enforce_cpu_offload, stage3.py
        # _enforce_optimizer_offload, called from base_optimizer.py _configure_master_weights).
        raise ValueError(f"DeepSpeed config: optimizer.params.master_weights={master_weights!r} with "
                         f"offload_optimizer: DeepSpeed accepts BF16 master partitions with offload only for its "
                         "own DeepSpeedCPUAdam; use master_weights 'fp32' there")
    ds[bf16] = {**section, **dict.fromkeys(_BF16_MASTER_KEYS, True)}


def optimizer_settings(ds: dict, path: str, engine: str = "fsdp") -> tuple[str, dict]:
    """(type, keyword arguments) of the JSON's optimizer section as `engine` runs it, read by
    `optimizer_section`: "CoatAdamW", "AdamW" or "Adam", checked, without DeepSpeed-only
    switches; under DeepSpeed also its own optimizers, which it checks itself. A JSON that
    names none is an error: both engines build the optimizer from it."""
    found = optimizer_section(ds, path, pass_others=engine == "deepspeed", required=True)
    if found[0] == OPTIMIZER_TYPE:
        prepare_config(ds)  # the ZeRO settings CoatAdamW's state cannot take are refused for either engine
    return found


_NO_STEP_IN_BACKWARD = (
    "is not supported under the DeepSpeed engine: ZeRO stage 1, 2 and 3 copy each gradient into the engine's own "
    "buckets from the parameter's hook and reduce it into its partition buffers later, so there is no reduced "
    "gradient for CoatAdamW to step on in backward (DeepSpeed 0.19.8 has no per-bucket reduce hook for a client "
    "optimizer). Set it false here, or train with FSDP2 (train.py --fsdp, coat_ds.setup_fsdp), where it works")

# What torchrun and the deepspeed launcher set in every process they start.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# What MPI launchers set instead (Open MPI, MPICH / Intel MPI, PMIx, MVAPICH); DeepSpeed turns
# them into LAUNCH_VARS through mpi4py.
_MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")
LAUNCH_HINT = ("start it with `deepspeed script.py` (CPU: `DS_ACCELERATOR=cpu deepspeed --num_accelerators 2 "
               "script.py`) or `torchrun --nproc_per_node N script.py`")


def free_port() -> int:
    """A local TCP port free on every address, as torch.distributed's store binds it: one held
    on another address (127.0.0.2, a NIC's) would bind on 127.0.0.1 alone and then fail there."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def single_process_world(mpi: bool = True) -> str | None:
    """Give a process that no launcher started the environment `torchrun --nproc_per_node 1`
    would: RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, LOCAL_WORLD_SIZE=1, MASTER_ADDR=127.0.0.1 and a
    free MASTER_PORT (a MASTER_ADDR/PORT already set is kept). Without it DeepSpeed's
    `init_distributed` looks for an MPI launch and fails on a missing `mpi4py`.

    Returns the log line saying so, or None when there is nothing to do: a process group
    already exists, the launcher variables are all set, or (with `mpi`, for DeepSpeed, which
    reads an MPI launch through mpi4py) an MPI launcher started the process. Raises
    RuntimeError, one line naming the launcher command, where one process cannot stand in:
    launcher variables half set, or an MPI launch that cannot be read."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return None
    present = [v for v in LAUNCH_VARS if v in os.environ]
    ranks = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if v in os.environ]
    if len(present) == len(LAUNCH_VARS):
        return None
    if ranks:
        missing = [v for v in LAUNCH_VARS if v not in os.environ]
        raise RuntimeError(f"launcher variables half set ({', '.join(f'{v}={os.environ[v]}' for v in present)}; "
                           f"missing {', '.join(missing)}): {LAUNCH_HINT}, or unset them to run as one process")
    launched = [v for v in _MPI_VARS if v in os.environ]
    if launched:
        mpi_world = f"{launched[0]}={os.environ[launched[0]]}"
        if not mpi:
            raise RuntimeError(f"started by an MPI launcher ({mpi_world}), which this engine cannot read: "
                               "start it with `torchrun --nproc_per_node N script.py`")
        if importlib.util.find_spec("mpi4py") is None:
            raise RuntimeError(f"started by an MPI launcher ({mpi_world}) but mpi4py, which DeepSpeed reads it "
                               f"with, is not installed: `pip install mpi4py`, or {LAUNCH_HINT}")
        return None
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    return (f"no launcher: running as one process, a world of one (RANK=0 WORLD_SIZE=1 MASTER_ADDR="
            f"{os.environ['MASTER_ADDR']} MASTER_PORT={os.environ['MASTER_PORT']}, as torchrun --nproc_per_node 1 "
            f"would set it); for more processes {LAUNCH_HINT}")


def comm_op_build_note() -> str | None:
    """The line to print before DeepSpeed starts its process group when that will JIT-build
    its CPU accelerator's shared-memory op first (`deepspeed_shm_comm`, with the system C++
    compiler; once per machine, then cached), else None."""
    build = comm_op_build()
    if build is None:
        return None
    name, folder = build
    where = f" in {folder}" if folder else " under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions)"
    return (f"DeepSpeed: building its CPU shared-memory comm op ({name}) with the C++ compiler: a one-time "
            f"build, about 2 minutes on 2 cores; cached{where} for later runs")


def initialize(args=None, model=None, optimizer=None, model_parameters=None, *, config=None, config_params=None,
               **kwargs):
    """Drop-in for `deepspeed.initialize` that also understands `"type": "CoatAdamW"`.

    Returns what `deepspeed.initialize` returns: (engine, optimizer, dataloader, lr_scheduler).
    The config comes from `config`, `config_params` or `args.deepspeed_config`, as there."""
    import deepspeed

    if config is None:
        config = config_params
    if args is not None and getattr(args, "deepspeed_config", None) is not None:
        if config is not None:
            raise ValueError("DeepSpeed config given both as args.deepspeed_config and as config=")
        config = args.deepspeed_config
        args = copy.copy(args)
        args.deepspeed_config = None  # deepspeed.initialize refuses a config given twice
    if config is None:
        raise ValueError("no DeepSpeed config: pass config= or args.deepspeed_config")
    if isinstance(config, (str, os.PathLike)):
        config = find_ds_config(config)  # `ds_configs/<name>.json` from any directory
    ds_config, coat_kwargs = prepare_config(config)
    if coat_kwargs is not None and coat_kwargs.get("step_in_backward"):
        raise ValueError(f"DeepSpeed config: optimizer.params.step_in_backward=true {_NO_STEP_IN_BACKWARD}")
    if isinstance(optimizer, CoatAdamW) and optimizer.step_in_backward:
        raise ValueError(f"{OPTIMIZER_TYPE}(step_in_backward=True) passed as optimizer= {_NO_STEP_IN_BACKWARD}")
    if coat_kwargs is not None:
        if optimizer is not None:
            raise ValueError(f"the DeepSpeed config names {OPTIMIZER_TYPE} and an optimizer was passed too; keep one")
        if model_parameters is None:
            model_parameters = [p for p in model.parameters() if p.requires_grad]
        model_parameters = list(model_parameters)  # CoatAdamW and DeepSpeed both iterate it
        optimizer = CoatAdamW(model_parameters, **coat_kwargs)
    mark_zero_tested()  # CoatAdamW is tested under ZeRO: no "untested optimizer" warning for it
    _announce(single_process_world())
    if not deepspeed.comm.is_initialized() and os.environ.get("LOCAL_RANK", "0") == "0":
        _announce(comm_op_build_note())
    result = deepspeed.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                  config=ds_config, **kwargs)
    _skip_overflowed_steps(result[0])
    _drop_model_param_states(result[0])
    if coat_kwargs is not None:
        # Every rank prints: partitions differ (the last rank holds the padding).
        print(state_memory_report(result[0]).describe(), flush=True)
    return result


def _drop_model_param_states(engine) -> None:
    """Drop the state CoatAdamW gave the model's parameters when it was built (master_weights
    "bf16+*" builds every state then): ZeRO steps its own flat partitions instead, and torch's
    state_dict() has no id for a tensor outside the param groups."""
    opt = coat_optimizer(engine)
    if opt is None:
        return
    stepped = {id(p) for g in opt.param_groups for p in g["params"]}
    for p in [p for p in opt.state if id(p) not in stepped]:
        del opt.state[p]


def _skip_overflowed_steps(engine) -> None:
    """With DeepSpeed's overflow check off, CoatAdamW skips a step whose global gradient norm
    is not finite, as DeepSpeed's check would have, but on the device (skip_steps_on_device)."""
    opt = coat_optimizer(engine)
    if opt is not None:
        skip_steps_on_device(opt, engine.optimizer)


def _announce(line: str | None) -> None:
    if line:
        print(line, flush=True)


def coat_optimizer(engine) -> CoatAdamW | None:
    """The CoatAdamW inside a DeepSpeed engine (under its ZeRO wrapper), or None."""
    for opt in (getattr(engine.optimizer, "optimizer", None), engine.optimizer,
                getattr(engine, "basic_optimizer", None)):
        if isinstance(opt, CoatAdamW):
            return opt
    return None


def local_partitions(engine) -> list[tuple[torch.Tensor, dict]]:
    """(flat FP32 tensor, its param group) for every tensor this rank's optimizer steps."""
    zopt = engine.optimizer
    base = coat_optimizer(engine)
    groups = base.param_groups if base is not None else zopt.param_groups
    parts = fp32_partitions(zopt)  # ZeRO-3: one per sub-group; ZeRO-1/2: one per param group
    if parts is not None:
        return [(t, groups[i]) for t, i in parts]
    return [(p, g) for g in groups for p in g["params"]]


def _tensors_in(obj, depth: int = 3):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth - 1)
    elif depth and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v, depth - 1)


def engine_gradients(engine) -> list[torch.Tensor]:
    """Every gradient tensor a DeepSpeed engine holds on this rank, where its ZeRO stage puts
    them: on the parameters (stage 1, before reduction), in the optimizer's partition buffers
    (averaged_gradients, ipg buffers, stage 3's flat grad partitions) and on the FP32
    partitions during the step. Some are views of others, or of weights: count storages."""
    found = [p.grad for p in engine.module.parameters()]
    found += [t.grad for t, _ in local_partitions(engine)]
    for key, value in vars(engine.optimizer).items():
        if "grad" in key.lower():
            found.extend(_tensors_in(value))
    return [t for t in found if t is not None]


@dataclass(frozen=True)
class StateMemoryReport:
    """Optimizer-state memory of one rank: CoatAdamW's against FP32 AdamW's for the same partition."""

    rank: int  # global rank
    numel: int  # parameter elements this rank's optimizer owns
    state_bytes: int  # bytes of CoatAdamW's moment state (codes, scales, FP32 small tensors)
    device: str  # where the state lives (the host under ZeRO-Offload)

    @property
    def bytes_per_param(self) -> float:
        return self.state_bytes / self.numel if self.numel else 0.0

    @property
    def fp32_adamw_bytes(self) -> int:
        return 8 * self.numel

    @property
    def saved_gb(self) -> float:
        return (self.fp32_adamw_bytes - self.state_bytes) / 1e9

    def describe(self) -> str:
        return (f"CoatAdamW rank {self.rank}: optimizer state for {self.numel:,} params on {self.device}: "
                f"{self.bytes_per_param:.3f} bytes/param, {self.state_bytes / 1e9:.4g} GB "
                f"(FP32 AdamW: 8 bytes/param, {self.fp32_adamw_bytes / 1e9:.4g} GB) -> saves {self.saved_gb:.4g} GB "
                "on this rank")


def state_memory_report(engine) -> StateMemoryReport:
    """Bytes the moment state takes on this rank, known before the first step: the state is
    laid out exactly as CoatAdamW will, on the meta device (nothing is allocated)."""
    total, numel, device = 0, 0, "cpu"
    for t, group in local_partitions(engine):
        cfg = group_state_config(group)
        layout = st.init_state(torch.empty(t.shape, device="meta"), t.numel() >= cfg.min_quant_numel, cfg)
        total += st.state_bytes(layout)
        numel += t.numel()
        device = str(t.device)
    return StateMemoryReport(int(getattr(engine, "global_rank", 0)), numel, total, device)
