"""The one reader of a DeepSpeed JSON: loading it, and each engine-level value our code takes
from it, read the way DeepSpeed 0.19 reads it and type-checked strictly.

Where DeepSpeed is lax we refuse instead of guessing: its pydantic models turn
`"enabled": "false"` (a string) into False and `"f"`, `0` or `1.0` into booleans, and a
string batch size only fails deep inside DeepSpeed. A value either means the same thing
under `--engine deepspeed` and `--engine fsdp`, or it is an error naming the key. A key our
code reads (optimizer section and parameters) is known or an error naming it; a top-level key
DeepSpeed does not know, which it would ignore silently, gets a warning with the closest known
one (`"zero_optimisation"`: did you mean `"zero_optimization"`?). DeepSpeed's known keys come
from its installed source (`coat_ds._compat.deepspeed.known_config_words`); where that cannot
be read, no top-level key is checked and a warning says so once.
"""
from __future__ import annotations

import copy
import difflib
import inspect
import json
import os
import warnings

import torch

from ..._compat.deepspeed import known_config_words
from ...config.checks import ConfigError, boolean, integer, number
from ...optim.coat_adamw import CoatAdamW

__all__ = ["load_ds_config", "bf16_key", "precision", "gradient_clipping", "batch_sizes", "batch_keys", "zero_stage",
           "ZERO_KEYS", "check_zero_keys", "check_keys", "OPTIMIZERS", "OPTIMIZER_ARGUMENTS", "DEEPSPEED_ONLY_ADAM_KEYS",
           "optimizer_section"]

# DeepSpeed's default when the key is absent (deepspeed/runtime/constants.py): clip at 1.0.
_CLIP_DEFAULT = 1.0


def load_ds_config(config) -> dict:
    """A DeepSpeed config as a fresh dict: a dict (deep-copied) or the path of a JSON file.
    Warns about top-level keys DeepSpeed does not know."""
    ds = copy.deepcopy(config) if isinstance(config, dict) else _read_json(config)
    _warn_unknown_top_level(ds)
    return ds


def _read_json(config) -> dict:
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"DeepSpeed config must be a dict or a JSON file path, got {type(config).__name__}")
    if not os.path.isfile(config):
        raise ValueError(f"DeepSpeed config file not found: {config}")
    with open(config) as f:
        try:
            ds = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{config}: not valid JSON: {e}") from None
    if not isinstance(ds, dict):
        raise ValueError(f"{config}: a DeepSpeed config is a JSON object, got {type(ds).__name__}")
    return ds


def check_keys(section: str, given, known, source: str = "DeepSpeed config") -> None:
    """Refuse a key of `given` (an object coat_ds reads, `section` of the JSON) outside
    `known`, naming it, the closest known key and all of them; `source` starts the message."""
    for key in given:
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            prefix = f"{source}: " if source else ""
            raise ValueError(f"{prefix}{section} has unknown key {key!r}{hint}; valid keys: {', '.join(known)}")


def _warn_unknown_top_level(ds: dict) -> None:
    """One warning for the top-level keys DeepSpeed does not know (it ignores them, so a
    misspelled section would silently fall back to defaults), with the closest known key.
    The message does not name the file, so the readers of one run's JSON warn once."""
    known = known_config_words()
    unknown = [k for k in ds if k not in known] if known is not None else []
    if not unknown:
        return
    named = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), sorted(known), n=1)
        named.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    warnings.warn(f"DeepSpeed config: unknown top-level key(s) {', '.join(named)}: DeepSpeed ignores them "
                  "(and so does the FSDP engine)", UserWarning, stacklevel=2)


def _section(ds: dict, key: str, where: str) -> dict:
    value = ds.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(key, value, 'an object such as {"enabled": true}', where)
    return value


def bf16_key(ds: dict) -> str:
    """The key that holds BF16's section: like DeepSpeed, `bfloat16` when `bf16` is absent."""
    return "bf16" if ds.get("bf16") is not None or "bfloat16" not in ds else "bfloat16"


