"""FP8 format constants shared by the Triton kernels and their pure-torch twins."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = ["Fp8Format", "E4M3", "E5M2", "get_format", "triton_usable", "K_ONE", "K_MIN_CODE", "K_MAX_CODE"]

# DRE exponents are stored as uint8 multiples of 1/16 (k = code / 16), which is why the
# reference implementation rounds k down to a multiple of 1/16.
K_ONE = 16
# k = 8 is the largest useful expansion.
K_MAX_CODE = 128
# k >= 1/4: FP8's rounding error of the mapped value is raised to the power 1/k, so k = 1/16
# gave up to 150 % (E4M3) on every element of a group spanning 40+ decades. With k >= 1/4
# the top 16 decades of any group keep E4M3's error under 26 % (E5M2: 52 %, docs/optimizer.md);
# elements further down are coarser, and those below the format's range decode to the
# group's smallest code instead of 0, so no second moment is flushed.
K_MIN_CODE = 4


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 encoding: its limits and the Dynamic Range Expansion target."""

    name: str
    dtype: torch.dtype
    max: float
    mantissa_bits: int
    exponent_bias: int
    min_normal_exp: int
    code_max: int  # the saturated code for +max (sign bit clear)
    dre_log2_range: float  # log2 of the max/min ratio that DRE stretches a group to

    @property
    def log2_max(self) -> float:
        return math.log2(self.max)

    @property
    def min_subnormal(self) -> float:
        """The smallest positive value of the format."""
        return 2.0 ** (self.min_normal_exp - self.mantissa_bits)

    @property
    def id(self) -> int:
        """Integer tag passed to kernels as a constexpr."""
        return 0 if self.name == "e4m3" else 1


def _dre_range(max_value: float, min_normal_exp: int, mantissa_bits: int) -> float:
    # After power-of-two scaling a group's max lands in (max/2, max]. Its min may reach
    # into the subnormals by all but one mantissa bit: measured on real AdamW moments
    # (tests/test_dre.py), the larger k wins more than the few coarse subnormals lose,
    # while one bit further flushes the smallest second moments to zero.
    return math.log2(max_value / 2) - min_normal_exp + (mantissa_bits - 1)


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 3, 7, -6, 0x7E, _dre_range(448.0, -6, 3))
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2, 15, -14, 0x7B, _dre_range(57344.0, -14, 2))

_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def get_format(name: str | Fp8Format) -> Fp8Format:
    if isinstance(name, Fp8Format):
        return name
    key = str(name).lower().replace("_", "").replace("fn", "")
    if key not in _FORMATS:
        raise ValueError(f"unknown FP8 format {name!r}; expected one of {sorted(_FORMATS)}")
    return _FORMATS[key]


@lru_cache(maxsize=None)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def triton_usable(device: torch.device) -> bool:
    """True where the Triton kernels can run on tensors of `device`.

    CUDA tensors use compiled kernels; CPU tensors only under TRITON_INTERPRET=1 (tests)."""
    if not _triton_importable():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
