"""PyTorch FSDP with CoatAdamW: wrapping (FSDP2 `fully_shard` or FSDP1) and checkpoints.

A training loop needs three calls besides its own code:

    model = setup_fsdp(model, mode="fsdp2")                   # or mode="fsdp1", activation=ActivationConfig()
    optim = coat_ds.CoatAdamW(model.parameters(), lr=...)
    ...
    save_checkpoint(path, model, optim, step)                 # every rank
    step = load_checkpoint(path, model, optim)                # every rank, any world size

Checkpoints are `torch.distributed.checkpoint` (DCP) directories. FSDP2 saves CoatAdamW's FP8
state as it is (DTensors, see `coat_ds/optim/sharded.py`): bit-exact resume, and DCP
reshards it to another number of ranks. FSDP1's optimizer-state machinery only knows
FP32 tensors shaped like its flat shards, so FSDP1 checkpoints carry the moments in
torch.optim.AdamW's layout (dequantized FP32) and loading quantizes them again: resharding
works for free, at the cost of one FP8 rounding of the moments at each resume.

CoatAdamW's `master_weights="bf16+16"` / `"bf16+8"` (BF16 parameters) saves each parameter's
master remainder in the optimizer state, sharded like the parameter. `load_checkpoint` converts
between the forms exactly: an FP32-master checkpoint's weights are read in FP32 and split into
BF16 parameter and remainder (`set_fp32_master`); a BF16 checkpoint's remainders are read into an
FP32-master optimizer, which joins them into its FP32 parameters.

Loading unpickles DCP's `.metadata` and its non-tensor values (param-group options) with only
DCP's own types and torch's weights-only types allowed; anything else is refused naming it
and the file, unless `trust_checkpoint=True`.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import (
    MixedPrecision,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from ..activation import compress_activations
from ..io.checkpoint_folders import find_checkpoint, report_skipped, staged_save
from ..io.faults import fault_point
from ..io.safe_load import (CheckpointError, check_load_environment, load_dcp_metadata, reading_file,
                            weights_only_loads)
from ..config import ActivationConfig
from ..optim import CoatAdamW
from ..optim.state import REMAINDER_KEY
from ..optim.sharded import mark_global_numel
from .fsdp1_state import fsdp1_load_optim_state_dict, fsdp1_optim_state_dict

__all__ = ["FsdpConfig", "setup_fsdp", "save_checkpoint", "load_checkpoint", "load_checkpoint_folder",
           "resolve_checkpoint", "clip_grad_norm_",
           "fsdp1_optim_state_dict", "fsdp1_load_optim_state_dict", "is_fsdp1", "is_fsdp2"]

_MODES = ("fsdp2", "fsdp1")


@dataclass(frozen=True)
class FsdpConfig:
    """How `setup_fsdp` shards a model.

    Attributes:
        mode: "fsdp2" (fully_shard, DTensor parameters) or "fsdp1" (FullyShardedDataParallel)
        wrap: modules made their own FSDP unit; None: every element of an nn.ModuleList (transformer blocks)
        use_orig_params: FSDP1 only: expose the original parameters (True) or one FlatParameter per unit
        reshard_after_forward: free gathered parameters after forward (ZeRO-3-like) or keep to backward
        param_dtype: compute dtype of gathered parameters (torch.bfloat16...); None: as stored
        activation: FP8 activation compression of the whole model (None: off)
        shard_size: FSDP2 only: None shards over every rank; k makes it HSDP, each parameter
            sharded over groups of k consecutive ranks (a host's GPUs) and replicated across the
            groups, so only the gradients' all-reduce crosses between groups
    """

    mode: str = "fsdp2"
    wrap: Callable[[nn.Module], bool] | None = None
    use_orig_params: bool = True
    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None
    activation: ActivationConfig | None = None
    shard_size: int | None = None

    def __post_init__(self):
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {self.mode!r}")
        if self.shard_size is not None:
            if isinstance(self.shard_size, bool) or not isinstance(self.shard_size, int) or self.shard_size < 1:
                raise ValueError(f"shard_size must be None or an int >= 1, got {self.shard_size!r}")
            if self.mode != "fsdp2":
                raise ValueError(f"shard_size (HSDP) is for mode='fsdp2', not {self.mode!r}")
        if self.param_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"param_dtype must be None or a float dtype, got {self.param_dtype!r}")


def _units(model: nn.Module, wrap: Callable[[nn.Module], bool] | None) -> list[nn.Module]:
    """Sub-modules that become their own FSDP unit, in post-order (children before parents)."""
    if wrap is None:
        listed = {id(m) for ml in model.modules() if isinstance(ml, nn.ModuleList) for m in ml}
        wrap = lambda m: id(m) in listed  # noqa: E731
    return [m for m in _post_order(model) if m is not model and wrap(m)]


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _hsdp_mesh(shard_size: int | None):
    """The (replicate, shard) device mesh of HSDP over groups of `shard_size` ranks; None
    (FSDP2's default: every rank one shard) when not asked for."""
    if shard_size is None:
        return None
    world = dist.get_world_size()
    if world % shard_size:
        raise ValueError(f"shard_size {shard_size} does not divide the world size {world}")
    return init_device_mesh(_device().type, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


def setup_fsdp(model: nn.Module, config: FsdpConfig | None = None, **overrides) -> nn.Module:
    """Shard `model` over the default process group (with `shard_size`, HSDP on a (replicate,
    shard) mesh of it); returns the model to train.

    FSDP2 shards in place (the same module comes back, its parameters now DTensors);
    FSDP1 returns a `FullyShardedDataParallel` wrapper. Each parameter is first marked
    with its unsharded size, so CoatAdamW decides FP32-or-FP8 moments on the whole tensor
    whatever the number of ranks. Keyword overrides build a `FsdpConfig`."""
    if not dist.is_initialized():
        raise RuntimeError("setup_fsdp needs torch.distributed initialised (torchrun + init_process_group)")
    config = FsdpConfig(**overrides) if config is None else config
    if config.activation is not None:
        # Hooks on the unsharded modules; `coat_ds.activation_stats(model)` reads them.
        compress_activations(model, config=config.activation)
    for p in model.parameters():
        mark_global_numel(p, p.numel())
    units = _units(model, config.wrap)
    if config.mode == "fsdp2":
        mp = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=torch.float32
                                  if config.param_dtype is not None else None)
        shard = partial(fully_shard, reshard_after_forward=config.reshard_after_forward, mp_policy=mp,
                        mesh=_hsdp_mesh(config.shard_size))
        for unit in units:
            shard(unit)
        shard(model)
        return model
    unit_ids = {id(u) for u in units}
    mp = None
    if config.param_dtype is not None:
        mp = MixedPrecision(param_dtype=config.param_dtype, reduce_dtype=torch.float32, buffer_dtype=config.param_dtype)
    policy = partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in unit_ids)
    strategy = ShardingStrategy.FULL_SHARD if config.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
    return FSDP(model, auto_wrap_policy=policy, device_id=_device(), use_orig_params=config.use_orig_params,
                mixed_precision=mp, sharding_strategy=strategy)


def clip_grad_norm_(model: nn.Module, max_norm: float, *, sync: bool = True) -> float | torch.Tensor:
    """Clip the gradients of a sharded model to a global norm of `max_norm`; returns the
    norm before clipping (the same on every rank): a float, or with `sync=False` a 0-dim
    tensor on the gradients' device, so that the host need not wait for the GPU (a training
    loop that does not read the norm every step keeps the GPU fed)."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not 0 < max_norm < float("inf"):
        # torch scales by max_norm / norm unchecked: a negative value would flip every gradient.
        raise ValueError(f"max_norm must be a finite number > 0 (leave clipping out to turn it off), got {max_norm!r}")
    if is_fsdp1(model):
        norm = model.clip_grad_norm_(max_norm)
    else:
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
    return float(norm) if sync else norm


def is_fsdp2(model: nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.modules())


def is_fsdp1(model: nn.Module) -> bool:
    return bool(FSDP.fsdp_modules(model))


# -- checkpoints ---------------------------------------------------------------------------


def _fsdp1_state(model: nn.Module, optim) -> dict:
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(),
                              ShardedOptimStateDictConfig()):
        return {"model": model.state_dict(), "optim": fsdp1_optim_state_dict(model, optim)}


class _GuardedFileSystem(FileSystem):
    """DCP's file system with each data file written through `fault_point` (tests kill a rank
    there) and every read failing with the file's path."""

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "r" in mode:
            try:
                with super().create_stream(path, mode) as stream:
                    yield stream
            except CheckpointError:  # already names the file
                raise
            except Exception as e:
                raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from e
            return
        with fault_point(path), super().create_stream(path, mode) as stream:
            yield stream