def precision(ds: dict, where: str = "") -> tuple[bool, bool]:
    """(bf16, fp16) enabled."""
    key = bf16_key(ds)
    bf16 = boolean(f"{key}.enabled", _section(ds, key, where).get("enabled", False), where)
    fp16 = boolean("fp16.enabled", _section(ds, "fp16", where).get("enabled", False), where)
    if bf16 and fp16:
        raise ConfigError(f"{key}.enabled and fp16.enabled", (bf16, fp16), "at most one of them true", where)
    return bf16, fp16


def gradient_clipping(ds: dict, where: str = "") -> float:
    """The global gradient-norm clip; 0.0 means off. DeepSpeed clips only when the value is
    > 0 (stage_1_and_2.py, stage3.py, engine.py), so a negative value is "off" there and
    here, never a negative factor."""
    clip = number("gradient_clipping", ds.get("gradient_clipping", _CLIP_DEFAULT), where=where)
    return max(clip, 0.0)


def batch_sizes(ds: dict, world_size: int, where: str = "") -> tuple[int, int]:
    """(micro-batch, gradient accumulation) by DeepSpeed's rule: train_batch_size =
    micro-batch x accumulation x world size; any two determine the third (accumulation
    defaults to 1)."""
    micro, accum, total = batch_keys(ds, where)
    if micro is None and total is None:
        raise ConfigError("train_micro_batch_size_per_gpu", None,
                          "an integer >= 1 (or set train_batch_size); one of the two is needed", where)
    if micro is None:
        micro = total // ((accum or 1) * world_size)
    if accum is None:
        accum = total // (micro * world_size) if total is not None else 1
    if micro < 1 or accum < 1 or (total is not None and total != micro * accum * world_size):
        raise ConfigError("train_batch_size", total, f"train_micro_batch_size_per_gpu {micro} x "
                          f"gradient_accumulation_steps {accum} x world size {world_size}, each factor >= 1", where)
    return micro, accum


def batch_keys(ds: dict, where: str = "") -> tuple[int | None, int | None, int | None]:
    """(train_micro_batch_size_per_gpu, gradient_accumulation_steps, train_batch_size), each
    an integer >= 1 or None when absent; DeepSpeed would fail on a string with a bare
    TypeError that names no key."""
    keys = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    return tuple(None if ds.get(k) is None else integer(k, ds[k], lo=1, where=where) for k in keys)


# The keys DeepSpeed takes in `zero_optimization` (the fields of its DeepSpeedZeroConfig and their
# aliases, as of 0.19.8; it refuses any other), for the FSDP engine, which reads only `stage` and
# must not import DeepSpeed; tests/test_deepspeed_config.py holds them to the installed DeepSpeed's.
ZERO_KEYS = (
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "compute_grad_norm", "load_from_fp32_weights",
    "elastic_checkpoint", "offload_param", "offload_optimizer", "zenflow", "sub_group_size", "cpu_offload_param",
    "cpu_offload_use_pin_memory", "cpu_offload", "prefetch_bucket_size", "stage3_prefetch_bucket_size",
    "param_persistence_threshold", "stage3_param_persistence_threshold", "model_persistence_threshold",
    "stage3_model_persistence_threshold", "max_live_parameters", "stage3_max_live_parameters", "max_reuse_distance",
    "stage3_max_reuse_distance", "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold", "stage3_module_granularity_threshold", "use_all_reduce_for_fetch_params",
    "stage3_use_all_reduce_for_fetch_params", "allgather_sequential", "stage3_allgather_sequential",
    "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients",
    "parameter_alignment", "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients", "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
    "log_trace_cache_warnings", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "leaf_module")


def check_zero_keys(ds: dict, where: str = "") -> None:
    """Refuse a key of `zero_optimization` outside ZERO_KEYS, naming it and the valid ones, as
    DeepSpeed does (where the section is no object, `zero_stage` says so)."""
    section = ds.get("zero_optimization")
    if isinstance(section, dict):
        check_keys("zero_optimization", section, ZERO_KEYS, source=where)


