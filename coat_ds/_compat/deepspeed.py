"""DeepSpeed: every access coat_ds makes to its internals, checked on DeepSpeed 0.19.8.

Each function probes what it uses (the attribute or function exists, with the arguments it
was checked with) and, where that fails, takes the fallback its doc names, saying so once.
Where there is no safe fallback (consolidating a checkpoint needs `zero_to_fp32`'s layout
code) the fallback is `DeepSpeedInternalsError` naming the missing piece and the installed
version, raised when that feature is used, never at import. Nothing here imports DeepSpeed
at module level: FSDP-only runs must not load it.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import importlib.metadata
import importlib.util
import inspect
import os
import re
import sys

import torch

from . import warn_once

__all__ = ["CHECKED", "DeepSpeedInternalsError", "installed_version", "known_config_words", "zero_tested",
           "mark_zero_tested", "ZeroLayout", "zero_layout", "set_full_fp32_param", "fp32_partitions",
           "refresh_lp_params", "zero3_param_groups_filled", "release_zero3_references", "zero3_partitioned",
           "zero3_local_range", "comm_op_build", "unchecked_overflow_norm", "stepping_zero_optimizer"]

CHECKED = "0.19.8"


class DeepSpeedInternalsError(RuntimeError):
    """A DeepSpeed internal that a coat_ds feature needs is missing in the installed version."""


def installed_version() -> str:
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _where() -> str:
    return f"DeepSpeed {installed_version()} (coat_ds checked {CHECKED})"


def _missing(feature: str, what: str) -> DeepSpeedInternalsError:
    return DeepSpeedInternalsError(f"{feature} needs {what}, which {_where()} lacks")


# -- the known config keys ----------------------------------------------------------------

_KEY_LIKE = re.compile(r"^[a-z][a-z0-9_]*$")
_FOLLOWED = re.compile(r"(config|constants)\w*\.py$|[/\\]__init__\.py$")


@functools.lru_cache(maxsize=None)
def known_config_words() -> frozenset[str] | None:
    """Every key-like string ("zero_optimization", "stage", ...) in the installed DeepSpeed's
    config reader (deepspeed/runtime/config.py) and the config and constants modules it
    imports, read from their source without importing DeepSpeed (FSDP-only runs must not
    load it). A superset of the top-level keys DeepSpeed reads, taken from the installed
    version so that it cannot fall behind it.

    None where DeepSpeed is not installed, and, with a warning once, where that file cannot
    be read: the caller then checks no top-level key."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.origin:
        return None
    package = os.path.dirname(spec.origin)
    start = os.path.join(package, "runtime", "config.py")
    words, seen, todo = set(), set(), [start]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (OSError, SyntaxError, ValueError):  # a warning's source must never stop a run
            if path == start:
                warn_once("deepspeed.config_keys",
                          f"coat_ds: cannot read the config keys of {_where()} from {start}; unknown top-level "
                          "keys of a DeepSpeed JSON are not reported")
                return None
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _KEY_LIKE.match(node.value):
                words.add(node.value)
            elif isinstance(node, ast.ImportFrom):
                target = _module_file(package, path, node)
                if target is not None and target != spec.origin and _FOLLOWED.search(target):
                    todo.append(target)
    return frozenset(words)