class _Reader(dcp.FileSystemReader):
    """DCP's reader on `_GuardedFileSystem`, its `.metadata` unpickled by `load_dcp_metadata`."""

    def __init__(self, folder, trust_checkpoint: bool):
        super().__init__(folder)
        self.fs = _GuardedFileSystem()
        self.trust_checkpoint = trust_checkpoint

    def read_metadata(self, *args, **kwargs):
        if self.trust_checkpoint:
            return super().read_metadata(*args, **kwargs)
        rank = kwargs.get("rank")
        path = self.fs.concat_path(self.path, ".metadata" if rank is None else f"__{rank}.metadata")
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_dcp_metadata(f, path)
        if metadata.storage_meta is None:  # older DCP versions wrote none; torch's reader adds it too
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _LoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's planner with the non-tensor values (DCP torch.saves each) unpickled weights-only
    unless trusted, a refusal naming the data file."""

    def __init__(self, folder, trust_checkpoint: bool, **kwargs):
        super().__init__(**kwargs)
        self.folder, self.trust_checkpoint = os.fspath(folder), trust_checkpoint

    def load_bytes(self, read_item, value):
        path = os.path.join(self.folder, self.metadata.storage_data[read_item.storage_index].relative_path)
        with weights_only_loads(self.trust_checkpoint), reading_file(path, self.trust_checkpoint, source=value):
            super().load_bytes(read_item, value)


def _state(model: nn.Module, optim) -> dict:
    if is_fsdp1(model):
        return _fsdp1_state(model, optim)
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optim, step: int,
                    client_state: dict | None = None) -> str:
    """Save model, optimizer and `step` as a DCP checkpoint folder `path` (call on every rank).

    Written as `.<name>.partial` next to `path` and renamed to `path`, with its completion
    record, once every rank has finished; the parent's `latest` then names it. Refuses an
    existing `path` (see `coat_ds.io.checkpoint_folders`). `client_state` (JSON values, such
    as a run's settings) goes into the completion record: `read_record(folder)["client_state"]`.
    Returns the folder."""
    state = _state(model, optim)
    state["train"] = {"step": torch.tensor(int(step), dtype=torch.int64)}
    final = os.path.abspath(os.fspath(path))
    engine = "fsdp1" if is_fsdp1(model) else "fsdp2"
    with staged_save(final, step, engine=engine, client_state=client_state) as staging:
        writer = dcp.FileSystemWriter(staging)
        writer.fs = _GuardedFileSystem()
        dcp.save(state, storage_writer=writer)
    return final


def resolve_checkpoint(path: str | os.PathLike, trust_checkpoint: bool = False) -> str:
    """The checkpoint folder `load_checkpoint` reads for `path`: `path` itself when it is
    one, else the newest complete checkpoint in it (incomplete ones reported on stderr)."""
    found = find_checkpoint(path, trust_checkpoint)
    report_skipped(found)
    return found.path


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optim, trust_checkpoint: bool = False) -> int:
    """Load a `save_checkpoint` folder, or the newest complete one in the save folder `path`,
    into `model` and `optim`, possibly saved on a different number of ranks (call on every
    rank); returns the saved step. Unpickles only DCP's and torch's weights-only types unless
    `trust_checkpoint` (see the module's doc)."""
    return load_checkpoint_folder(resolve_checkpoint(path, trust_checkpoint), model, optim, trust_checkpoint)


def load_checkpoint_folder(folder: str | os.PathLike, model: nn.Module, optim, trust_checkpoint: bool = False) -> int:
    """`load_checkpoint` of the checkpoint folder `resolve_checkpoint` returned, without
    searching or verifying it again; returns the saved step."""
    check_load_environment(trust_checkpoint)  # inside dcp.load, the refusal would come wrapped per rank
    state = _state(model, optim)
    state["train"] = {"step": torch.zeros((), dtype=torch.int64)}
    reader = _Reader(folder, trust_checkpoint)
    metadata = reader.read_metadata()  # a refused .metadata fails here with its own error; DCP would bury it
    masters = {}
    if not is_fsdp1(model):
        masters = _read_fp32_masters(model, optim, metadata, state["model"])
        _read_saved_remainders(model, metadata, state["optim"])
    # FSDP1's ShardedTensors of parameters this rank holds no element of have no local
    # shard; DCP's default flattening drops them, finds keys "missing" and mistakes the
    # checkpoint for the pre-2.4 layout. Unflattened they simply read nothing.
    planner = _LoadPlanner(folder, trust_checkpoint, flatten_sharded_tensors=not is_fsdp1(model))
    dcp.load(state, storage_reader=reader, planner=planner)
    if is_fsdp1(model):
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(),
                                  ShardedOptimStateDictConfig()):
            model.load_state_dict(state["model"])
            fsdp1_load_optim_state_dict(model, optim, state["optim"])
    else:
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optim, state["optim"])
        for fqn, p in masters.items():
            optim.set_fp32_master(p, state["model"][fqn])
    return int(state["train"]["step"])