def zero_stage(ds: dict, where: str = "") -> int:
    section = ds.get("zero_optimization")
    if section is None:
        return 0
    if not isinstance(section, dict):
        raise ConfigError("zero_optimization", section, 'an object such as {"stage": 2}', where)
    return integer("zero_optimization.stage", section.get("stage", 0), lo=0, hi=3, where=where)


# The optimizers coat_ds builds from an `optimizer` section, by the `type` that names them.
OPTIMIZERS = {"CoatAdamW": CoatAdamW, "AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}
# The keys `optimizer.params` may hold for each: its keyword arguments.
OPTIMIZER_ARGUMENTS = {name: tuple(n for n in inspect.signature(cls).parameters if n != "params")
                       for name, cls in OPTIMIZERS.items()}
# DeepSpeed's own switches in an Adam/AdamW `params` section that torch.optim does not take:
# `torch_adam` picks torch's implementation (what we use anyway), `adam_w_mode` AdamW or Adam.
DEEPSPEED_ONLY_ADAM_KEYS = ("torch_adam", "adam_w_mode")
_SECTION = 'an object {"type": "CoatAdamW" | "AdamW" | "Adam", "params": {...}}'


def optimizer_section(ds: dict, where: str = "", *, checked=tuple(OPTIMIZERS), pass_others: bool = False,
                      required: bool = False) -> tuple[str, dict] | None:
    """The JSON's optimizer as (type, keyword arguments), or None where it names none (no
    section, or one without `type`; an error naming `optimizer` if `required`). The one
    reader of the `optimizer` section.

    A type of `checked` (matched in any case; the optimizers coat_ds builds) comes back as
    its name in OPTIMIZERS, with its `params` checked: the section holds only `type` and
    `params`, `params` only the optimizer's keyword arguments, a list `betas` becomes a
    tuple. For Adam and AdamW, DeepSpeed's rule holds ("Adam" is AdamW unless `adam_w_mode`
    is false) and its own switches are dropped. Any other type is an error naming
    `optimizer.type`, or with `pass_others` (DeepSpeed builds and checks it) comes back as
    given, with a copy of its `params`. Errors name `where` (a file) when given."""
    section = ds.get("optimizer")
    if not isinstance(section, dict) and (section is not None or required):
        raise ConfigError("optimizer", section, _SECTION, where)
    kind = section.get("type") if section is not None else None
    if kind is None:
        if required:
            raise ConfigError("optimizer", section, _SECTION, where)
        return None
    name = {n.lower(): n for n in checked}.get(kind.lower()) if isinstance(kind, str) else None
    if name is None:
        if pass_others and isinstance(kind, str) and kind:
            return kind, dict(section.get("params") or {})
        raise ConfigError("optimizer.type", kind, ", ".join(checked[:-1]) + f" or {checked[-1]}"
                          if len(checked) > 1 else checked[0], where)
    check_keys("optimizer", section, ("type", "params"), source=where)
    params = section.get("params") or {}
    if not isinstance(params, dict):
        raise ConfigError("optimizer.params", params, "an object of keyword arguments", where)
    params = dict(params)
    if name != "CoatAdamW":
        # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
        adam_w_mode = boolean("optimizer.params.adam_w_mode", params.get("adam_w_mode", True), where)
        name = "AdamW" if name == "AdamW" or adam_w_mode else "Adam"
    extra = DEEPSPEED_ONLY_ADAM_KEYS if name != "CoatAdamW" else ()
    check_keys(f"optimizer.params of {kind}", params, OPTIMIZER_ARGUMENTS[name] + extra, source=where)
    params = {k: v for k, v in params.items() if k not in extra}
    if isinstance(params.get("betas"), list):
        params["betas"] = tuple(params["betas"])
    return name, params
