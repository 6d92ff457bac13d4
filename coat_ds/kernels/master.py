"""An FP32 master weight held as its BF16 value (the parameter itself) plus a signed remainder
of 16 or 8 bits, in torch ops: the twin of the step kernels' split and join, and the
conversions of CoatAdamW's `master_weights` (optim/master.py).

On the float's 32-bit pattern b (sign, exponent, mantissa; for a fixed sign larger patterns
are larger magnitudes):

* 16 bits (exact): the BF16 value is hi = (b + 0x8000) >> 16, b rounded to its top 16 bits,
  to nearest with ties away from zero; the remainder is b's low 16 bits read as a signed
  int16, in [-0x8000, 0x7FFF], so b = (hi << 16) + remainder for every pattern. (Ties to even,
  torch's rounding, would need the remainder +0x8000 as well: 65537 values, one too many.)
* 8 bits (lossy): the master is b rounded to its top 24 bits, c = (b + 0x80) >> 8 (ties
  away; where that would carry into the exponent of inf, truncated instead, so a finite
  master stays finite), kept as hi = (c + 0x80) >> 8 and the int8 remainder c - (hi << 8).
  The master read back, c << 8, has 15 explicit mantissa bits: relative error at most 2**-16
  for normal values (2**-15 within half a step of the largest float), absolute error at most
  2**-142 for subnormals; zeros, signs and values with 15 or fewer mantissa bits are exact.

In both the BF16 value is the master read back rounded to BF16 (to nearest, ties away from
zero). A NaN master keeps BF16 NaN and remainder 0.
"""
from __future__ import annotations

import torch

__all__ = ["MASTER_KINDS", "REMAINDER_DTYPES", "remainder_bits", "split", "join"]

# master_weights -> bits of the remainder (0: the parameter itself is the FP32 master).
MASTER_KINDS = {"fp32": 0, "bf16+16": 16, "bf16+8": 8}
REMAINDER_DTYPES = {16: torch.int16, 8: torch.int8}
_EXP24 = 0xFF << 15  # exponent field of a float's top 24 bits


def remainder_bits(remainder: torch.Tensor | None) -> int:
    """16 or 8 for a remainder tensor (by its dtype), 0 for None."""
    if remainder is None:
        return 0
    for bits, dtype in REMAINDER_DTYPES.items():
        if remainder.dtype == dtype:
            return bits
    raise ValueError(f"a master remainder is int16 or int8, got {remainder.dtype}")


def _bits(x: torch.Tensor) -> torch.Tensor:
    """x's float32 bit patterns as non-negative int64."""
    return x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _signed(u: torch.Tensor, bits: int) -> torch.Tensor:
    """The low `bits` bits of `u` (int64) read as a signed integer."""
    half = 1 << (bits - 1)
    return ((u & ((1 << bits) - 1)) ^ half) - half


def split(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(BF16 value, remainder) of the float32 master `x` for a `bits`-bit remainder."""
    b = _bits(x)
    if bits == 16:
        hi, rem = (b + 0x8000) >> 16, _signed(b, 16)
    elif bits == 8:
        c = (b + 0x80) >> 8
        c = torch.where(((c & _EXP24) == _EXP24) & ((b >> 8 & _EXP24) != _EXP24), b >> 8, c)
        hi = (c + 0x80) >> 8
        rem = c - (hi << 8)
    else:
        raise ValueError(f"a master remainder has 16 or 8 bits, got {bits}")
    nan = torch.isnan(x)
    hi = torch.where(nan, 0x7FC0, hi)
    rem = torch.where(nan, 0, rem)
    return (_signed(hi, 16).to(torch.int16).view(torch.bfloat16).reshape(x.shape),
            rem.to(REMAINDER_DTYPES[bits]).reshape(x.shape))


def join(hi: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The float32 master held as BF16 `hi` and `remainder` (int16 or int8): a new tensor."""
    bits = remainder_bits(remainder)
    h = hi.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    r = remainder.to(torch.int64)
    b = ((h << 16) + r) if bits == 16 else ((h << 8) + r) << 8
    return _signed(b, 32).to(torch.int32).view(torch.float32).reshape(hi.shape)