def _read_saved_remainders(model: nn.Module, metadata, optim_state: dict) -> None:
    """Read a master remainder (CoatAdamW master_weights) where the checkpoint has one, and only
    there: DCP reads the keys of the live state dict, so a remainder saved by a "bf16+*" run
    would go unread by an "fp32" one, and one the live optimizer holds would be missing from an
    FP32-master checkpoint (its optimizer keeps it; see `_read_fp32_masters`)."""
    for fqn, p in model.named_parameters():
        entry = optim_state.get("state", {}).get(fqn)
        if entry is None:
            continue
        saved = metadata.state_dict_metadata.get(f"optim.state.{fqn}.{REMAINDER_KEY}")
        if saved is None:
            entry.pop(REMAINDER_KEY, None)
        elif REMAINDER_KEY not in entry:
            entry[REMAINDER_KEY] = torch.zeros_like(p.detach(), dtype=saved.properties.dtype)


def _read_fp32_masters(model: nn.Module, optim, metadata, model_state: dict) -> dict[str, torch.Tensor]:
    """The parameters of CoatAdamW master_weights="bf16+*" groups whose checkpoint holds FP32
    weights (saved with FP32 masters), by FQN: their entries in `model_state` become FP32
    tensors to read into, so that `set_fp32_master` keeps the bits the BF16 parameter cannot."""
    if not isinstance(optim, CoatAdamW):
        return {}
    split = {id(p) for g in optim.param_groups if g["master_weights"] != "fp32" for p in g["params"]}
    found = {}
    for fqn, p in model.named_parameters():
        saved = metadata.state_dict_metadata.get(f"model.{fqn}")
        if id(p) in split and fqn in model_state and getattr(saved, "properties", None) is not None \
                and saved.properties.dtype == torch.float32 and model_state[fqn].dtype != torch.float32:
            model_state[fqn] = torch.zeros_like(model_state[fqn], dtype=torch.float32)
            found[fqn] = p
    return found
