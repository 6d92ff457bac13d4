"""The one reader of a DeepSpeed JSON: loading it, and each engine-level value our code takes
from it, read the way DeepSpeed 0.19 reads it and type-checked strictly.

Where DeepSpeed is lax we refuse instead of guessing: its pydantic models turn
`"enabled": "false"` (a string) into False and `"f"`, `0` or `1.0` into booleans, and a
string batch size only fails deep inside DeepSpeed. A value either means the same thing
under `--engine deepspeed` and `--engine fsdp`, or it is an error naming the key.
"""
from __future__ import annotations

import copy
import json
import os

from .checks import ConfigError, boolean, integer, number

__all__ = ["load_ds_config", "precision", "gradient_clipping", "batch_sizes", "zero_stage"]

# DeepSpeed's default when the key is absent (deepspeed/runtime/constants.py): clip at 1.0.
_CLIP_DEFAULT = 1.0


def load_ds_config(config) -> dict:
    """A DeepSpeed config as a fresh dict: a dict (deep-copied) or the path of a JSON file."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
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


def _section(ds: dict, key: str, where: str) -> dict:
    value = ds.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(key, value, 'an object such as {"enabled": true}', where)
    return value


def precision(ds: dict, where: str = "") -> tuple[bool, bool]:
    """(bf16, fp16) enabled. Like DeepSpeed, `bfloat16` is read when `bf16` is absent."""
    bf16_key = "bf16" if ds.get("bf16") is not None or "bfloat16" not in ds else "bfloat16"
    bf16 = boolean(f"{bf16_key}.enabled", _section(ds, bf16_key, where).get("enabled", False), where)
    fp16 = boolean("fp16.enabled", _section(ds, "fp16", where).get("enabled", False), where)
    if bf16 and fp16:
        raise ConfigError(f"{bf16_key}.enabled and fp16.enabled", (bf16, fp16), "at most one of them true", where)
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
    keys = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    micro, accum, total = (None if ds.get(k) is None else integer(k, ds[k], lo=1, where=where) for k in keys)
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


def zero_stage(ds: dict, where: str = "") -> int:
    section = ds.get("zero_optimization")
    if section is None:
        return 0
    if not isinstance(section, dict):
        raise ConfigError("zero_optimization", section, 'an object such as {"stage": 2}', where)
    return integer("zero_optimization.stage", section.get("stage", 0), lo=0, hi=3, where=where)
