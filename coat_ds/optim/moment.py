"""One quantized AdamW moment as one object: FP8 codes with per-group DRE metadata.

In a parameter's state dict (and so in every checkpoint) a quantized moment `<name>` lives
under four flat keys, `<name>_codes` (uint8 FP8 bit patterns, the moment's shape) and the
per-group `<name>_center` (float32), `<name>_kcode` (uint8, DRE exponent * 16) and
`<name>_sexp` (int8, power-of-two scale exponent), shaped (rows, groups_per_row), see
`kernels/layout.py`. `Fp8Moment` reads and writes those keys and is the only code that
converts them to and from FP32, for every checkpoint path (DCP, FSDP1, DeepSpeed
consolidation and migration). The step kernels read its inner tensors (`groups`) directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..config import OptimStateConfig
from ..kernels import QuantizedGroups, get, group_layout

__all__ = ["MOMENTS", "PART_DTYPES", "Fp8Moment", "moment_format"]

MOMENTS = ("exp_avg", "exp_avg_sq")
# dtype of each part, in QuantizedGroups order (the order of `Fp8Moment.keys`)
PART_DTYPES = dict(zip(QuantizedGroups._fields, (torch.uint8, torch.float32, torch.uint8, torch.int8)))


def moment_format(cfg: OptimStateConfig, name: str) -> str:
    """The FP8 format `cfg` stores moment `name` ("exp_avg" or "exp_avg_sq") in."""
    return {"exp_avg": cfg.first_moment_format, "exp_avg_sq": cfg.second_moment_format}[name]


Transform = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Fp8Moment:
    """A moment's FP8 codes and per-group DRE metadata, with the format and group size that
    decode them: x = sign(q) * (|q| * 2**sexp) ** (16 / kcode) * center."""

    groups: QuantizedGroups
    fmt: str  # "e4m3" or "e5m2"
    group_size: int

    @staticmethod
    def keys(name: str) -> tuple[str, ...]:
        """The flat state-dict keys of moment `name`, in `QuantizedGroups` order."""
        return tuple(f"{name}_{part}" for part in QuantizedGroups._fields)

    @staticmethod
    def stored_in(state: dict, name: str) -> bool:
        """Whether `state` keeps moment `name` quantized (else as an FP32 tensor `name`)."""
        return f"{name}_codes" in state

    @classmethod
    def from_state(cls, state: dict, name: str, cfg: OptimStateConfig) -> "Fp8Moment":
        """Moment `name` of a parameter's state (its tensors, not copies)."""
        return cls(QuantizedGroups(*(state[k] for k in cls.keys(name))), moment_format(cfg, name), cfg.group_size)

    def into_state(self, state: dict, name: str) -> None:
        """Write this moment's tensors under the flat keys of moment `name`."""
        state.update(zip(self.keys(name), self.groups))

    @classmethod
    def zeros(cls, shape: torch.Size, device: torch.device, name: str, cfg: OptimStateConfig) -> "Fp8Moment":
        """Moment `name` of a new state: every element 0 (code 0, centre 1, k = 1, scale 1)."""
        meta = group_layout(shape, cfg.group_size).meta_shape
        return cls(QuantizedGroups(torch.zeros(shape, dtype=torch.uint8, device=device),
                                   torch.ones(meta, dtype=torch.float32, device=device),
                                   torch.full(meta, 16, dtype=torch.uint8, device=device),
                                   torch.zeros(meta, dtype=torch.int8, device=device)),
                   moment_format(cfg, name), cfg.group_size)

    @classmethod
    def from_fp32(cls, x: torch.Tensor, name: str, cfg: OptimStateConfig) -> "Fp8Moment":
        """Moment `name` quantized from the FP32 tensor `x` (on its device) as `cfg` says."""
        fmt = moment_format(cfg, name)
        groups = get("group_codec", x.device, cfg.backend).quantize(x.detach().to(torch.float32), cfg.group_size, fmt,
                                                                    cfg.dynamic_range_expansion)
        return cls(groups, fmt, cfg.group_size)

    def to_fp32(self, backend: str = "auto") -> torch.Tensor:
        """The decoded moment: a new FP32 tensor shaped like the codes, on their device."""
        return get("group_codec", self.groups.codes.device, backend).dequantize(self.groups, self.group_size, self.fmt)

    def map(self, codes: Transform, meta: Transform) -> "Fp8Moment":
        """The same moment with `codes` applied to the codes and `meta` to each per-group
        tensor (a sharded view, a reshape, a device move)."""
        return Fp8Moment(QuantizedGroups(codes(self.groups.codes), *map(meta, self.groups[1:])), self.fmt,
                         self.group_size)
