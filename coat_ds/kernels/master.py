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
zero). A NaN master keeps BF16 NaN and remainder 0. `store_master` / `load_master` are the
same in Triton, for the fused AdamW step (adamw.py).
"""
from __future__ import annotations

import torch

from .jit import jit

__all__ = ["MASTER_KINDS", "REMAINDER_DTYPES", "remainder_bits", "slots_kind", "split", "join", "load_master",
           "store_master"]

triton = tl = None  # jit.bind sets them when a Triton backend is chosen

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


def slots_kind(slots) -> int:
    """The remainder bits every AdamW slot of one launch shares (0: none); raises ValueError
    for a remainder that does not go with its BF16 parameter, or for mixed kinds."""
    kinds = {remainder_bits(s.remainder) for s in slots}
    for s in slots:
        r = s.remainder
        if r is not None and not (s.param.dtype == torch.bfloat16 and r.is_contiguous() and r.shape == s.param.shape):
            raise ValueError("a master remainder goes with a BF16 parameter of its shape, both contiguous")
    if len(kinds) > 1:
        raise ValueError(f"one launch steps slots of one master kind, got remainders of {sorted(kinds)} bits")
    return kinds.pop() if kinds else 0


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


@jit
def load_master(hi_ptr, lo_ptr, offs, mask, BITS: tl.constexpr):
    """`join` in Triton: BF16 bits at `hi_ptr` (an int16 pointer), the remainder at `lo_ptr`
    (int16 for BITS 16, int8 for 8)."""
    h = tl.load(hi_ptr + offs, mask=mask, other=0).to(tl.int32).to(tl.uint32, bitcast=True) & 0xFFFF
    r = tl.load(lo_ptr + offs, mask=mask, other=0).to(tl.int32).to(tl.uint32, bitcast=True)
    if BITS == 16:
        b = (h << 16) + r
    else:
        b = ((h << 8) + r) << 8
    return b.to(tl.float32, bitcast=True)


@jit
def store_master(hi_ptr, lo_ptr, x, offs, mask, BITS: tl.constexpr):
    """`split` of float32 `x` in Triton, stored as `load_master` reads it."""
    b = x.to(tl.uint32, bitcast=True)
    if BITS == 16:
        hi = (b + 0x8000) >> 16
        lo = (b & 0xFFFF).to(tl.int32) - ((b & 0x8000) << 1).to(tl.int32)
    else:
        c = (b + 0x80) >> 8
        exp24: tl.constexpr = 0xFF << 15
        c = tl.where(((c & exp24) == exp24) & (((b >> 8) & exp24) != exp24), b >> 8, c)  # no carry into inf
        hi = (c + 0x80) >> 8
        lo = c.to(tl.int32) - (hi << 8).to(tl.int32)
    nan = x != x
    hi = tl.where(nan, 0x7FC0, hi).to(tl.int32)
    hi = hi - ((hi & 0x8000) << 1)  # as a signed 16-bit value
    lo = tl.where(nan, 0, lo)
    tl.store(hi_ptr + offs, hi.to(tl.int16), mask=mask)
    if BITS == 16:
        tl.store(lo_ptr + offs, lo.to(tl.int16), mask=mask)
    else:
        tl.store(lo_ptr + offs, lo.to(tl.int8), mask=mask)