def _module_file(package: str, importer: str, node: ast.ImportFrom) -> str | None:
    """The file of DeepSpeed's that `from X import ...` in `importer` reads, or None."""
    if node.level:
        base = os.path.dirname(importer)
        for _ in range(node.level - 1):
            base = os.path.dirname(base)
        parts = node.module.split(".") if node.module else []
    elif node.module and node.module.split(".")[0] == "deepspeed":
        base, parts = os.path.dirname(package), node.module.split(".")
    else:
        return None
    stem = os.path.join(base, *parts)
    for candidate in (stem + ".py", os.path.join(stem, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


# -- ZeRO's list of tested optimizers ------------------------------------------------------

def _zero_supported_list():
    from deepspeed.runtime.zero import utils as zero_utils

    listed = getattr(zero_utils, "ZERO_SUPPORTED_OPTIMIZERS", None)
    if isinstance(listed, list):
        return listed
    warn_once("deepspeed.zero_supported_optimizers",
              f"coat_ds: {_where()} has no list deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS; CoatAdamW is "
              "not marked ZeRO-tested, so under ZeRO DeepSpeed warns that it is untested (coat_ds's initialize sets "
              "zero_allow_untested_optimizer; with register_deepspeed set it in the JSON)")
    return None


def mark_zero_tested(cls) -> None:
    """Add `cls` to `ZERO_SUPPORTED_OPTIMIZERS` (idempotent). Fallback: nothing added, a warning."""
    listed = _zero_supported_list()
    if listed is not None and cls not in listed:
        listed.append(cls)


def zero_tested(cls) -> bool:
    """Whether `cls` is on `ZERO_SUPPORTED_OPTIMIZERS`, without importing DeepSpeed (False
    where it is not loaded or has no such list)."""
    import sys

    zero_utils = sys.modules.get("deepspeed.runtime.zero.utils")
    listed = getattr(zero_utils, "ZERO_SUPPORTED_OPTIMIZERS", None)
    return isinstance(listed, list) and cls in listed


# -- checkpoint layout (zero_to_fp32) -----------------------------------------------------

# zero_to_fp32 function -> the leading parameters coat_ds passes (positionally).
_ZERO_TO_FP32 = {
    "get_model_state_files": ("checkpoint_dir",),
    "get_optim_files": ("checkpoint_dir",),
    "parse_model_states": ("files",),
    "to_torch_tensor": ("state_dict",),
    "_get_fp32_state_dict_from_zero2_checkpoint": ("world_size", "fp32_flat_groups", "zero_model_states",
                                                   "exclude_frozen_parameters", "param_alignment_paddings"),
    "_get_fp32_state_dict_from_zero3_checkpoint": ("world_size", "fp32_flat_groups", "zero_model_states",
                                                   "exclude_frozen_parameters"),
}


class ZeroLayout:
    """DeepSpeed's ZeRO checkpoint layout code (`deepspeed.utils.zero_to_fp32`)."""

    def __init__(self, module):
        self._z = module

    def model_state_files(self, ckpt_dir: str) -> list[str]:
        return self._z.get_model_state_files(ckpt_dir)

    def optim_files(self, ckpt_dir: str) -> list[str]:
        return self._z.get_optim_files(ckpt_dir)

    def parse_model_states(self, files: list[str]) -> list:
        return self._z.parse_model_states(files)

    def per_param(self, stage: int, world: int, flat_groups, model_states, paddings=None) -> dict:
        """{parameter name: full tensor} of per-rank flat groups laid out as ZeRO `stage` does
        (frozen parameters left out)."""
        if stage <= 2:
            return self._z._get_fp32_state_dict_from_zero2_checkpoint(world, flat_groups, model_states, True,
                                                                      paddings)
        return self._z.to_torch_tensor(self._z._get_fp32_state_dict_from_zero3_checkpoint(
            world, flat_groups, model_states, True))


def zero_layout(feature: str = "consolidate_checkpoint") -> ZeroLayout:
    """The probed `zero_to_fp32` functions; no fallback: `DeepSpeedInternalsError` naming the
    missing one (or the one whose arguments changed) for `feature`."""
    try:
        from deepspeed.utils import zero_to_fp32
    except ImportError as e:
        raise _missing(feature, "deepspeed.utils.zero_to_fp32") from e
    for name, params in _ZERO_TO_FP32.items():
        fn = getattr(zero_to_fp32, name, None)
        if fn is None:
            raise _missing(feature, f"deepspeed.utils.zero_to_fp32.{name}")
        try:
            have = tuple(inspect.signature(fn).parameters)[:len(params)]
        except (TypeError, ValueError):
            have = params
        if have != params:
            raise _missing(feature, f"deepspeed.utils.zero_to_fp32.{name}({', '.join(params)}, ...) "
                           f"(it takes ({', '.join(have)}, ...))")
    return ZeroLayout(zero_to_fp32)


def set_full_fp32_param(param, value) -> None:
    """`deepspeed.utils.safe_set_full_fp32_param`: write one parameter's full FP32 value into
    this rank's master partition. No fallback: `DeepSpeedInternalsError`."""
    try:
        from deepspeed.utils import safe_set_full_fp32_param
    except ImportError as e:
        raise _missing("load_fp32_checkpoint", "deepspeed.utils.safe_set_full_fp32_param") from e
    safe_set_full_fp32_param(param, value)


# -- the ZeRO optimizer's flat groups -------------------------------------------------------

def fp32_partitions(zopt) -> list[tuple] | None:
    """(flat FP32 master partition, its param group index) for every tensor a ZeRO optimizer
    steps on this rank: ZeRO-3 one per sub-group, ZeRO-1/2 one per param group. None for an
    optimizer that is neither (the caller takes the param groups' own tensors)."""
    if hasattr(zopt, "fp32_partitioned_groups_flat"):  # ZeRO-3
        groups = getattr(zopt, "sub_group_to_group_id", None)
        if groups is None:
            raise _missing("the ZeRO-3 partitions' param groups", "DeepSpeedZeroOptimizer_Stage3.sub_group_to_group_id")
        return [(t, groups[i]) for i, t in enumerate(zopt.fp32_partitioned_groups_flat)]
    if hasattr(zopt, "single_partition_of_fp32_groups"):  # ZeRO-1/2
        return [(t, i) for i, t in enumerate(zopt.single_partition_of_fp32_groups)]
    return None


def unchecked_overflow_norm(zopt):
    """Where a ZeRO-1/2 optimizer was told not to check gradients for overflow
    (`"bf16": {"check_grad_overflow": false}`), a callable giving the global gradient norm its
    step computed (`_global_grad_norm`: a device tensor, the same on every rank, inf where a
    gradient or the norm itself was not finite), for CoatAdamW to skip such a step itself.
    None where DeepSpeed checks, or is not ZeRO-1/2 (ZeRO-3 skips on its norm itself), or computes no
    norm (`zero_optimization.compute_grad_norm: false`, or a version without these
    attributes: the fallback, with a warning, is no whole-step skip)."""
    if (getattr(zopt, "check_grad_overflow", True) or getattr(zopt, "dtype", None) != torch.bfloat16
            or not hasattr(zopt, "single_partition_of_fp32_groups")):
        return None  # FP16 and FP32 runs skip on a non-finite norm themselves
    if not getattr(zopt, "compute_grad_norm", False) or "_global_grad_norm" not in vars(zopt):
        warn_once("unchecked_overflow_norm",
                  f"{_where()}: bf16.check_grad_overflow is false and its ZeRO optimizer computes no global "
                  "gradient norm (zero_optimization.compute_grad_norm false?): nothing skips a step with a "
                  "non-finite gradient; CoatAdamW leaves only the groups whose own gradient is not finite unchanged")
        return None
    return lambda: zopt._global_grad_norm


def stepping_zero_optimizer(optimizer, frames: int = 8):
    """The DeepSpeed ZeRO optimizer whose `step()` is calling `optimizer.step()` now (call it from
    a step pre-hook), else None: DeepSpeed keeps no link back to the wrapper (`_optimizer_step`
    calls `self.optimizer.step()`), so the callers' frames are searched for that `self`."""
    frame = sys._getframe(1)
    for _ in range(frames):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and owner is not optimizer and getattr(owner, "optimizer", None) is optimizer:
            return owner
        frame = frame.f_back
    return None


@torch.no_grad()
def refresh_lp_params(zopt) -> None:
    """Copy the FP32 master partitions into the BF16/FP16 parameters the forward uses."""
    if hasattr(zopt, "update_lp_params"):  # ZeRO-1/2: copy and all-gather
        zopt.update_lp_params()
        return
    if hasattr(zopt, "fp16_partitioned_groups_flat"):  # ZeRO-3: partitions only, as its own load does
        for fp32, lp in zip(zopt.fp32_partitioned_groups_flat, zopt.fp16_partitioned_groups_flat):
            if fp32.numel():
                lp.data.copy_(fp32.data)
        for i, lp in enumerate(zopt.fp16_partitioned_groups_flat):
            for part, q in zip(zopt.fp16_partitioned_groups[i], zopt.unflatten(lp, zopt.fp16_partitioned_groups[i])):
                part.data = q.data
        return
    raise NotImplementedError(f"resharding is implemented for ZeRO-1/2/3 engines, not {type(zopt).__name__}")


@contextlib.contextmanager
def zero3_param_groups_filled(zopt):
    """ZeRO-3 keeps the param groups empty between steps; inside this block they hold the
    FP32 partitions, as DeepSpeed's own save/load fills them. Nothing to do for ZeRO-1/2.
    No fallback for a ZeRO-3 optimizer without its fill/clear methods: `DeepSpeedInternalsError`."""
    if not hasattr(zopt, "fp32_partitioned_groups_flat"):
        yield
        return
    fill = getattr(zopt, "_set_fp32_optimizer_param_groups", None)
    clear = getattr(zopt, "_clear_fp32_optimizer_param_groups", None)
    if fill is None or clear is None:
        raise _missing("load_fp32_checkpoint under ZeRO-3", "DeepSpeedZeroOptimizer_Stage3."
                       "_set_fp32_optimizer_param_groups / _clear_fp32_optimizer_param_groups")
    fill()
    try:
        yield
    finally:
        clear()


# -- ZeRO-3's module-level references -----------------------------------------------------

def zero3_partitioned(param: torch.Tensor) -> bool:
    """Whether ZeRO-3 manages `param`: it then holds only this rank's partition (an empty
    tensor) outside its module's own call. ZeRO-3 marks its parameters with `ds_id`; an empty
    weight is taken as partitioned too, so the answer needs no DeepSpeed import and holds
    where that attribute is renamed."""
    return hasattr(param, "ds_id") or param.numel() == 0


def zero3_local_range(param: torch.Tensor) -> tuple[torch.Tensor, int, int, torch.Tensor | None] | None:
    """(this rank's elements of a ZeRO-3 parameter as a flat tensor, the flat index of the
    first, the parameter's numel, the partition's padding past its end or None), read from
    `ds_tensor` (the partition: the same numel on every rank of `ds_process_group`, rank r's
    starting at r times it) and `ds_numel`; None for a tensor ZeRO-3 does not partition (its
    FP32 flat partitions carry a `ds_id` too, but hold their data). No fallback for a
    partitioned parameter (`ds_id`, no data) without them: `DeepSpeedInternalsError`."""
    part, numel, group = (getattr(param, a, None) for a in ("ds_tensor", "ds_numel", "ds_process_group"))
    if part is None or numel is None:
        if not (hasattr(param, "ds_id") and param.numel() == 0):
            return None
        raise _missing("initialising ZeRO-3 partitions in place", "Parameter.ds_tensor and Parameter.ds_numel")
    import deepspeed.comm as ds_dist

    start = part.numel() * ds_dist.get_rank(group=group)
    flat = part.view(-1)
    valid = max(0, min(flat.numel(), numel - start))
    return flat[:valid], start, numel, flat[valid:] if valid < flat.numel() else None


_COORDINATOR_CACHE = "_PartitionedParameterCoordinator__params_to_release"


def release_zero3_references(module) -> None:
    """Drop what ZeRO-3 keeps of a destroyed engine at module level: submodules of `module`
    left on `parameter_offload.FWD_MODULE_STACK` (set up, or interrupted by an out-of-memory
    error) and the coordinator's lru_cache of parameters to release, on the class, keyed by
    coordinator and filled once a step's trace is complete, so it keeps every engine that ran
    two forwards alive (other live engines only lose entries they recompute). Fallback where either
    is missing: it stays, with a warning once (the engine then lives until the process ends)."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    fn = PartitionedParameterCoordinator.__dict__.get(_COORDINATOR_CACHE)
    if not isinstance(stack, list) or fn is None:
        warn_once("deepspeed.zero3_references",
                  f"coat_ds: {_where()} lacks parameter_offload.FWD_MODULE_STACK or PartitionedParameterCoordinator."
                  "__params_to_release; a destroyed ZeRO-3 engine's memory is held until the process ends")
    if isinstance(stack, list):
        ours = {id(m) for m in module.modules()}
        stack[:] = [m for m in stack if id(m) not in ours]
    for f in (fn, getattr(fn, "__wrapped__", None)):  # DeepSpeed's NVTX wrapper keeps the cached one in a closure
        for cell in getattr(f, "__closure__", None) or ():
            if hasattr(cell.cell_contents, "cache_clear"):
                cell.cell_contents.cache_clear()
        if hasattr(f, "cache_clear"):
            f.cache_clear()


# -- the CPU accelerator's comm op ----------------------------------------------------------

def comm_op_build() -> tuple[str, str | None] | None:
    """(op name, folder it is built in or None when unknown) when DeepSpeed's accelerator
    will JIT-build its shared-memory comm op (`ShareMemCommBuilder`) before starting the
    process group, else None. Fallback where DeepSpeed's op registry
    (`deepspeed.ops.__compatible_ops__`, `deepspeed.git_version_info.installed_ops`) is
    missing: None, with a warning once."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    try:
        from deepspeed.git_version_info import installed_ops

        compatible = deepspeed.ops.__compatible_ops__
    except (ImportError, AttributeError):
        warn_once("deepspeed.op_registry",
                  f"coat_ds: {_where()} has no deepspeed.ops.__compatible_ops__ / git_version_info.installed_ops; "
                  "no note is printed before DeepSpeed JIT-builds its CPU comm op")
        return None
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not compatible.get(builder.NAME, False) or installed_ops.get(builder.NAME, False):
        return None
    try:  # torch's own rule for where load() puts it (private, so a guess when it moves)
        from torch.utils.cpp_extension import _get_build_directory

        folder = _get_build_directory(builder.NAME, verbose=False)
    except (ImportError, AttributeError, TypeError):
        return builder.NAME, None
    if os.path.isfile(os.path.join(folder, f"{builder.NAME}.so")):
        return None
    return builder.NAME, folder
